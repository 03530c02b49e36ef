/* kernels/backward_generic.cuh: the generic backward (MSDA_ROUTE_GENERIC; gradients: c/msda.h).
 * Serves what the fast kernels cannot: f64, C other than 4 * 2^k up to 128, more than 2^31 value
 * elements or items, misaligned tensors. Thread map: one warp per (b, q, h) item (grid-stride),
 * lane j owns channels j, j+32, ...; 64-bit offsets throughout. Each corner's A * w_k * g goes
 * to grad_value by atomics (fixed point with MSDA_DETERMINISTIC; one 2-byte atomic a channel in
 * half types on sm_90); the point gradients are warp-shuffle sums written by lane 0. Options:
 * per-level points, nearest. */
#pragma once

#include "backward_common.cuh"

/* DET: grad_value goes to the workspace's 64-bit fixed-point accumulator (deterministic.cuh).
 * Half types: grad_value is T with NativeHalf (one 2-byte atomic a channel and corner), else the
 * f32 buffer the host put in its place (code older than sm_90, c/routes.c). */
template <typename T, bool DET>
__global__ void __launch_bounds__(MSDA_BLOCK_THREADS) msda_backward_kernel(msda_problem pr) {
    typedef typename AccOf<T>::type Acc;
    constexpr bool NATIVE = NativeHalf<T, DET>::value;
    const T *value = (const T *)pr.value;
    const PointTensor<T> loc(pr.sampling_locations, pr), attn(pr.attention_weights, pr);
    const T *gout = (const T *)pr.grad_output;
    Acc *grad_value = (Acc *)pr.grad_value;
    const PointTensor<T> grad_loc(pr.grad_sampling_locations, pr);
    const PointTensor<T> grad_attn(pr.grad_attention_weights, pr);
    const bool point_grads = grad_loc || grad_attn;
    const bool nearest = pr.flags & MSDA_NEAREST;
    const int64_t H = pr.H, C = pr.C, L = pr.L, Q = pr.Q, NP = pr.NP;
    long long *det_acc = nullptr;
    double scale = 0.0;
    if (DET && grad_value) {
        det_acc = (long long *)((char *)pr.workspace + MSDA_DET_HEADER_BYTES);
        scale = det_scale(pr, (const DetHeader *)pr.workspace);
    }
    const int lane = threadIdx.x & 31;
    const int64_t n_items = pr.B * Q * H;
    const int64_t stride = ((int64_t)gridDim.x * blockDim.x) >> 5;
    for (int64_t qh = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) >> 5; qh < n_items;
         qh += stride) {
        const int64_t b = qh / (Q * H), h = qh % H;
        for (int64_t l = 0; l < L; l++) {
            const GenericLevel lv = generic_level(pr, l);
            const int64_t H_l = lv.H, W_l = lv.W, start = lv.start;
            for (int64_t p = lv.p_begin; p < lv.p_end; p++) {
                const int64_t i = qh * NP + p;
                Point<Acc> pt;
                const bool hit = generic_point<Acc>(pr, loc, i, H_l, W_l, start, b, h, pt);
                Acc g_attn = 0, g_fx = 0, g_fy = 0;
                const Acc a = to_acc(attn[i]);
                if (hit) {
                    for (int64_t c = lane; c < C; c += 32) {
                        const Acc g = to_acc(gout[qh * C + c]);
                        Acc v[4];
#pragma unroll
                        for (int k = 0; k < 4; k++) {
                            v[k] = pt.inside[k] ? to_acc(value[pt.off[k] + c]) : (Acc)0;
                            if (!grad_value || !pt.inside[k]) continue;
                            if (DET) det_add(det_acc + pt.off[k] + c, a * pt.w[k] * g, (Acc)scale);
                            else if constexpr (NATIVE)
                                atomicAdd((T *)pr.grad_value + pt.off[k] + c,
                                          from_acc<T>(a * pt.w[k] * g));
                            else atomicAdd(grad_value + pt.off[k] + c, a * pt.w[k] * g);
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
                    if (grad_attn) grad_attn.set(i, g_attn);
                    if (grad_loc) { /* a point outside keeps zero gradients whatever its A */
                        const bool moves = hit && !nearest; /* nearest: piecewise constant */
                        grad_loc.set(2 * i, moves ? a * g_fx * (Acc)W_l : (Acc)0);
                        grad_loc.set(2 * i + 1, moves ? a * g_fy * (Acc)H_l : (Acc)0);
                    }
                }
            }
        }
    }
}
