/* kernels/level_starts.cu: msda_level_starts on a CUDA device. One thread walks the L levels
 * (a few dozen at most in any model), so the tables never leave the device: reading
 * spatial_shapes on the host would synchronise.
 * Tried first: the MSDA kernels deriving the starts themselves where level_start_index is NULL
 * (in load_levels and the generic kernels' level loops). Never run with the starts given, that
 * code still changed the register allocation of the fast kernels (the aggregated backward 46
 * -> 48 registers; with the derivation a __noinline__ call, 46 -> 47-48), and the backward
 * slowed with the starts given (H200, bench f32 / bf16 ms, alternated twice in one session):
 * dino_dec900 0.072 / 0.049 -> 0.075 / 0.053, rtdetr_dec_b8 0.085 / 0.053 -> 0.087 / 0.059,
 * ddetr_enc 0.413 / 0.389 -> 0.418 / 0.398. A kernel of its own leaves their machine code as
 * it was (compared with cuobjdump). */
#include "common.cuh"

__global__ void level_starts_kernel(int64_t L, int64_t S, int index_dtype,
                                    const void *spatial_shapes, void *level_start_index) {
    msda_derive_level_starts(L, S, index_dtype, spatial_shapes, level_start_index);
}

extern "C" int msda_cuda_level_starts(int64_t L, int64_t S, int index_dtype, int device,
                                      const void *spatial_shapes, void *level_start_index,
                                      void *stream) {
    static const char fn[] = "msda_level_starts";
    DeviceGuard guard;
    MSDA_CUDA_CHECK(fn, guard.select(device));
    cudaGetLastError(); /* clear an error an earlier call of this thread left behind */
    level_starts_kernel<<<1, 1, 0, (cudaStream_t)stream>>>(L, S, index_dtype, spatial_shapes,
                                                           level_start_index);
    MSDA_CUDA_CHECK(fn, cudaGetLastError());
    return MSDA_OK;
}
