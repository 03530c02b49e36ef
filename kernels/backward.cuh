/* kernels/backward.cuh: the backward's launch, templated on the dtype (one instance file per
 * dtype in kernels/instances/, so `make -j` compiles them in parallel). c/routes.c chooses the
 * route once per call (msda_plan_backward); launch_backward switches on it: the modifiers first
 * (f32 workspace, deterministic), then the group size G, then the kernel. */
#pragma once

#include "backward_agg.cuh"
#include "backward_aux.cuh"
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
/* grad_value (`bytes` of it) = 0 before `kernel`, then `kernel`: with sm_90 code, 16-byte
 * multiples and alignment, by zero_kernel and a programmatic dependent launch of `kernel`
 * (which must call grid_dep_wait before its first scatter); otherwise by memset_grad_value
 * first. */
cudaError_t zero_then_launch(void (*kernel)(msda_problem), dim3 grid, int64_t bytes,
                             const msda_problem *pr, cudaStream_t stream);

/* One launcher per dtype, msda_backward_launch_<suffix> (kernels/instances/backward_*.cu). */
#define MSDA_BACKWARD_LAUNCHER(code, suffix, ...)                                                 \
    cudaError_t MSDA_CAT(msda_backward_launch, suffix)(const msda_problem *pr, cudaStream_t stream);
MSDA_DTYPES(MSDA_BACKWARD_LAUNCHER)
#undef MSDA_BACKWARD_LAUNCHER

/* Most blocks of the grid-stride kernels of kernels/backward_aux.cuh (256 threads a block). */
static constexpr int64_t kAuxMaxBlocks = 65536;

// ---------------------------------------------------------------------------------------------
// launch: the route's kernels, templated on the dtype

/* The aggregated kernel for points stored as P (kernels/common.cuh: PointTensor): with the
 * option code, with every gradient wanted, or plain. */
template <typename T, typename P, int G, bool DET>
static cudaError_t launch_aggregated(const msda_problem *pr, const msda_backward_plan &plan,
                                     dim3 grid, cudaStream_t stream, int64_t bytes) {
    if (plan.options)
        return zero_then_launch(msda_backward_agg<T, G, AggregatedWithOptions<DET, P>>, grid,
                                bytes, pr, stream);
    if constexpr (!DET) {
        if (pr->grad_value && pr->grad_sampling_locations && pr->grad_attention_weights)
            return zero_then_launch(msda_backward_agg<T, G, AggregatedAllGradients<P>>, grid,
                                    bytes, pr, stream);
    }
    return zero_then_launch(msda_backward_agg<T, G, Aggregated<DET, P>>, grid, bytes, pr,
                            stream);
}

/* The fast kernels of a plan (G = plan.group): one case per route. A route this instantiation
 * does not build (the plan and the if constexpr below disagree) is a library bug. */
template <typename T, int G, bool DET>
static cudaError_t launch_fast_backward(const msda_problem *pr, const msda_backward_plan &plan,
                               cudaStream_t stream, int64_t bytes) {
    const dim3 grid(plan.blocks, plan.slices);
    switch (plan.kernel) {
    case MSDA_ROUTE_AGGREGATED:
        if constexpr (G >= 4) {
            if constexpr (IsHalf<T>::value)
                if (pr->flags & MSDA_POINTS_F32)
                    return launch_aggregated<T, float, G, DET>(pr, plan, grid, stream, bytes);
            return launch_aggregated<T, T, G, DET>(pr, plan, grid, stream, bytes);
        }
        break;
    case MSDA_ROUTE_POINT_SLICED: /* loads overlap the zeroing */
        if constexpr (!DET)
            return zero_then_launch(msda_backward_fast<T, G, PerPointSliced>, grid, bytes, pr,
                                    stream);
        break;
    case MSDA_ROUTE_POINT_PIPELINED:
        if constexpr (!DET && std::is_same<T, float>::value && G <= 16) {
            /* f32: 2 channels a thread (G = 2 * C / 4 threads an item) */
            const cudaError_t e = memset_grad_value(pr, bytes, stream);
            if (e != cudaSuccess) return e;
            msda_backward_fast<T, 2 * G, PerPointPipelined<2>><<<grid, 256, 0, stream>>>(*pr);
            return cudaSuccess;
        } else if constexpr (!DET && std::is_same<T, __nv_bfloat16>::value) {
            const cudaError_t e = memset_grad_value(pr, bytes, stream);
            if (e != cudaSuccess) return e;
            msda_backward_fast<T, G, PerPointPipelined<4>><<<grid, 256, 0, stream>>>(*pr);
            return cudaSuccess;
        }
        break;
    case MSDA_ROUTE_POINT: {
        const cudaError_t e = memset_grad_value(pr, bytes, stream);
        if (e != cudaSuccess) return e;
        if (plan.options)
            msda_backward_fast<T, G, PerPointWithOptions<DET>><<<grid, 256, 0, stream>>>(*pr);
        else msda_backward_fast<T, G, PerPoint<DET>><<<grid, 256, 0, stream>>>(*pr);
        return cudaSuccess;
    }
    default: break;
    }
    return cudaErrorNotSupported;
}

template <typename T, bool DET>
static cudaError_t launch_kernels(const msda_problem *pr, const msda_backward_plan &plan,
                                  cudaStream_t stream, int64_t bytes) {
    if constexpr (HasFast<T>::value) {
        if (plan.group)
            return with_group(plan.group, [&](auto g) {
                return launch_fast_backward<T, decltype(g)::value, DET>(pr, plan, stream, bytes);
            });
    }
    if (plan.kernel != MSDA_ROUTE_GENERIC) return cudaErrorNotSupported;
    const cudaError_t e = memset_grad_value(pr, bytes, stream);
    if (e != cudaSuccess) return e;
    msda_backward_kernel<T, DET><<<plan.blocks, 256, 0, stream>>>(*pr);
    return cudaSuccess;
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
            const unsigned int blocks = msda_grid_blocks((n_value + 7) / 8, 256, kAuxMaxBlocks);
            half_convert_kernel<T><<<blocks, 256, 0, stream>>>(*pr);
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
    const unsigned int scan_blocks = msda_grid_blocks(n_grad_output, 256, kAuxMaxBlocks);
    det_scan_kernel<T><<<scan_blocks, 256, 0, stream>>>(*pr);
    e = launch_kernels<T, true>(pr, plan, stream, 0);
    if (e != cudaSuccess) return e;
    det_convert_kernel<T><<<msda_grid_blocks(n_value, 256, kAuxMaxBlocks), 256, 0, stream>>>(*pr);
    return cudaSuccess;
}
