/* kernels/msda_backward.cu: MSDA backward on CUDA.
 *
 * With g = grad_out[b,q,h,:], s = bilinear sample of (b,q,h,l,p), A its weight, (fx, fy) its
 * in-cell fraction and v0..v3 its corners (k = 2*dy + dx):
 *   grad_A        = sum_c g[c] * s[c]
 *   grad_loc_x    = A * W_l * sum_c g[c] * ((1-fy)(v1-v0) + fy(v3-v2))[c]
 *   grad_loc_y    = A * H_l * sum_c g[c] * ((1-fx)(v2-v0) + fx(v3-v1))[c]
 *   grad_value[corner k] += A * w_k * g          (scattered; f32 buffer for half dtypes)
 * Thread map: one warp per (b, q, h); lane j owns channels j, j+32, ...; the per-point sums over
 *   channels are warp-shuffle reductions written by lane 0 (deterministic); grad_value is
 *   accumulated with atomicAdd after a cudaMemsetAsync on the same stream.
 * Numerics: f32 accumulation for f32/f16/bf16 (grad_value too), f64 for f64.
 * Tried: v1 (this) warp per (b, q, h), the correct-first version; speed work comes next.
 */
#include "common.cuh"

// ---------------------------------------------------------------------------------------------
// helpers

template <typename Acc> __device__ __forceinline__ Acc warp_sum(Acc v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// ---------------------------------------------------------------------------------------------
// kernel

template <typename T>
__global__ void __launch_bounds__(256) msda_backward_kernel(msda_problem pr) {
    typedef typename AccOf<T>::type Acc;
    const T *value = (const T *)pr.value;
    const T *loc = (const T *)pr.sampling_locations;
    const T *attn = (const T *)pr.attention_weights;
    const T *gout = (const T *)pr.grad_output;
    Acc *grad_value = (Acc *)pr.grad_value;
    T *grad_loc = (T *)pr.grad_sampling_locations;
    T *grad_attn = (T *)pr.grad_attention_weights;
    const bool point_grads = grad_loc || grad_attn;
    const int64_t S = pr.S, H = pr.H, C = pr.C, L = pr.L, Q = pr.Q, P = pr.P;
    const int lane = threadIdx.x & 31;
    const int64_t n_items = pr.B * Q * H;
    const int64_t stride = ((int64_t)gridDim.x * blockDim.x) >> 5;
    for (int64_t qh = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) >> 5; qh < n_items;
         qh += stride) {
        const int64_t b = qh / (Q * H), h = qh % H;
        for (int64_t l = 0; l < L; l++) {
            const int64_t H_l = load_index(pr.spatial_shapes, pr.index_dtype, 2 * l);
            const int64_t W_l = load_index(pr.spatial_shapes, pr.index_dtype, 2 * l + 1);
            const int64_t start = load_index(pr.level_start_index, pr.index_dtype, l);
            for (int64_t p = 0; p < P; p++) {
                const int64_t i = (qh * L + l) * P + p;
                Point<Acc> pt;
                const bool hit = sample_point<Acc>(to_acc(loc[2 * i]), to_acc(loc[2 * i + 1]),
                                                   H_l, W_l, start, S, H, C, b, h, pt);
                Acc g_attn = 0, g_fx = 0, g_fy = 0;
                const Acc a = to_acc(attn[i]);
                if (hit) {
                    for (int64_t c = lane; c < C; c += 32) {
                        const Acc g = to_acc(gout[qh * C + c]);
                        Acc v[4];
#pragma unroll
                        for (int k = 0; k < 4; k++) {
                            v[k] = pt.inside[k] ? to_acc(value[pt.off[k] + c]) : (Acc)0;
                            if (grad_value && pt.inside[k])
                                atomicAdd(grad_value + pt.off[k] + c, a * pt.w[k] * g);
                        }
                        if (point_grads) {
                            g_attn += g * (pt.w[0] * v[0] + pt.w[1] * v[1] + pt.w[2] * v[2] +
                                           pt.w[3] * v[3]);
                            g_fx += g * (((Acc)1 - pt.fy) * (v[1] - v[0]) + pt.fy * (v[3] - v[2]));
                            g_fy += g * (((Acc)1 - pt.fx) * (v[2] - v[0]) + pt.fx * (v[3] - v[1]));
                        }
                    }
                }
                if (!point_grads) continue;
                g_attn = warp_sum(g_attn);
                g_fx = warp_sum(g_fx);
                g_fy = warp_sum(g_fy);
                if (lane == 0) {
                    if (grad_attn) grad_attn[i] = from_acc<T>(g_attn);
                    if (grad_loc) {
                        grad_loc[2 * i] = from_acc<T>(a * g_fx * (Acc)W_l);
                        grad_loc[2 * i + 1] = from_acc<T>(a * g_fy * (Acc)H_l);
                    }
                }
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// launcher

template <typename T> static void launch(const msda_problem *pr, cudaStream_t stream) {
    msda_backward_kernel<T><<<warp_blocks(pr->B * pr->Q * pr->H), 256, 0, stream>>>(*pr);
}

// ---------------------------------------------------------------------------------------------
// entry point

extern "C" int msda_cuda_backward(const msda_problem *pr) {
    static const char fn[] = "msda_backward";
    DeviceGuard guard;
    MSDA_CUDA_CHECK(fn, guard.select(pr->device));
    cudaGetLastError(); /* clear an error an earlier call of this thread left behind */
    cudaStream_t stream = (cudaStream_t)pr->stream;
    if (pr->grad_value) {
        const int64_t acc_size = pr->dtype == MSDA_F64 ? 8 : 4;
        const size_t bytes = (size_t)(pr->B * pr->S * pr->H * pr->C * acc_size);
        MSDA_CUDA_CHECK(fn, cudaMemsetAsync(pr->grad_value, 0, bytes, stream));
    }
    if (pr->B * pr->Q == 0) return MSDA_OK;
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
