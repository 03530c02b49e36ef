/* kernels/backward_generic.cuh: the generic backward (MSDA_ROUTE_GENERIC; gradients: c/msda.h).
 * Serves what the fast kernels cannot: f64, C other than 4 * 2^k up to 128, more than 2^31 value
 * elements or items, misaligned tensors. Thread map: one warp per (b, q, h) item (grid-stride),
 * lane j owns channels j, j+32, ...; 64-bit offsets throughout. Each corner's A * w_k * g goes
 * to grad_value by atomics (fixed point with MSDA_DETERMINISTIC; one 2-byte atomic a channel in
 * half types on sm_90); the point gradients are warp-shuffle sums written by lane 0. Options:
 * per-level points, nearest, softmax (the logit gradient rewritten at the item's end). */
#pragma once

#include "backward_common.cuh"

/* DET: grad_value goes to the workspace's 64-bit fixed-point accumulator (see common.cuh).
 * Half types: grad_value is T with NativeHalf unless WS (one 2-byte atomic a channel and corner),
 * else the f32 buffer the host put in its place (WS: float32 points, c/routes.c). */
template <typename T, bool DET, bool WS = false>
__global__ void __launch_bounds__(256) msda_backward_kernel(msda_problem pr) {
    typedef typename AccOf<T>::type Acc;
    constexpr bool NATIVE = NativeHalf<T, DET>::value && !WS;
    const T *value = (const T *)pr.value;
    const PointTensor<T> loc(pr.sampling_locations, pr), attn(pr.attention_weights, pr);
    const T *gout = (const T *)pr.grad_output;
    Acc *grad_value = (Acc *)pr.grad_value;
    const PointTensor<T> grad_loc(pr.grad_sampling_locations, pr);
    const PointTensor<T> grad_attn(pr.grad_attention_weights, pr);
    const bool point_grads = grad_loc || grad_attn;
    const bool nearest = pr.flags & MSDA_NEAREST, softmax = pr.flags & MSDA_SOFTMAX;
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
        Acc mx = 0, inv = 1, dot = 0; /* dot: sum over points of A * dL/dA (softmax) */
        if (softmax) softmax_stats<Acc>(attn + qh * NP, NP, lane, mx, inv);
        for (int64_t l = 0; l < L; l++) {
            const GenericLevel lv = generic_level(pr, l);
            const int64_t H_l = lv.H, W_l = lv.W, start = lv.start;
            for (int64_t p = lv.p_begin; p < lv.p_end; p++) {
                const int64_t i = qh * NP + p;
                Point<Acc> pt;
                const bool hit = generic_point<Acc>(pr, loc, i, H_l, W_l, start, b, h, pt);
                Acc g_attn = 0, g_fx = 0, g_fy = 0;
                const Acc a = attention<Acc>(pr, to_acc(attn[i]), mx, inv);
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
                dot += a * g_attn;
                if (lane == 0) {
                    /* with softmax, dL/dA for now; turned into dL/dlogit below */
                    if (grad_attn) grad_attn.set(i, g_attn);
                    if (grad_loc) { /* a point outside keeps zero gradients whatever its A */
                        const bool moves = hit && !nearest; /* nearest: piecewise constant */
                        grad_loc.set(2 * i, moves ? a * g_fx * (Acc)W_l : (Acc)0);
                        grad_loc.set(2 * i + 1, moves ? a * g_fy * (Acc)H_l : (Acc)0);
                    }
                }
            }
        }
        if (softmax && grad_attn) { /* dL/dz_j = A_j * (dL/dA_j - sum_k A_k dL/dA_k) */
            __syncwarp();
            for (int64_t j = lane; j < NP; j += 32) {
                const int64_t i = qh * NP + j;
                const Acc a = attention<Acc>(pr, to_acc(attn[i]), mx, inv);
                grad_attn.set(i, a * (to_acc(grad_attn[i]) - dot));
            }
            __syncwarp();
        }
    }
}
