/* kernels/backward_point.cuh: the fast per-point backward (MSDA_ROUTE_POINT, _POINT_SLICED,
 * _POINT_PIPELINED; gradients: c/msda.h). Decoders, and whatever the aggregated kernel does not
 * serve.
 * Thread map (kernels/staging.cuh): a group of G threads per item, 4 channels a thread (2 in the
 * pipelined f32 form, with twice the threads); per staged point the group gathers its 4 corners,
 * scatters A * w_k * g into grad_value (one vector atomic a corner), reduces its three point
 * sums over the G lanes and parks them in shared memory; the block then writes the location and
 * weight gradients coalesced, one thread a point. Sliced: each item's points split over
 * gridDim.y blocks (few items: ddetr_dec), loads first while zero_kernel zeroes grad_value,
 * scatter after grid_dep_wait. Pipelined: the next point's gathers issued before this point's
 * atomics and sums (plain f32 and bf16 decoders).
 * Numerics: f32 sums; grad_value's summation order, and its last bits, vary from run to run
 * unless MSDA_DETERMINISTIC (then a group's integer atomics cover consecutive words).
 * Bound by L2 traffic (atomics and gathers): kernels/TUNING.md, "Backward, per-point and
 * generic", lists what was measured against it (2 channels a thread in f32: v45; pipelining:
 * v51); today's times: BENCHMARKS.md. */
#pragma once

#include "backward_common.cuh"

/* Staged point k of item `local` (stage_chunk, backward form): its corners' offsets (-1:
 * outside), attention weight A, in-cell fraction and bilinear weights. */
struct StagedPoint {
    int o[4];
    float a, fx, fy, w[4];
};
template <typename St>
__device__ __forceinline__ StagedPoint staged_point(const int4 *s_offs, const float4 *s_geo,
                                                    int local, int k) {
    const int4 o4 = s_offs[local * St::STRIDE + k];
    const float4 geo = s_geo[local * St::STRIDE + k];
    const float fx = geo.y, fy = geo.z;
    return {{o4.x, o4.y, o4.z, o4.w},
            geo.x,
            fx,
            fy,
            {(1.f - fx) * (1.f - fy), fx * (1.f - fy), (1.f - fx) * fy, fx * fy}};
}

/* grad_value[corner] += coef * go over a thread's V channels: half-precision vector atomics
 * into grad_value itself (NATIVE) or 16-byte f32 ones. */
template <typename T, bool NATIVE, int V>
__device__ __forceinline__ void scatter_corner(float *grad_value, T *grad_value_t, unsigned off,
                                               float coef, const float (&go)[V]) {
    float contrib[V];
#pragma unroll
    for (int j = 0; j < V; j++) contrib[j] = coef * go[j];
    if constexpr (NATIVE) red_half<T, V>(grad_value_t + off, contrib);
    else atomic_add_vec<V>(grad_value + off, contrib);
}

/* The V channels of a point's 4 corners at offsets o4 (zeros for a corner outside, or all
 * zeros where !on). */
template <typename T, int V>
__device__ __forceinline__ void gather_point(const T *value, int4 o4, bool on, float (&v)[4][V]) {
    const int o[4] = {o4.x, o4.y, o4.z, o4.w};
#pragma unroll
    for (int c = 0; c < 4; c++) {
        if (on && o[c] >= 0) {
            load_vec(value + (unsigned)o[c], v[c]);
        } else {
#pragma unroll
            for (int j = 0; j < V; j++) v[c][j] = 0.f;
        }
    }
}

/* A point's sums over its group's channels (v: its corners): {dL/dA, then the x and y location
 * sums before their scaling by A and the level's size}. */
template <int G, int V>
__device__ __forceinline__ float3 point_sums(const float (&go)[V], const float (&w)[4], float fx,
                                             float fy, const float (&v)[4][V]) {
    float s_a = 0.f, s_x = 0.f, s_y = 0.f;
#pragma unroll
    for (int j = 0; j < V; j++) {
        s_a += go[j] * (w[0] * v[0][j] + w[1] * v[1][j] + w[2] * v[2][j] + w[3] * v[3][j]);
        s_x += go[j] * ((1.f - fy) * (v[1][j] - v[0][j]) + fy * (v[3][j] - v[2][j]));
        s_y += go[j] * ((1.f - fx) * (v[2][j] - v[0][j]) + fx * (v[3][j] - v[1][j]));
    }
    return make_float3(group_sum<G>(s_a), group_sum<G>(s_x), group_sum<G>(s_y));
}

/* A point's gathered corners as PIPE carries them to the next iteration: f32 as floats; bf16
 * as the raw 8-byte words, widened only when used (widening at the gather would wait for the
 * loads there, which is what the pipelining avoids; f16 is not pipelined). */
template <typename T, int V> struct Carried {
    float v[4][V];
    __device__ __forceinline__ void gather(const T *value, int4 o4, bool on) {
        gather_point<T, V>(value, o4, on, v);
    }
    __device__ __forceinline__ void widen(float (&out)[4][V]) const {
#pragma unroll
        for (int c = 0; c < 4; c++)
#pragma unroll
            for (int j = 0; j < V; j++) out[c][j] = v[c][j];
    }
};
template <> struct Carried<__nv_bfloat16, 4> {
    uint2 r[4];
    __device__ __forceinline__ void gather(const __nv_bfloat16 *value, int4 o4, bool on) {
        const int o[4] = {o4.x, o4.y, o4.z, o4.w};
#pragma unroll
        for (int c = 0; c < 4; c++)
            r[c] = on && o[c] >= 0 ? __ldg(reinterpret_cast<const uint2 *>(value + (unsigned)o[c]))
                                   : make_uint2(0u, 0u);
    }
    __device__ __forceinline__ void widen(float (&out)[4][4]) const {
#pragma unroll
        for (int c = 0; c < 4; c++) {
            bf16x2_to_float(r[c].x, out[c][0], out[c][1]);
            bf16x2_to_float(r[c].y, out[c][2], out[c][3]);
        }
    }
};

/* The location and weight gradients of the chunk's staged points [p0, p0 + kn) from their sums
 * (s_sums, the point loop's), one thread a point, coalesced. */
template <typename T, bool OPT, typename St>
__device__ __forceinline__ void write_point_gradients(const msda_problem &pr, const float4 *s_sums,
                                                      const float4 *s_geo, const int2 *s_item,
                                                      int base, int n_items, int LP, int p0,
                                                      int kn, const PointTensor<T> &grad_loc,
                                                      const PointTensor<T> &grad_attn,
                                                      bool nearest) {
    for (int j = threadIdx.x; j < St::IPB * St::K; j += St::NT) {
        const int il = j / St::K, k = j % St::K;
        if (base + il >= n_items || k >= kn) continue;
        const int pidx = p0 + k;
        const int64_t i = (int64_t)s_item[il].x * LP + pidx;
        const float4 sums = s_sums[il * St::STRIDE + k];
        const float a = s_geo[il * St::STRIDE + k].x;
        if (grad_attn) grad_attn.set(i, sums.x);
        if (grad_loc && (sums.w == 0.f || nearest)) { /* nearest: constant */
            grad_loc.set(2 * i, 0.f), grad_loc.set(2 * i + 1, 0.f);
        } else if (grad_loc) {
            const int l = level_of<OPT>(pr, pidx);
            const float W_l = (float)load_index(pr.spatial_shapes, pr.index_dtype, 2 * l + 1);
            const float H_l = (float)load_index(pr.spatial_shapes, pr.index_dtype, 2 * l);
            grad_loc.set(2 * i, a * sums.y * W_l);
            grad_loc.set(2 * i + 1, a * sums.z * H_l);
        }
    }
}

/* What an instance of msda_backward_fast is compiled for (its Form): DET, grad_value in fixed
 * point (MSDA_DETERMINISTIC); OPT, the option code (per-level points, nearest); SPLIT (plain
 * problems with the points sliced, gridDim.y > 1), a chunk's loads and point gradients first,
 * then its scatter after grid_dep_wait, so that the block's loads overlap the zeroing of
 * grad_value by zero_kernel, whose programmatic dependent this kernel is; V channels a thread;
 * PIPE, the next point's gathers issued ahead. A launch names one of the route's forms below. */
template <bool DET_, bool OPT_, bool SPLIT_, int V_, bool PIPE_> struct PointForm {
    static constexpr bool DET = DET_, OPT = OPT_, SPLIT = SPLIT_, PIPE = PIPE_;
    static constexpr int V = V_;
};
/* MSDA_ROUTE_POINT: each corner gathered, then scattered; plain or with the option code */
template <bool DET> using PerPoint = PointForm<DET, false, false, 4, false>;
template <bool DET> using PerPointWithOptions = PointForm<DET, true, false, 4, false>;
/* MSDA_ROUTE_POINT_SLICED: loads first, the scatter after the zeroing */
using PerPointSliced = PointForm<false, false, true, 4, false>;
/* MSDA_ROUTE_POINT_PIPELINED, CHANNELS a thread (f32 2, bf16 4) */
template <int CHANNELS> using PerPointPipelined = PointForm<false, false, false, CHANNELS, true>;

template <typename T, int G, typename Form>
__global__ void __launch_bounds__(MSDA_BLOCK_THREADS, MSDA_BWD_MIN_BLOCKS) msda_backward_fast(msda_problem pr) {
    constexpr bool DET = Form::DET, OPT = Form::OPT, SPLIT = Form::SPLIT, PIPE = Form::PIPE;
    constexpr int V = Form::V;
    static_assert(!(SPLIT && (DET || OPT)), "SPLIT is for plain problems");
    static_assert(!(PIPE && (DET || OPT || SPLIT)), "PIPE is for plain problems");
    typedef Stage<G> St;
    __shared__ int4 s_lvl[MSDA_FAST_MAX_LEVELS];
    __shared__ int4 s_offs[St::IPB * St::STRIDE];
    __shared__ float4 s_geo[St::IPB * St::STRIDE];  /* {A, fx, fy, 0} */
    __shared__ float4 s_sums[St::IPB * St::STRIDE]; /* {d/dA, d/dfx, d/dfy, 0} before scaling */
    __shared__ int2 s_item[St::IPB];                /* {row, head offset} per item */
    const int g = threadIdx.x % G, local = threadIdx.x / G;
    const T *value = (const T *)pr.value + g * V;
    const T *gout = (const T *)pr.grad_output;
    constexpr bool NATIVE = NativeHalf<T, DET>::value;
    float *grad_value = pr.grad_value ? (float *)pr.grad_value + g * V : nullptr;
    T *grad_value_t = (T *)pr.grad_value + g * V; /* NATIVE */
    long long *det_acc = nullptr;
    float scale = 0.f;
    if (DET && grad_value) {
        det_acc = (long long *)((char *)pr.workspace + MSDA_DET_HEADER_BYTES) + g;
        scale = (float)det_scale(pr, (const DetHeader *)pr.workspace);
    }
    const PointTensor<T> grad_loc(pr.grad_sampling_locations, pr);
    const PointTensor<T> grad_attn(pr.grad_attention_weights, pr);
    const bool point_grads = grad_loc || grad_attn;
    const int n_items = (int)(pr.B * pr.Q * pr.H), LP = (int)pr.NP, C = (int)pr.C;
    const bool nearest = OPT && (pr.flags & MSDA_NEAREST);
    load_levels(pr, s_lvl);
    __syncthreads();
    /* unsigned: with more than 2^30 items, base + gridDim.x * IPB passes 2^31 - 1 (int would
     * wrap negative and run again on items before the first), never 2^32 - 1 */
    for (unsigned ub = blockIdx.x * St::IPB; ub < (unsigned)n_items; ub += gridDim.x * St::IPB) {
        const int base = (int)ub;
        fill_items<T, false, St::IPB>(pr, s_lvl, base, n_items, St::IPB, s_item);
        __syncthreads();
        const int item = base + local, row = s_item[local].x;
        float go[V], go_det[V]; /* go_det: channels g, g + G, ... (DET's coalesced atomics) */
        if (item < n_items) {
            load_vec(gout + (int64_t)row * C + g * V, go);
        } else {
#pragma unroll
            for (int j = 0; j < V; j++) go[j] = 0.f;
        }
        if (DET) {
#pragma unroll
            for (int j = 0; j < V; j++)
                go_det[j] = item < n_items ? to_acc(gout[(int64_t)row * C + g + j * G]) : 0.f;
        }
        /* grad_value[off + channels] += coef * grad_output: DET's fixed point (lanes of a
         * group on consecutive 8-byte words), or the vector atomics of scatter_corner */
        auto scatter = [&](unsigned off, float coef) {
            if constexpr (DET) {
#pragma unroll
                for (int j = 0; j < V; j++) det_add(det_acc + off + j * G, coef * go_det[j], scale);
            } else {
                scatter_corner<T, NATIVE, V>(grad_value, grad_value_t, off, coef, go);
            }
        };
        /* blockIdx.y: which of gridDim.y slices of the points */
        const int p_end = (int)((int64_t)LP * (blockIdx.y + 1) / gridDim.y);
        for (int p0 = (int)((int64_t)LP * blockIdx.y / gridDim.y); p0 < p_end; p0 += St::K) {
            const int kn = p_end - p0 < St::K ? p_end - p0 : St::K;
            stage_chunk<T, false, OPT, St>(pr, s_lvl, s_item, base, n_items, p0, kn, s_offs,
                                           s_geo);
            __syncthreads();
            /* One point loop for every form. Plain: a corner's gather, then its scatter.
             * PIPE: point k + 1's gathers issued before point k's atomics and sums (one
             * dependent round trip a point otherwise); only the gathered corners are carried
             * over, the rest of point k is read again from shared memory. SPLIT: no scatter
             * here; it follows the chunk's loads below. Every lane runs the same trip count
             * (items past the end have no inside corners), so the group shuffles see all
             * their lanes. */
            Carried<T, V> cur;
            if constexpr (PIPE) cur.gather(value, s_offs[local * St::STRIDE], point_grads);
            for (int k = 0; k < kn; k++) {
                float v[4][V];
                Carried<T, V> nxt;
                if constexpr (PIPE) {
                    nxt.gather(value, s_offs[local * St::STRIDE + (k + 1 < kn ? k + 1 : k)],
                               point_grads && k + 1 < kn);
                    cur.widen(v);
                }
                const StagedPoint pt = staged_point<St>(s_offs, s_geo, local, k);
#pragma unroll
                for (int c = 0; c < 4; c++) {
                    if (pt.o[c] >= 0) {
                        if (!PIPE && point_grads) load_vec(value + (unsigned)pt.o[c], v[c]);
                        if (!SPLIT && grad_value) scatter((unsigned)pt.o[c], pt.a * pt.w[c]);
                    } else if (!PIPE) {
#pragma unroll
                        for (int j = 0; j < V; j++) v[c][j] = 0.f;
                    }
                }
                if (point_grads) {
                    const float3 sums = point_sums<G, V>(go, pt.w, pt.fx, pt.fy, v);
                    /* .w marks a point with a corner inside: only those scale by A (a
                     * non-finite A of a point outside must leave its zero gradients zero, as
                     * on the CPU). */
                    const bool hit = pt.o[0] >= 0 || pt.o[1] >= 0 || pt.o[2] >= 0 || pt.o[3] >= 0;
                    if (g == 0)
                        s_sums[local * St::STRIDE + k] =
                            make_float4(sums.x, sums.y, sums.z, hit ? 1.f : 0.f);
                }
                if constexpr (PIPE) cur = nxt;
            }
            if (SPLIT && grad_value) { /* the scatter, once grad_value is zero */
                grid_dep_wait();
                for (int k = 0; k < kn; k++) {
                    const StagedPoint pt = staged_point<St>(s_offs, s_geo, local, k);
#pragma unroll
                    for (int c = 0; c < 4; c++)
                        if (pt.o[c] >= 0) scatter((unsigned)pt.o[c], pt.a * pt.w[c]);
                }
            }
            if (point_grads) {
                __syncthreads();
                write_point_gradients<T, OPT, St>(pr, s_sums, s_geo, s_item, base, n_items, LP, p0,
                                                  kn, grad_loc, grad_attn, nearest);
            }
            __syncthreads();
        }
    }
}
