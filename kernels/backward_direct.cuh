/* kernels/backward_direct.cuh: the direct per-point backward (MSDA_ROUTE_DIRECT; gradients:
 * c/msda.h), the backward form of the direct forward (kernels/forward.cuh): plain decoders of
 * few points an item or few items (c/routes.c).
 * Thread map: R = G * SPLIT lanes an item, G = C / 4 lanes of 4 channels for each of SPLIT
 * subsets of its points (lane s takes points s, s + SPLIT, ..., at most MAXP of them). Every
 * lane places its own points (place_point: no shared staging, no barrier but the level
 * table's) in phases whose loads are in flight together: the locations and weights, then every
 * corner (branch-free: a corner outside reads value's first row, zeroed by a select). It
 * reduces the point sums over its G lanes, and the first of them writes the point's location
 * and weight gradients. The scatter into grad_value comes last, after grid_dep_wait: the
 * kernel is zero_kernel's programmatic dependent, so everything before it overlaps the
 * zeroing. The corners' offsets and coefficients wait in registers. Needs S >= 1.
 * Numerics: f32 sums; grad_value as the per-point kernel adds it (vector atomics). */
#pragma once

#include "backward_common.cuh"
#include "backward_point.cuh"

template <int SPLIT_, int MAXP_> struct DirectBackwardForm {
    static constexpr int SPLIT = SPLIT_, MAXP = MAXP_, V = 4;
};

template <typename T, int G, typename Form>
__global__ void __launch_bounds__(MSDA_BLOCK_THREADS) msda_backward_direct(msda_problem pr) {
    constexpr int V = Form::V, SPLIT = Form::SPLIT, K = Form::MAXP, R = G * SPLIT,
                  IPB = MSDA_DIRECT_BLOCK_ITEMS(R);
    static_assert(R <= 32 && (R & (R - 1)) == 0, "an item's lanes: a power of two in one warp");
    __shared__ int4 s_lvl[MSDA_FAST_MAX_LEVELS];
    const int lane = threadIdx.x % R, g = lane % G, s = lane / G;
    const T *value = (const T *)pr.value + g * V;
    asm("" : "+l"(value));
    const T *gout = (const T *)pr.grad_output;
    constexpr bool NATIVE = NativeHalf<T, false>::value;
    float *grad_value = pr.grad_value ? (float *)pr.grad_value + g * V : nullptr;
    T *grad_value_t = (T *)pr.grad_value + g * V; /* NATIVE */
    const PointTensor<T> loc(pr.sampling_locations, pr), attn(pr.attention_weights, pr);
    const PointTensor<T> grad_loc(pr.grad_sampling_locations, pr);
    const PointTensor<T> grad_attn(pr.grad_attention_weights, pr);
    const bool point_grads = grad_loc || grad_attn;
    const int n_items = (int)(pr.B * pr.Q * pr.H), NP = (int)pr.NP, C = (int)pr.C;
    const int HC = (int)(pr.H * pr.C), S = (int)pr.S;
    load_levels(pr, s_lvl);
    __syncthreads();
    for (unsigned ub = blockIdx.x * IPB; ub < (unsigned)n_items; ub += gridDim.x * IPB) {
        const int mine = (int)ub + threadIdx.x / R;
        const bool live = mine < n_items; /* lanes past the last item shadow it, writing nothing */
        const int item = live ? mine : n_items - 1;
        const int row = item_row<0>(pr, s_lvl, item, false), head_off = item_head_off(pr, item);
        float go[V];
        load_vec(gout + (int64_t)row * C + g * V, go);
        /* the locations and weights of the lane's points (point s < SPLIT <= NP stands in past
         * the end), then their geometry: {A, fx, fy, 0} */
        float lx[K], ly[K], a[K];
#pragma unroll
        for (int k = 0; k < K; k++) {
            const int p = s + k * SPLIT < NP ? s + k * SPLIT : s;
            const int64_t i = (int64_t)row * NP + p;
            lx[k] = to_acc(loc[2 * i]), ly[k] = to_acc(loc[2 * i + 1]), a[k] = to_acc(attn[i]);
        }
        int4 o4[K];
        float4 geo[K];
#pragma unroll
        for (int k = 0; k < K; k++) {
            const int p = s + k * SPLIT;
            place_point<false>(0, s_lvl[level_of<false>(pr, p < NP ? p : s)], head_off, HC, S,
                               lx[k], ly[k], a[k], o4[k], geo[k]);
            if (!live || p >= NP) o4[k] = make_int4(-1, -1, -1, -1);
        }
        if (point_grads) {
            /* every corner gathered at once (branch-free: outside, value's first row, zeroed) */
            float v[K][4][V];
#pragma unroll
            for (int k = 0; k < K; k++) {
                const int o[4] = {o4[k].x, o4[k].y, o4[k].z, o4[k].w};
#pragma unroll
                for (int c = 0; c < 4; c++)
                    load_vec(value + (o[c] < 0 ? 0u : (unsigned)o[c]), v[k][c]);
#pragma unroll
                for (int c = 0; c < 4; c++)
#pragma unroll
                    for (int j = 0; j < V; j++) v[k][c][j] = o[c] < 0 ? 0.f : v[k][c][j];
            }
            /* every lane runs K rounds (the group sums shuffle across the whole warp) */
#pragma unroll
            for (int k = 0; k < K; k++) {
                const int p = s + k * SPLIT;
                const float fx = geo[k].y, fy = geo[k].z;
                const float w[4] = {(1.f - fx) * (1.f - fy), fx * (1.f - fy), (1.f - fx) * fy,
                                    fx * fy};
                const float3 sums = point_sums<G, V>(go, w, fx, fy, v[k]);
                if (live && p < NP && g == 0) {
                    const int64_t i = (int64_t)row * NP + p;
                    const bool hit = o4[k].x >= 0 || o4[k].y >= 0 || o4[k].z >= 0 || o4[k].w >= 0;
                    if (grad_attn) grad_attn.set(i, sums.x);
                    if (grad_loc) {
                        const int4 lvl = s_lvl[level_of<false>(pr, p)];
                        grad_loc.set(2 * i, hit ? geo[k].x * sums.y * (float)lvl.y : 0.f);
                        grad_loc.set(2 * i + 1, hit ? geo[k].x * sums.z * (float)lvl.x : 0.f);
                    }
                }
            }
        }
        if (grad_value) {
            grid_dep_wait();
#pragma unroll
            for (int k = 0; k < K; k++) {
                const int o[4] = {o4[k].x, o4[k].y, o4[k].z, o4[k].w};
                const float fx = geo[k].y, fy = geo[k].z;
                const float w[4] = {(1.f - fx) * (1.f - fy), fx * (1.f - fy), (1.f - fx) * fy,
                                    fx * fy};
#pragma unroll
                for (int c = 0; c < 4; c++)
                    if (o[c] >= 0)
                        scatter_corner<T, NATIVE, V>(grad_value, grad_value_t, (unsigned)o[c],
                                                     geo[k].x * w[c], go);
            }
        }
    }
}
