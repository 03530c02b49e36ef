/* c/cpu_plain.c: the tuned plain op, MSDA forward and backward on the CPU (math: c/msda.h)
 * for uniform points and bilinear sampling (the options: c/cpu_options.c), threaded with
 * OpenMP; the per-dtype kernels are cpu_plain.inc, included once per element type. A "row" is
 * the C channels of value[b, s, h, :].
 * Geometry (cpu_plain_geometry.inc): a (b, q, h)'s points are located 16 at a time in one
 *   vectorised loop, in double, where x, the cell, the fraction and the corner offsets are
 *   exact (fx rounded once); each point's level from a per-call table. A corner outside its
 *   level or [0, S) reads a zero row with weight 0.
 * Query order (query_order): a decoder's queries (Q != S, Q <= 4096) are walked in Z-order of
 *   where they sample (a stable radix sort), so neighbouring queries share lines and pages; the
 *   out-of-order rows are prefetched two queries ahead. The order depends on the inputs only.
 * Forward: tasks of (b, q) rows, all heads of a query together; a group's 4 x 16 corner rows
 *   summed into accumulators held in vector registers while the next group is located.
 * Backward: a task owns grad_value[b, :, h_begin:h_end, :] and the point gradients of those
 *   heads: no two threads write one element, no atomics. Whole batches a task where they divide
 *   evenly (each task zeroes its own block), else blocks of heads after a shared zeroing; with
 *   fewer (b, h) slices than 4 a thread, point-gradient tasks and grad_value tasks apart.
 *   Per point (point_bwd): the four dot products with 32-byte vector lanes, reduced by a fixed
 *   tree; grad_value rows updated in place; rows prefetched ahead.
 * Numerics: f32 accumulation for f32/f16/bf16 (half values converted as loaded), f64 for f64.
 *   With MSDA_POINTS_F32 the half kernels read locations and weights as float32 and write their
 *   gradients as float32 (POINTS_F32 and friends, c/dtypes.h; the test: cpu_plain_geometry.inc).
 *   Results do not depend on the thread count or the split: each grad_value row gets its terms
 *   in query order, the point gradients come from one compiled loop; only FMA contraction
 *   (x86-64-v3/v4 clones against the baseline) changes the last bits between machines.
 * Vector width: forward_rows and backward_task are built for x86-64-v4, x86-64-v3 and the
 *   baseline (target_clones, chosen at load); no -march=native.
 * Threads: the caller's count (torch.get_num_threads()), tasks from an atomic counter. libgomp
 *   resolves to torch's copy, so both share one OpenMP pool; one thread calls no OpenMP at all
 *   (fork-safe DataLoader workers); inside a parallel region the op runs on one thread.
 * Memory: per-thread scratch and one level table (at most 1.5 MB); a grad_value of 4 MB or more
 *   is madvise'd to huge pages before it is written (Python reuses its buffers, so they are
 *   faulted in once; fewer TLB misses in the scatter). What was measured: kernels/TUNING.md.
 */
#if !defined(_DEFAULT_SOURCE)
#define _DEFAULT_SOURCE /* madvise under -std=c11 */
#endif
#include <stdlib.h>
#include <string.h>

#if defined(__linux__)
#include <sys/mman.h>
#endif

#include "cpu_common.h"

// ---------------------------------------------------------------------------------------------
// helpers

/* Kernels whose inner loops pay off with wider vectors get AVX-512 (x86-64-v4) and AVX2+FMA
 * (x86-64-v3) clones beside the baseline one; the loader picks one per process through an ifunc.
 * The v4 clone keeps the backward's 32-byte vectors (GCC's generic tuning prefers 256-bit ones)
 * but has 32 vector registers (no spills around the channel loops), mask compares and 8-lane
 * double geometry: fewer instructions a point, the same operations and results as the v3 clone
 * (kernels/TUNING.md, CPU v12). Elsewhere (aarch64, compilers without target_clones) the
 * attribute is empty and the baseline build is used. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && defined(__linux__) && \
    !defined(MSDA_NO_CLONES)
#define MSDA_CLONES \
    __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define MSDA_CLONES
#endif

/* The per-call tables (c/cpu_common.h): the level of every point (l, p) of a (b, q, h), read
 * from the caller's int32/int64 shape tensors: its W, H and start offset as doubles (the
 * sampling geometry's type), one entry per point so the geometry loop loads them as vectors.
 * One allocation of 3 * L * P doubles, or, past LEVEL_TABLE_MAX_POINTS points, of 3 * L (one
 * entry per level, looked up point by point). */
#ifndef LEVEL_TABLE_MAX_POINTS
#define LEVEL_TABLE_MAX_POINTS ((int64_t)1 << 16)
#endif
struct cpu_tables {
    int per_point; /* 1: entry p for point p of L * P; 0: entry l for level l */
    int64_t P;
    double *w, *h, *start;
};

static int read_tables(const msda_problem *pr, const char *fn, cpu_tables **out) {
    const int64_t LP = pr->L * pr->P;
    const int per_point = LP <= LEVEL_TABLE_MAX_POINTS;
    const int64_t entries = per_point ? LP : pr->L, copies = per_point ? pr->P : 1;
    /* Offsets are computed in double (exact below 2^52 elements); a tensor that large cannot
     * exist in a 48-bit address space, so this only refuses lying sizes. */
    if (pr->B * pr->S * pr->H * pr->C >= ((int64_t)1 << 50))
        return msda_set_error(MSDA_ERR_INVALID_ARGUMENT, "%s: value has %lld elements, more "
                              "than the CPU kernels support (2^50)", fn,
                              (long long)(pr->B * pr->S * pr->H * pr->C));
    cpu_tables *t =
        (cpu_tables *)malloc(sizeof(cpu_tables) + 3 * (size_t)entries * sizeof(double));
    if (!t)
        return msda_set_error(MSDA_ERR_INTERNAL, "%s: host malloc of %lld level entries failed",
                              fn, (long long)entries);
    t->per_point = per_point;
    t->P = pr->P;
    t->w = (double *)(t + 1);
    t->h = t->w + entries;
    t->start = t->h + entries;
    for (int64_t l = 0; l < pr->L; l++) {
        cpu_level lv = cpu_level_at(pr, l);
        /* A level no point can land in (empty, or too large for exact double geometry). */
        if (lv.h <= 0 || lv.w <= 0 || lv.h > ((int64_t)1 << 40) || lv.w > ((int64_t)1 << 40))
            lv.h = lv.w = 0;
        for (int64_t p = l * copies; p < (l + 1) * copies; p++) {
            t->w[p] = (double)lv.w;
            t->h[p] = (double)lv.h;
            t->start[p] = (double)lv.start;
        }
    }
    *out = t;
    return MSDA_OK;
}

static void free_tables(cpu_tables *t) { free(t); }

/* Asks Linux to back grad_value, which the kernel is about to write in full and then scatters
 * into at random, with transparent huge pages: fewer TLB misses in the scatter. Python hands
 * out CPU gradients from a pool of reused buffers (pymsda/_buffers.py), so the pages are faulted
 * in once, not on every call, and the advice pays from 4 MB (kernels/TUNING.md, CPU "v14 huge
 * pages"). Unpooled buffers, which glibc maps afresh or regrows its heap for, pay more per
 * regrowth with huge pages (CPU v13); the pool is the remedy. Only whole 2 MB pages inside the
 * buffer are advised, so no other memory is affected; failure is harmless.
 * MSDA_HUGE_MIN_BYTES (-D) moves the threshold for experiments. */
#ifndef MSDA_HUGE_MIN_BYTES
#define MSDA_HUGE_MIN_BYTES ((int64_t)4 << 20)
#endif
static void advise_huge_pages(void *ptr, int64_t bytes) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    const uintptr_t huge = (uintptr_t)2 << 20;
    if (!ptr || bytes < MSDA_HUGE_MIN_BYTES) return;
    uintptr_t begin = ((uintptr_t)ptr + huge - 1) & ~(huge - 1);
    uintptr_t end = ((uintptr_t)ptr + (uintptr_t)bytes) & ~(huge - 1);
    if (end > begin) (void)madvise((void *)begin, end - begin, MADV_HUGEPAGE);
#else
    (void)ptr, (void)bytes;
#endif
}

/* Prefetches the cache lines of a row about to be read / written (the first 256 bytes: wider
 * rows are streams the hardware prefetcher follows). Locality 1 (prefetcht2 / prefetchw on x86):
 * into the outer caches, faster on the decoder shapes than into L1 (locality 3) or
 * non-temporal (0): kernels/TUNING.md, CPU v4. */
static inline void msda_prefetch_read(const void *row, int64_t bytes) {
    const uintptr_t first = (uintptr_t)row & ~(uintptr_t)63;
    const uintptr_t end = (uintptr_t)row + (uintptr_t)(bytes < 256 ? bytes : 256);
    for (uintptr_t a = first; a < end; a += 64) __builtin_prefetch((const void *)a, 0, 1);
}

static inline void msda_prefetch_write(void *row, int64_t bytes) {
    const uintptr_t first = (uintptr_t)row & ~(uintptr_t)63;
    const uintptr_t end = (uintptr_t)row + (uintptr_t)(bytes < 256 ? bytes : 256);
    for (uintptr_t a = first; a < end; a += 64) __builtin_prefetch((const void *)a, 1, 1);
}

/* Prefetches every line of [p, p + bytes), for reading (write 0) or writing (1). */
static inline void prefetch_span(const void *p, int64_t bytes, int write) {
    const uintptr_t end = (uintptr_t)p + (uintptr_t)bytes;
    for (uintptr_t a = (uintptr_t)p & ~(uintptr_t)63; a < end; a += 64) {
        if (write)
            __builtin_prefetch((const void *)a, 1, 1);
        else
            __builtin_prefetch((const void *)a, 0, 1);
    }
}

/* Part `part` of `parts` of [0, n). */
static void split_range(int64_t n, int part, int parts, int64_t *begin, int64_t *end) {
    *begin = n * part / parts;
    *end = n * (part + 1) / parts;
}

/* Element loads and stores, scalar (load_f32 ... store_bf16) and of 32-byte vectors (loadv_f32
 * ... loadv_bf16, the vector types msda_v8f and msda_v4d): c/dtypes.h. */

/* The lane sums of three vectors a, b, c, each by a fixed tree: lanes i and i + VL/2 first. */
static inline void reduce3_v8f(const msda_v8f *a, const msda_v8f *b, const msda_v8f *c,
                               float *sums) {
    const msda_v8f z = {0, 0, 0, 0, 0, 0, 0, 0};
    const msda_v8f x = __builtin_shufflevector(*a, *b, 0, 1, 2, 3, 8, 9, 10, 11) +
                       __builtin_shufflevector(*a, *b, 4, 5, 6, 7, 12, 13, 14, 15);
    const msda_v8f y = __builtin_shufflevector(*c, z, 0, 1, 2, 3, 8, 9, 10, 11) +
                       __builtin_shufflevector(*c, z, 4, 5, 6, 7, 12, 13, 14, 15);
    /* lanes 0, 1: a; 2, 3: c; 4, 5: b; 6, 7: zero */
    const msda_v8f t = __builtin_shufflevector(x, y, 0, 1, 8, 9, 4, 5, 12, 13) +
                       __builtin_shufflevector(x, y, 2, 3, 10, 11, 6, 7, 14, 15);
    sums[0] = t[0] + t[1];
    sums[1] = t[4] + t[5];
    sums[2] = t[2] + t[3];
}

static inline void reduce3_v4d(const msda_v4d *a, const msda_v4d *b, const msda_v4d *c,
                               double *sums) {
    const msda_v4d z = {0, 0, 0, 0};
    const msda_v4d x = __builtin_shufflevector(*a, *b, 0, 1, 4, 5) +
                       __builtin_shufflevector(*a, *b, 2, 3, 6, 7);
    const msda_v4d y = __builtin_shufflevector(*c, z, 0, 1, 4, 5) +
                       __builtin_shufflevector(*c, z, 2, 3, 6, 7);
    sums[0] = x[0] + x[1];
    sums[1] = x[2] + x[3];
    sums[2] = y[0] + y[1];
}

/* x and y (8 bits each) interleaved, x in the even bits: the Z-curve index of cell (x, y). */
static inline uint32_t morton16(uint32_t x, uint32_t y) {
    x &= 255, y &= 255;
    x = (x | x << 4) & 0x0f0f, y = (y | y << 4) & 0x0f0f;
    x = (x | x << 2) & 0x3333, y = (y | y << 2) & 0x3333;
    x = (x | x << 1) & 0x5555, y = (y | y << 1) & 0x5555;
    return x | y << 1;
}

// ---------------------------------------------------------------------------------------------
// kernels, one set per element type (c/cpu_instances.inc: a row of the dtype table each)

/* Points located together (lane-wise) before their channel loops run. */
#define GROUP 16
/* Most queries (per batch) that query_order sorts (a decoder has 100-900; its keys hold q in 16
 * bits, and the sort is a scratch of Q entries). */
#define ORDER_MAX_QUERIES 4096
/* value tensors above this size get the rows the backward gathers prefetched */
#define PREFETCH_MIN_BYTES ((int64_t)4 << 20)

/* The backward's 32-byte vector of ACC lanes (VEC, VL lanes), a broadcast (VSPLAT, as x - 0:
 * exact, so GCC drops the subtraction; 0 + x, which is not exact for x = -0, cost an add per
 * broadcast), the three-sum reduction (REDUCE3) and the forward's register-resident chunk of
 * channels (CHUNK), by accumulation type. */
#define PLAIN_VEC_float msda_v8f
#define PLAIN_VL_float 8
#define PLAIN_REDUCE3_float reduce3_v8f
#define PLAIN_CHUNK_float 32
#define PLAIN_VEC_double msda_v4d
#define PLAIN_VL_double 4
#define PLAIN_REDUCE3_double reduce3_v4d
#define PLAIN_CHUNK_double 16
#define PLAIN_OF_ACC_(param, acc) PLAIN_##param##_##acc
#define PLAIN_OF_ACC(param, acc) PLAIN_OF_ACC_(param, acc)
#define VEC PLAIN_OF_ACC(VEC, ACC)
#define VL PLAIN_OF_ACC(VL, ACC)
#define VSPLAT(x) ((x) - (VEC){0})
#define REDUCE3 PLAIN_OF_ACC(REDUCE3, ACC)
#define CHUNK PLAIN_OF_ACC(CHUNK, ACC)

#define CPU_TEMPLATE "cpu_plain.inc"
#include "cpu_instances.inc"

// ---------------------------------------------------------------------------------------------
// entry points

#define FORWARD_OF(code, suffix, ...) [code] = MSDA_CAT(forward, suffix),
#define BACKWARD_OF(code, suffix, ...) [code] = MSDA_CAT(backward, suffix),

int msda_cpu_plain_forward(const msda_problem *pr) {
    static const cpu_kernel kernels[MSDA_DTYPE_COUNT] = {MSDA_DTYPES(FORWARD_OF)};
    return run_kernel(pr, "msda_forward", kernels);
}

int msda_cpu_plain_backward(const msda_problem *pr) {
    static const cpu_kernel kernels[MSDA_DTYPE_COUNT] = {MSDA_DTYPES(BACKWARD_OF)};
    return run_kernel(pr, "msda_backward", kernels);
}
