/* kernels/level_starts.cu: msda_level_starts on a CUDA device. One thread walks the L levels
 * (a few dozen at most in any model), so the tables never leave the device: reading
 * spatial_shapes on the host would synchronise.
 * (The kernels deriving the starts themselves slowed the backward by changing its register
 * allocation: kernels/TUNING.md, level starts.) */
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
