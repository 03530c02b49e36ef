/* c/msda_internal.h: what the C entry points, the CPU kernels and the CUDA launchers share.
 * Not part of the public contract (c/msda.h is). Plain C, includable from CUDA C++. */
#ifndef MSDA_INTERNAL_H
#define MSDA_INTERNAL_H

#include <stddef.h>
#include <stdint.h>

#include "dtypes.h"
#include "launch.h"
#include "msda.h"

#ifdef __cplusplus
extern "C" {
#endif

/* A thread pool other than OpenMP's that runs a CPU forward's workers (ONNX Runtime's intra-op
 * pool, c/ort_op.c): run(pool, fn, arg, n) calls fn(arg, i) once for each i < n, as many at a
 * time as the pool has threads, and returns when all are done: MSDA_OK, or a status with the
 * error text set. */
typedef struct {
    int (*run)(void *pool, void (*fn)(void *arg, size_t i), void *arg, size_t n);
    void *pool;
    int threads; /* the workers a call is split into */
} msda_thread_pool;

/* One call's arguments after the entry point has checked them. Sizes are >= 1 except B and Q,
 * which are >= 1 too by the time a kernel sees them (empty problems return early).
 *
 * Points: with uniform_points = 1 every level has P points and NP = L * P (the layouts of
 * c/msda.h without level_points; a level_points table whose counts are all equal is turned into
 * this form by the entry point). With uniform_points = 0 level l owns the points
 * [point_start[l], point_start[l+1]) of NP = P = point_start[L] in all (L <= MSDA_MAX_POINT_LEVELS,
 * NP < 2^31); only the kernels with the option code (msda_cpu_options_*, the generic CUDA
 * kernels, the fast ones compiled with it) see it. */
typedef struct {
    int64_t B, S, H, C, L, Q, P;
    int64_t NP;               /* points per (b, q, h) over all levels */
    int uniform_points;       /* 1: P points in every level; 0: see point_start */
    int flags;                /* msda_flags */
    int32_t point_start[MSDA_MAX_POINT_LEVELS + 1];
    int dtype;       /* msda_dtype */
    int index_dtype; /* msda_index_dtype */
    int device;      /* -1 CPU, else CUDA ordinal */
    int num_threads; /* CPU only; <= 0: OpenMP default */
    const msda_thread_pool *pool; /* CPU forward only: run on this pool instead of OpenMP */
    const void *value;
    const void *spatial_shapes;
    const void *level_start_index;
    const void *sampling_locations;
    const void *attention_weights;
    const void *grad_output;       /* backward only */
    void *output;                  /* forward only */
    void *grad_value;              /* backward; may be NULL; f32 for half dtypes */
    void *grad_sampling_locations; /* backward; may be NULL */
    void *grad_attention_weights;  /* backward; may be NULL */
    void *workspace;               /* backward, MSDA_DETERMINISTIC on CUDA */
    int64_t workspace_bytes;
    void *stream;
} msda_problem;

/* Formats this thread's error text (printf-style) and returns `status`. */
int msda_set_error(int status, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 2, 3)))
#endif
    ;

/* msda_forward on the CPU with its workers on `pool` (NULL: OpenMP's threads), for callers
 * inside the library that bring their own pool (c/ort_op.c). */
int msda_forward_pooled(const msda_args *args, const msda_thread_pool *pool);

/* 1 when the CPU kernels have an OpenMP runtime to run threads on (c/omp_runtime.c; asked at
 * the first parallel call), 0 when they run on the calling thread only. */
int msda_openmp_available(void);

/* Bytes of one element of sampling_locations, attention_weights and their gradients. */
static inline int64_t msda_point_size(const msda_problem *pr) {
    return (pr->flags & MSDA_POINTS_F32) ? 4 : msda_dtype_size(pr->dtype);
}

/* CPU kernels of the tuned plain op (c/cpu_plain.c): uniform points, no MSDA_NEAREST
 * (MSDA_DETERMINISTIC needs nothing on the CPU). */
int msda_cpu_plain_forward(const msda_problem *pr);
int msda_cpu_plain_backward(const msda_problem *pr);
/* CPU kernels of the options, for every other problem (c/cpu_options.c): per-level point
 * counts, nearest sampling. */
int msda_cpu_options_forward(const msda_problem *pr);
int msda_cpu_options_backward(const msda_problem *pr);
/* 1 when the problem uses an option (per-level point counts, nearest sampling): the
 * options' CPU kernels serve it, and the CUDA fast kernels compiled with their option code. */
static inline int msda_uses_options(const msda_problem *pr) {
    return !pr->uniform_points || (pr->flags & MSDA_NEAREST);
}

/* msda_level_starts' rule, for host code and kernels alike: the start of level l, the sum of
 * H_j * W_j over the levels before it, or S from the first level whose size is < 1 or overruns
 * S on. Never overflows. */
#if defined(__CUDACC__)
#define MSDA_HOST_DEVICE static __host__ __device__ __forceinline__
#else
#define MSDA_HOST_DEVICE static inline
#endif
MSDA_HOST_DEVICE int64_t msda_index_at(const void *p, int index_dtype, int64_t i) {
    return index_dtype == MSDA_I64 ? ((const int64_t *)p)[i] : (int64_t)((const int32_t *)p)[i];
}
MSDA_HOST_DEVICE void msda_derive_level_starts(int64_t L, int64_t S, int index_dtype,
                                               const void *spatial_shapes,
                                               void *level_start_index) {
    int64_t start = 0;
    for (int64_t l = 0; l < L; l++) {
        if (index_dtype == MSDA_I64)
            ((int64_t *)level_start_index)[l] = start;
        else /* int32 tables with S >= 2^31 cannot be honest */
            ((int32_t *)level_start_index)[l] = (int32_t)(start < INT32_MAX ? start : INT32_MAX);
        const int64_t h = msda_index_at(spatial_shapes, index_dtype, 2 * l);
        const int64_t w = msda_index_at(spatial_shapes, index_dtype, 2 * l + 1);
        start = h < 1 || w < 1 || start == S || h > (S - start) / w ? S : start + h * w;
    }
}
#undef MSDA_HOST_DEVICE

/* Blocks of a grid whose blocks take `per_block` consecutive items each: at least 1, at most
 * `max_blocks` (a grid-stride loop takes the rest). The one block count of every launch. The
 * fast kernels' blocks each take a run of consecutive items, so the blocks resident at any
 * moment cover a compact window of neighbouring queries (L2 reuse; a persistent grid whose
 * blocks each walk a long run lost: kernels/TUNING.md, forward v3). */
static inline unsigned int msda_grid_blocks(int64_t items, int64_t per_block,
                                            int64_t max_blocks) {
    int64_t blocks = (items + per_block - 1) / per_block;
    if (blocks > max_blocks) blocks = max_blocks;
    return (unsigned int)(blocks < 1 ? 1 : blocks);
}
/* The most blocks a grid's x dimension takes. */
#define MSDA_MAX_GRID_BLOCKS 0x7fffffff

/* ---- the CUDA routes (c/routes.c; the launchers in kernels/ switch on them) ----------------
 * Constants the host plans with and the kernels are built with (the block sizes: c/launch.h). */
/* the fast kernels' level table (in shared memory) */
#define MSDA_FAST_MAX_LEVELS 16
/* Forward: the items from which half types take the wide kernels (8 channels a thread, their
 * block: c/launch.h): encoders gain, a decoder's few thousand items would fill too few threads
 * (kernels/TUNING.md, forward v8, v10). */
#define MSDA_FWD_WIDE_MIN_ITEMS 65536
/* Forward, direct kernel: items of at most MSDA_FWD_DIRECT_MAX_POINTS points take it whatever
 * their count, and any plain problem whose items times C / 4 fall short of
 * MSDA_FWD_DIRECT_LANES; an item's points are split over lane groups (c/routes.c,
 * direct_split). The direct backward takes the same thresholds. */
#define MSDA_FWD_DIRECT_MAX_POINTS 4
#define MSDA_FWD_DIRECT_LANES (1 << 16)
#define MSDA_FWD_DIRECT_LANE_POINTS 4
#define MSDA_FWD_DIRECT_MIN_LANES (1 << 15)
/* Backward: the per-point kernel's blocks a multiprocessor holds (its launch bound), the most
 * slices an item's points are split into. */
#define MSDA_BWD_RESIDENT_BLOCKS 5
/* Backward, direct kernel: most points a lane holds between its loads and its scatter; items
 * of at most MSDA_BWD_DIRECT_FEW_POINTS points take it whatever their count (c/routes.c). */
#define MSDA_BWD_DIRECT_MAX_POINTS 4
#define MSDA_BWD_DIRECT_FEW_POINTS 4
#define MSDA_BWD_DIRECT_LANES (1 << 17)
#define MSDA_BWD_MAX_SLICES 8

typedef struct {
    int kernel;  /* MSDA_FWD_ROUTE_NONE .. MSDA_FWD_ROUTE_DIRECT (c/msda.h) */
    int group;   /* fast kernels: threads an item's channels take (C / vec); 0 generic */
    int vec;     /* fast kernels: channels a thread (4, or 8: wide, half-type direct) */
    int split;   /* direct kernel: lane groups an item's points are split over (1, 2, 4) */
    int options; /* fast kernels: compiled with the option code (msda_uses_options) */
    unsigned int blocks; /* gridDim.x */
} msda_forward_plan;

typedef struct {
    int kernel;     /* MSDA_ROUTE_NONE .. MSDA_ROUTE_DIRECT (c/msda.h) */
    int modifiers;  /* MSDA_ROUTE_DETERMINISTIC | MSDA_ROUTE_F32_WORKSPACE */
    int group;      /* fast kernels: G = C / 4 threads an item (0 for the generic kernel) */
    int options;    /* fast kernels: compiled with the option code (msda_uses_options) */
    int slices;     /* gridDim.y: slices of each item's points */
    int split;      /* direct kernel: lane groups an item's points are split over (1, 2, 4) */
    unsigned int blocks; /* gridDim.x */
} msda_backward_plan;

/* G = C / 4 when the fast kernels' size conditions hold (f32/f16/bf16, C = 4 * G with G a power
 * of two <= 32, B*S*H*C < 2^31, B*Q*H <= 2^31 - 1024, L <= MSDA_FAST_MAX_LEVELS), else 0. The caller also
 * needs its tensors 16-byte aligned. */
int msda_fast_group(const msda_problem *pr);
/* Whether a half-precision grad_value is summed in an f32 buffer in the workspace: code older
 * than sm_90 (no half-precision vector reductions), no MSDA_DETERMINISTIC, grad_value wanted. */
int msda_backward_f32_workspace(const msda_problem *pr, int sm90_code);
/* The route of a checked forward problem. aligned16: value and output are 16-byte aligned. */
void msda_plan_forward(const msda_problem *pr, int aligned16, msda_forward_plan *plan);
/* The route of a checked backward problem. aligned16: value, grad_output and the grad_value
 * the kernels write (the workspace with MSDA_ROUTE_F32_WORKSPACE) are 16-byte aligned;
 * multiprocessors and sm90_code: facts of the device (its multiprocessor count, 0 if unknown;
 * whether the code it runs is built for sm_90 or newer). */
void msda_plan_backward(const msda_problem *pr, int aligned16, int multiprocessors,
                        int sm90_code, msda_backward_plan *plan);
/* The device facts above for CUDA device `device` (MSDA_ERR_UNSUPPORTED without CUDA). */
int msda_cuda_device_facts(int device, int *multiprocessors, int *sm90_code);

/* CUDA launchers (kernels/), or in a CPU-only build the stubs of c/cuda_stub.c. */
int msda_cuda_forward(const msda_problem *pr);
int msda_cuda_backward(const msda_problem *pr);
/* msda_level_starts on a CUDA device (arguments checked) */
int msda_cuda_level_starts(int64_t L, int64_t S, int index_dtype, int device,
                           const void *spatial_shapes, void *level_start_index, void *stream);
/* Workspace bytes msda_cuda_backward needs for a checked problem (0 if none). */
int64_t msda_cuda_workspace_size(const msda_problem *pr);
int msda_cuda_built(void);
int msda_cuda_devices(void);
int msda_cuda_kernels_run_on(int device);
const char *msda_cuda_arch_list(void);
int msda_cuda_toolkit_version(void);

#ifdef __cplusplus
}
#endif

#endif /* MSDA_INTERNAL_H */
