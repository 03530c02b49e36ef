/* kernels/msda_forward.cu: MSDA forward on CUDA.
 *
 * out[b,q,h,c] = sum_{l,p} A[b,q,h,l,p] * bilinear(V_l[b,:,:,h,c], x = loc_x*W_l - 0.5,
 *                                                                  y = loc_y*H_l - 0.5)
 * Thread map: one warp per (b, q, h); lane j owns channels j, j+32, j+64, ... Every lane reads the
 *   same location and weight (a broadcast load); the 32 lanes of a corner read 32 consecutive
 *   channels of one value row (coalesced).
 * Numerics: f32 accumulation for f32/f16/bf16, f64 for f64; corners outside the level or outside
 *   [0, S) contribute 0 (see sample_point in common.cuh).
 * Tried: v1 (this) warp per (b, q, h), the correct-first version; speed work comes next.
 */
#include "common.cuh"

// ---------------------------------------------------------------------------------------------
// kernel

template <typename T>
__global__ void __launch_bounds__(256) msda_forward_kernel(msda_problem pr) {
    typedef typename AccOf<T>::type Acc;
    const T *value = (const T *)pr.value;
    const T *loc = (const T *)pr.sampling_locations;
    const T *attn = (const T *)pr.attention_weights;
    T *out = (T *)pr.output;
    const int64_t S = pr.S, H = pr.H, C = pr.C, L = pr.L, Q = pr.Q, P = pr.P;
    const int lane = threadIdx.x & 31;
    const int64_t n_items = pr.B * Q * H;
    const int64_t stride = ((int64_t)gridDim.x * blockDim.x) >> 5;
    for (int64_t qh = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) >> 5; qh < n_items;
         qh += stride) {
        const int64_t b = qh / (Q * H), h = qh % H;
        for (int64_t c0 = 0; c0 < C; c0 += 32) {
            const int64_t c = c0 + lane;
            Acc acc = 0;
            for (int64_t l = 0; l < L; l++) {
                const int64_t H_l = load_index(pr.spatial_shapes, pr.index_dtype, 2 * l);
                const int64_t W_l = load_index(pr.spatial_shapes, pr.index_dtype, 2 * l + 1);
                const int64_t start = load_index(pr.level_start_index, pr.index_dtype, l);
                for (int64_t p = 0; p < P; p++) {
                    const int64_t i = (qh * L + l) * P + p;
                    Point<Acc> pt;
                    if (!sample_point<Acc>(to_acc(loc[2 * i]), to_acc(loc[2 * i + 1]), H_l, W_l,
                                           start, S, H, C, b, h, pt))
                        continue;
                    const Acc a = to_acc(attn[i]);
                    if (c < C) {
#pragma unroll
                        for (int k = 0; k < 4; k++)
                            if (pt.inside[k]) acc += a * pt.w[k] * to_acc(value[pt.off[k] + c]);
                    }
                }
            }
            if (c < C) out[qh * C + c] = from_acc<T>(acc);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// launcher

template <typename T> static void launch(const msda_problem *pr, cudaStream_t stream) {
    msda_forward_kernel<T><<<warp_blocks(pr->B * pr->Q * pr->H), 256, 0, stream>>>(*pr);
}

// ---------------------------------------------------------------------------------------------
// entry point

extern "C" int msda_cuda_forward(const msda_problem *pr) {
    static const char fn[] = "msda_forward";
    DeviceGuard guard;
    MSDA_CUDA_CHECK(fn, guard.select(pr->device));
    cudaGetLastError(); /* clear an error an earlier call of this thread left behind */
    cudaStream_t stream = (cudaStream_t)pr->stream;
    switch (pr->dtype) {
    case MSDA_F32: launch<float>(pr, stream); break;
    case MSDA_F64: launch<double>(pr, stream); break;
    case MSDA_F16: launch<__half>(pr, stream); break;
    case MSDA_BF16: launch<__nv_bfloat16>(pr, stream); break;
    default: return msda_set_error(MSDA_ERR_INTERNAL, "%s: dtype %d", fn, pr->dtype);
    }
    MSDA_CUDA_CHECK(fn, cudaGetLastError());
    return MSDA_OK;
}
