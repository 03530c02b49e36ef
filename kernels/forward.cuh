/* kernels/forward.cuh: MSDA forward on CUDA (math: c/msda.h), templated on the dtype (one
 * instance file per dtype in kernels/instances/, so `make -j` compiles them in parallel; the
 * entry point: kernels/forward.cu).
 * Fast kernel (f32/f16/bf16, C = 4 * 2^k up to 128, < 2^31 elements, aligned): the staging of
 * kernels/staging.cuh with the corner weights premultiplied by A; a group of G threads an item,
 * 4 channels a thread (16-byte f32 loads), or 8 in half types from 65536 items on (one 16-byte
 * load a corner, 128-thread blocks); the point loop unrolled 8 times; corner slots ordered by
 * pixel parity so neighbouring queries ask for shared pixels in the same load. Direct kernel
 * (plain problems of at most 4 points an item, or of few items): no staging, each lane places
 * its own points, an item's points split over up to 4 lane groups whose sums meet by shuffles.
 * Generic kernel (f64, other C, over 2^31 elements): one warp an item, 64-bit offsets.
 * c/routes.c chooses (msda_plan_forward); with_forward_kernel turns its plan into a kernel
 * instance.
 * Numerics: f32 accumulation (f64 for f64), one rounding to the output type.
 * Timings: BENCHMARKS.md; why these forms: kernels/TUNING.md (forward v21, d1). */
#pragma once

#include "staging.cuh"

// ---------------------------------------------------------------------------------------------
// kernel

template <typename T>
__global__ void __launch_bounds__(MSDA_BLOCK_THREADS) msda_forward_kernel(msda_problem pr) {
    typedef typename AccOf<T>::type Acc;
    const T *value = (const T *)pr.value;
    const PointTensor<T> loc(pr.sampling_locations, pr), attn(pr.attention_weights, pr);
    T *out = (T *)pr.output;
    const int64_t H = pr.H, C = pr.C, L = pr.L, Q = pr.Q, NP = pr.NP;
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
                const GenericLevel lv = generic_level(pr, l);
                const int64_t H_l = lv.H, W_l = lv.W, start = lv.start;
                for (int64_t p = lv.p_begin; p < lv.p_end; p++) {
                    const int64_t i = qh * NP + p;
                    Point<Acc> pt;
                    if (!generic_point<Acc>(pr, loc, i, H_l, W_l, start, b, h, pt)) continue;
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

/* Unrolling of the point loop: 8, faster than 4 (more gathers in flight, the same registers)
 * and than 16 (kernels/TUNING.md, forward v21). */
#ifndef MSDA_FWD_UNROLL
#define MSDA_FWD_UNROLL 8
#endif
static constexpr int kFwdUnroll = MSDA_FWD_UNROLL;
/* What an instance of msda_forward_fast is compiled for (its Form): OPT, the option code
 * (per-level points, nearest); V channels a thread; NT threads a block (MSDA_FWD_WIDE_THREADS
 * for 8 channels, c/msda_internal.h). A launch names one of the routes' forms below. */
template <bool OPT_, int V_> struct ForwardForm {
    static constexpr bool OPT = OPT_;
    static constexpr int V = V_, NT = V_ == 8 ? MSDA_FWD_WIDE_THREADS : MSDA_BLOCK_THREADS;
};
/* MSDA_FWD_ROUTE_FAST (4 channels a thread) and MSDA_FWD_ROUTE_WIDE (8), plain or with the
 * option code */
using Fast = ForwardForm<false, 4>;
using FastWithOptions = ForwardForm<true, 4>;
using Wide = ForwardForm<false, 8>;
using WideWithOptions = ForwardForm<true, 8>;

/* One point's four corners (value offsets o4, -1 for a corner outside its level; weights w4),
 * V channels each, added into acc: the gather both forward kernels share. */
template <typename T, int V>
__device__ __forceinline__ void add_corners(const T *value, const int4 o4, const float4 w4,
                                            float (&acc)[V]) {
    const int o[4] = {o4.x, o4.y, o4.z, o4.w};
    const float w[4] = {w4.x, w4.y, w4.z, w4.w};
#pragma unroll
    for (int c = 0; c < 4; c++) {
        if (o[c] < 0) continue;
        float v[V];
        if constexpr (V == 8) load_vec8(value + (unsigned)o[c], v);
        else load_vec(value + (unsigned)o[c], v); /* o >= 0: one IMAD.WIDE.U32 */
#pragma unroll
        for (int j = 0; j < V; j++) acc[j] += w[c] * v[j];
    }
}

template <typename T, int G, typename Form>
__global__ void __launch_bounds__(Form::NT) msda_forward_fast(msda_problem pr) {
    constexpr bool OPT = Form::OPT;
    constexpr int V = Form::V;
    static_assert(V == 4 || V == 8, "4 or 8 channels a thread");
    typedef Stage<G, Form::NT> St;
    __shared__ int4 s_lvl[MSDA_FAST_MAX_LEVELS];
    __shared__ int4 s_offs[St::IPB * St::STRIDE];
    __shared__ float4 s_w[St::IPB * St::STRIDE];
    __shared__ int2 s_item[St::IPB]; /* {row, head offset} per item */
    const T *value = (const T *)pr.value + threadIdx.x % G * V;
    /* value held in a register pair, opaque to the compiler: a corner's address is then one
     * IMAD.WIDE.U32 (value + o) instead of the lane offset folded into the index, a 64-bit
     * add, a shift and the base reloaded from the constant bank (5-6 instructions a corner) */
    asm("" : "+l"(value));
    T *out = (T *)pr.output;
    const int n_items = (int)(pr.B * pr.Q * pr.H), LP = (int)pr.NP, C = (int)pr.C;
    const int local = threadIdx.x / G, g = threadIdx.x % G;
    load_levels(pr, s_lvl);
    __syncthreads();
    /* unsigned: with more than 2^30 items, base + gridDim.x * IPB passes 2^31 - 1 (int would
     * wrap negative and run again on items before the first), never 2^32 - 1 */
    for (unsigned ub = blockIdx.x * St::IPB; ub < (unsigned)n_items; ub += gridDim.x * St::IPB) {
        const int base = (int)ub;
        const int item = base + local;
        float acc[V];
#pragma unroll
        for (int j = 0; j < V; j++) acc[j] = 0.f;
        fill_items<T, true, 0>(pr, s_lvl, base, n_items, St::IPB, s_item);
        __syncthreads();
        const int row = s_item[local].x;
        for (int p0 = 0; p0 < LP; p0 += St::K) {
            const int kn = LP - p0 < St::K ? LP - p0 : St::K;
            stage_chunk<T, true, OPT, St>(pr, s_lvl, s_item, base, n_items, p0, kn, s_offs, s_w);
            __syncthreads();
#pragma unroll kFwdUnroll
            for (int k = 0; k < kn; k++) {
                add_corners(value, s_offs[local * St::STRIDE + k], s_w[local * St::STRIDE + k],
                            acc);
            }
            __syncthreads();
        }
        if (item < n_items) {
            if constexpr (V == 8) store_vec8(out + (int64_t)row * C + g * V, acc);
            else store_vec(out + (int64_t)row * C + g * V, acc);
        }
    }
}

/* The direct form (MSDA_FWD_ROUTE_DIRECT): R = G * SPLIT lanes an item, G = C / V lanes of V
 * channels for each of SPLIT subsets of its points (lane s takes points s, s + SPLIT, ...).
 * Every lane places its own points (stage_point, the staged kernels' geometry) and gathers
 * their corners: no shared staging and no barrier but the level table's; the SPLIT partial
 * sums of an item meet by shuffles. For few points an item (a chunk of the staged kernel would
 * be mostly empty) and few items (more lanes an item fill the GPU). */
template <int V_, int SPLIT_> struct DirectForm {
    static constexpr int V = V_, SPLIT = SPLIT_, NT = MSDA_BLOCK_THREADS;
};

template <typename T, int G, typename Form>
__global__ void __launch_bounds__(Form::NT) msda_forward_direct(msda_problem pr) {
    constexpr int V = Form::V, SPLIT = Form::SPLIT, R = G * SPLIT;
    constexpr int IPB = MSDA_DIRECT_BLOCK_ITEMS(R);
    static_assert(Form::NT == MSDA_BLOCK_THREADS, "c/routes.c sizes the grid for this block");
    static_assert(V == 4 || V == 8, "4 or 8 channels a lane");
    static_assert(R <= 32 && (R & (R - 1)) == 0, "an item's lanes: a power of two in one warp");
    __shared__ int4 s_lvl[MSDA_FAST_MAX_LEVELS];
    const int lane = threadIdx.x % R, g = lane % G, s = lane / G;
    const T *value = (const T *)pr.value + g * V;
    asm("" : "+l"(value)); /* one IMAD.WIDE.U32 a corner address, as in msda_forward_fast */
    T *out = (T *)pr.output;
    const int n_items = (int)(pr.B * pr.Q * pr.H), NP = (int)pr.NP, C = (int)pr.C;
    load_levels(pr, s_lvl);
    __syncthreads();
    for (unsigned ub = blockIdx.x * IPB; ub < (unsigned)n_items; ub += gridDim.x * IPB) {
        const int mine = (int)ub + threadIdx.x / R;
        /* lanes past the last item shadow it (their shuffles must run), and store nothing */
        const int item = mine < n_items ? mine : n_items - 1;
        const int2 it = make_int2(item_row<0>(pr, s_lvl, item, false), item_head_off(pr, item));
        float acc[V];
#pragma unroll
        for (int j = 0; j < V; j++) acc[j] = 0.f;
#pragma unroll 4
        for (int p = s; p < NP; p += SPLIT) {
            int4 o4;
            float4 w4;
            stage_point<T, true, false>(pr, s_lvl, it, p, o4, w4);
            add_corners(value, o4, w4, acc);
        }
#pragma unroll
        for (int d = G; d < R; d <<= 1)
#pragma unroll
            for (int j = 0; j < V; j++) acc[j] += __shfl_xor_sync(0xffffffffu, acc[j], d);
        if (mine < n_items && s == 0) {
            if constexpr (V == 8) store_vec8(out + (int64_t)it.x * C + g * V, acc);
            else store_vec(out + (int64_t)it.x * C + g * V, acc);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// launcher

/* The route of this call (c/routes.c chooses; msda_forward_route reports the same plan). */
static msda_forward_plan forward_plan_of(const msda_problem *pr) {
    msda_forward_plan plan;
    msda_plan_forward(pr, aligned16(pr->value) && aligned16(pr->output), &plan);
    return plan;
}

/* The kernels a forward route names, as types: `threads` a block, `block_items` items a block
 * (c/routes.c sizes the grid, plan.blocks, for them: c/launch.h), and their launch. */
template <typename T> struct GenericForward {
    static constexpr int threads = MSDA_BLOCK_THREADS, block_items = MSDA_GENERIC_BLOCK_ITEMS;
    static cudaError_t launch(const msda_problem *pr, const msda_forward_plan &plan,
                              cudaStream_t stream) {
        msda_forward_kernel<T><<<plan.blocks, threads, 0, stream>>>(*pr);
        return cudaSuccess;
    }
};
template <typename T, int G, typename Form> struct FastForward {
    static constexpr int threads = Form::NT, block_items = Stage<G, Form::NT>::IPB;
    static cudaError_t launch(const msda_problem *pr, const msda_forward_plan &plan,
                              cudaStream_t stream) {
        msda_forward_fast<T, G, Form><<<plan.blocks, threads, 0, stream>>>(*pr);
        return cudaSuccess;
    }
};

template <typename T, int G, typename Form> struct DirectForward {
    static constexpr int threads = Form::NT, block_items = MSDA_DIRECT_BLOCK_ITEMS(G * Form::SPLIT);
    static cudaError_t launch(const msda_problem *pr, const msda_forward_plan &plan,
                              cudaStream_t stream) {
        msda_forward_direct<T, G, Form><<<plan.blocks, threads, 0, stream>>>(*pr);
        return cudaSuccess;
    }
};

/* f(K()) for the direct kernel of G lanes an item's channels take, V channels a lane, split
 * over plan.split lane groups (at most 32 lanes an item). */
template <typename T, int G, int V, typename F>
static cudaError_t with_direct_forward(const msda_forward_plan &plan, F &&f) {
    switch (plan.split) {
    case 1: return f(DirectForward<T, G, DirectForm<V, 1>>());
    case 2:
        if constexpr (G <= 16) return f(DirectForward<T, G, DirectForm<V, 2>>());
        break;
    case 4:
        if constexpr (G <= 8) return f(DirectForward<T, G, DirectForm<V, 4>>());
        break;
    default: break;
    }
    return cudaErrorNotSupported;
}

/* f(K()) for the kernel type K of a plan (not MSDA_FWD_ROUTE_NONE): the one place where a
 * route becomes a template instance, so the choice and the instances it needs stay together
 * (flash-attention's static switch). A plan no instance serves is cudaErrorNotSupported, a
 * library bug: tests/c/test_launch_shapes.cu asks this function about every route. */
template <typename T, typename F>
static cudaError_t with_forward_kernel(const msda_forward_plan &plan, F &&f) {
    if (plan.kernel == MSDA_FWD_ROUTE_GENERIC) return f(GenericForward<T>());
    if constexpr (HasFast<T>::value)
        return with_group(plan.group, [&](auto g) -> cudaError_t {
            constexpr int G = decltype(g)::value;
            switch (plan.kernel) {
            case MSDA_FWD_ROUTE_FAST:
                return plan.options ? f(FastForward<T, G, FastWithOptions>())
                                    : f(FastForward<T, G, Fast>());
            case MSDA_FWD_ROUTE_WIDE: /* half types, 2 <= C / 4 <= 32: G = C / 8 */
                if constexpr (IsHalf<T>::value && G <= 16)
                    return plan.options ? f(FastForward<T, G, WideWithOptions>())
                                        : f(FastForward<T, G, Wide>());
                break;
            case MSDA_FWD_ROUTE_DIRECT: /* plain problems; G = C / plan.vec lanes, times split */
                if (plan.vec == 8) {
                    if constexpr (IsHalf<T>::value) return with_direct_forward<T, G, 8>(plan, f);
                } else {
                    return with_direct_forward<T, G, 4>(plan, f);
                }
                break;
            default: break;
            }
            return cudaErrorNotSupported;
        });
    return cudaErrorNotSupported;
}

template <typename T>
static cudaError_t launch_forward(const msda_problem *pr, cudaStream_t stream) {
    const msda_forward_plan plan = forward_plan_of(pr);
    if (plan.kernel == MSDA_FWD_ROUTE_NONE) return cudaSuccess;
    return with_forward_kernel<T>(plan, [&](auto kernel) {
        return decltype(kernel)::launch(pr, plan, stream);
    });
}

/* One launcher per dtype, msda_forward_launch_<suffix> (kernels/instances/forward.cu, once per row of c/dtypes.h). */
#define MSDA_FORWARD_LAUNCHER(code, suffix, ...)                                                  \
    cudaError_t MSDA_CAT(msda_forward_launch, suffix)(const msda_problem *pr, cudaStream_t stream);
MSDA_DTYPES(MSDA_FORWARD_LAUNCHER)
#undef MSDA_FORWARD_LAUNCHER
