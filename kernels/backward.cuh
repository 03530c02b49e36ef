/* kernels/backward.cuh: the backward's launch, templated on the dtype (one instance file per
 * dtype in kernels/instances/, so `make -j` compiles them in parallel). c/routes.c chooses the
 * route once per call (msda_plan_backward); launch_backward handles its modifiers (f32
 * workspace, deterministic), then with_backward_kernel turns it into a kernel instance. */
#pragma once

#include "backward_agg.cuh"
#include "backward_aux.cuh"
#include "backward_direct.cuh"
#include "backward_generic.cuh"
#include "backward_point.cuh"

// ---------------------------------------------------------------------------------------------
// host helpers (kernels/backward.cu)

/* Multiprocessors of a device, asked once; 0 where the question fails. */
int sm_count(int device);
/* Whether the kernels that run on `device` are code for sm_90 or newer (half-precision vector
 * reductions, programmatic dependent launch). The code a device runs is the build's machine
 * code for its architecture or, failing that, PTX of an older one compiled for it: the kernels'
 * PTX version says which, so a build without sm_90 code run on an H100 takes the older paths.
 * Asked once per device; false where the question fails. */
bool sm90_code(int device);
/* The route of this call (c/routes.c chooses; msda_backward_route reports the same plan). */
msda_backward_plan backward_plan_of(const msda_problem *pr);
/* The first `bytes` of grad_value = 0 on the stream (nothing to do for 0 bytes or without
 * grad_value). In the launchers below `bytes` is what is still to be zeroed: 0 when the caller
 * zeroed it already or needs no zeroing. */
cudaError_t memset_grad_value(const msda_problem *pr, int64_t bytes, cudaStream_t stream);
/* grad_value (`bytes` of it) = 0 before `kernel`, then `kernel` (grid x threads): with sm_90
 * code, 16-byte multiples and alignment, by zero_kernel and a programmatic dependent launch of
 * `kernel` (which must call grid_dep_wait before its first scatter); otherwise by
 * memset_grad_value first. */
cudaError_t zero_then_launch(void (*kernel)(msda_problem), dim3 grid, int threads, int64_t bytes,
                             const msda_problem *pr, cudaStream_t stream);

/* One launcher per dtype, msda_backward_launch_<suffix> (kernels/instances/backward.cu, once per row of c/dtypes.h). */
#define MSDA_BACKWARD_LAUNCHER(code, suffix, ...)                                                 \
    cudaError_t MSDA_CAT(msda_backward_launch, suffix)(const msda_problem *pr, cudaStream_t stream);
MSDA_DTYPES(MSDA_BACKWARD_LAUNCHER)
#undef MSDA_BACKWARD_LAUNCHER

/* Most blocks of the grid-stride kernels of kernels/backward_aux.cuh (MSDA_BLOCK_THREADS
 * threads a block, an element a thread). */
static constexpr int64_t kAuxMaxBlocks = 65536;

// ---------------------------------------------------------------------------------------------
// launch: the route's kernels, templated on the dtype

/* The kernels a backward route names, as types: `threads` a block, `block_items` items a block
 * (c/routes.c sizes the grid, plan.blocks x plan.slices, for them: c/launch.h), whether they
 * zero grad_value themselves, overlapping their loads (zero_then_launch), and the kernel. */
template <typename T, bool DET> struct GenericBackward {
    static constexpr int threads = MSDA_BLOCK_THREADS, block_items = MSDA_GENERIC_BLOCK_ITEMS;
    static constexpr bool overlaps_zeroing = false;
    static void (*kernel())(msda_problem) { return msda_backward_kernel<T, DET>; }
};
template <typename T, int G, typename Form> struct PointBackward {
    static constexpr int threads = Stage<G>::NT, block_items = Stage<G>::IPB;
    static constexpr bool overlaps_zeroing = Form::SPLIT; /* loads overlap the zeroing */
    static void (*kernel())(msda_problem) { return msda_backward_fast<T, G, Form>; }
};
template <typename T, int G, typename Form> struct AggregatedBackward {
    static constexpr int threads = StageAgg<G>::NT, block_items = StageAgg<G>::IPB;
    static constexpr bool overlaps_zeroing = true;
    static void (*kernel())(msda_problem) { return msda_backward_agg<T, G, Form>; }
};

template <typename T, int G, typename Form> struct DirectBackward {
    static constexpr int threads = MSDA_BLOCK_THREADS;
    static constexpr int block_items = MSDA_DIRECT_BLOCK_ITEMS(G * Form::SPLIT);
    static constexpr bool overlaps_zeroing = true; /* loads first, the scatter after */
    static void (*kernel())(msda_problem) { return msda_backward_direct<T, G, Form>; }
};

/* f(K()) for the direct kernel of plan.split lane groups an item (G * split <= 32 lanes) with
 * room for the points a lane takes (1, 2 or 4). */
template <typename T, int G, typename F>
static cudaError_t with_direct_backward(const msda_problem *pr, const msda_backward_plan &plan,
                                        F &&f) {
    const int maxp = (int)((pr->NP + plan.split - 1) / plan.split);
    auto points = [&](auto split) -> cudaError_t {
        constexpr int SPLIT = decltype(split)::value;
        if constexpr (G * SPLIT <= 32) {
            if (maxp <= 1) return f(DirectBackward<T, G, DirectBackwardForm<SPLIT, 1>>());
            if (maxp <= 2) return f(DirectBackward<T, G, DirectBackwardForm<SPLIT, 2>>());
            if (maxp <= 4) return f(DirectBackward<T, G, DirectBackwardForm<SPLIT, 4>>());
        }
        return cudaErrorNotSupported;
    };
    switch (plan.split) {
    case 1: return points(std::integral_constant<int, 1>());
    case 2: return points(std::integral_constant<int, 2>());
    case 4: return points(std::integral_constant<int, 4>());
    default: return cudaErrorNotSupported;
    }
}

/* f(K()) for the aggregated kernel of points stored as P (kernels/common.cuh: PointTensor): with
 * the option code, with every gradient wanted, or plain. */
template <typename T, typename P, int G, bool DET, typename F>
static cudaError_t with_aggregated_kernel(const msda_problem *pr, const msda_backward_plan &plan,
                                          F &&f) {
    if (plan.options) return f(AggregatedBackward<T, G, AggregatedWithOptions<DET, P>>());
    if constexpr (!DET) {
        if (pr->grad_value && pr->grad_sampling_locations && pr->grad_attention_weights)
            return f(AggregatedBackward<T, G, AggregatedAllGradients<P>>());
    }
    return f(AggregatedBackward<T, G, Aggregated<DET, P>>());
}

/* f(K()) for the kernel type K of a plan (not MSDA_ROUTE_NONE; DET: its
 * MSDA_ROUTE_DETERMINISTIC): the one place where a route becomes a template instance, so the
 * choice and the instances it needs stay together (flash-attention's static switch). A plan no
 * instance serves is cudaErrorNotSupported, a library bug: tests/c/test_launch_shapes.cu asks
 * this function about every route. */
template <typename T, bool DET, typename F>
static cudaError_t with_backward_kernel(const msda_problem *pr, const msda_backward_plan &plan,
                                        F &&f) {
    if (plan.kernel == MSDA_ROUTE_GENERIC) return f(GenericBackward<T, DET>());
    if constexpr (HasFast<T>::value)
        return with_group(plan.group, [&](auto g) -> cudaError_t {
            constexpr int G = decltype(g)::value;
            switch (plan.kernel) {
            case MSDA_ROUTE_AGGREGATED:
                if constexpr (G >= 4) {
                    if constexpr (IsHalf<T>::value)
                        if (pr->flags & MSDA_POINTS_F32)
                            return with_aggregated_kernel<T, float, G, DET>(pr, plan, f);
                    return with_aggregated_kernel<T, T, G, DET>(pr, plan, f);
                }
                break;
            case MSDA_ROUTE_POINT_SLICED:
                if constexpr (!DET) return f(PointBackward<T, G, PerPointSliced>());
                break;
            case MSDA_ROUTE_POINT_PIPELINED:
                /* f32: 2 channels a thread (groups of 2 * G = 2 * C / 4 threads an item) */
                if constexpr (!DET && std::is_same<T, float>::value && G <= 16)
                    return f(PointBackward<T, 2 * G, PerPointPipelined<2>>());
                else if constexpr (!DET && std::is_same<T, __nv_bfloat16>::value)
                    return f(PointBackward<T, G, PerPointPipelined<4>>());
                break;
            case MSDA_ROUTE_DIRECT: /* plain problems; plan.split lane groups an item */
                if constexpr (!DET) return with_direct_backward<T, G>(pr, plan, f);
                break;
            case MSDA_ROUTE_POINT:
                return plan.options ? f(PointBackward<T, G, PerPointWithOptions<DET>>())
                                    : f(PointBackward<T, G, PerPoint<DET>>());
            default: break;
            }
            return cudaErrorNotSupported;
        });
    return cudaErrorNotSupported;
}

/* The route's kernel, after (or, where it overlaps the zeroing, with) the zeroing of the first
 * `bytes` of grad_value. */
template <typename T, bool DET>
static cudaError_t launch_kernels(const msda_problem *pr, const msda_backward_plan &plan,
                                  cudaStream_t stream, int64_t bytes) {
    return with_backward_kernel<T, DET>(pr, plan, [&](auto kernel) {
        typedef decltype(kernel) K;
        const dim3 grid(plan.blocks, plan.slices);
        if (K::overlaps_zeroing)
            return zero_then_launch(K::kernel(), grid, K::threads, bytes, pr, stream);
        const cudaError_t e = memset_grad_value(pr, bytes, stream);
        if (e != cudaSuccess) return e;
        K::kernel()<<<grid, K::threads, 0, stream>>>(*pr);
        return cudaSuccess;
    });
}

template <typename T>
static cudaError_t launch_backward(const msda_problem *pr, cudaStream_t stream) {
    const int64_t n_value = pr->B * pr->S * pr->H * pr->C;
    const msda_backward_plan plan = backward_plan_of(pr);
    if (plan.modifiers & MSDA_ROUTE_F32_WORKSPACE) {
        if constexpr (IsHalf<T>::value) {
            /* the kernels zero the f32 buffer (as they would grad_value) and scatter into it,
             * then it is converted */
            msda_problem buffered = *pr;
            buffered.grad_value = pr->workspace;
            cudaError_t e = plan.kernel == MSDA_ROUTE_NONE
                                ? memset_grad_value(&buffered, n_value * 4, stream)
                                : launch_kernels<T, false>(&buffered, plan, stream, n_value * 4);
            if (e != cudaSuccess) return e;
            const unsigned int blocks = msda_grid_blocks((n_value + 7) / 8, MSDA_BLOCK_THREADS,
                                                         kAuxMaxBlocks);
            half_convert_kernel<T><<<blocks, MSDA_BLOCK_THREADS, 0, stream>>>(*pr);
            return cudaSuccess;
        }
        return cudaErrorNotSupported;
    }
    if (plan.kernel == MSDA_ROUTE_NONE)
        return memset_grad_value(pr, n_value * (int64_t)sizeof(T), stream);
    if (!(plan.modifiers & MSDA_ROUTE_DETERMINISTIC))
        return launch_kernels<T, false>(pr, plan, stream, n_value * (int64_t)sizeof(T));
    cudaError_t e = cudaMemsetAsync(pr->workspace, 0, MSDA_DET_HEADER_BYTES + (size_t)n_value * 8, stream);
    if (e != cudaSuccess) return e;
    const int64_t n_grad_output = pr->B * pr->Q * pr->H * pr->C;
    const unsigned int scan_blocks = msda_grid_blocks(n_grad_output, MSDA_BLOCK_THREADS, kAuxMaxBlocks);
    det_scan_kernel<T><<<scan_blocks, MSDA_BLOCK_THREADS, 0, stream>>>(*pr);
    e = launch_kernels<T, true>(pr, plan, stream, 0);
    if (e != cudaSuccess) return e;
    const unsigned int convert_blocks = msda_grid_blocks(n_value, MSDA_BLOCK_THREADS, kAuxMaxBlocks);
    det_convert_kernel<T><<<convert_blocks, MSDA_BLOCK_THREADS, 0, stream>>>(*pr);
    return cudaSuccess;
}
