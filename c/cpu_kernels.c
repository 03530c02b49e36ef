/* c/cpu_kernels.c: MSDA forward and backward on the CPU, threaded with OpenMP.
 * (header comment with the design notes: written after measuring) */
#if !defined(_DEFAULT_SOURCE)
#define _DEFAULT_SOURCE /* madvise under -std=c11 */
#endif
#include <stdlib.h>
#include <string.h>

#if defined(__linux__)
#include <sys/mman.h>
#endif

#include "half.h"
#include "msda_internal.h"

#ifdef _OPENMP
#include <omp.h>
#endif

// ---------------------------------------------------------------------------------------------
// helpers

/* Kernels whose inner loops pay off with wider vectors get an AVX2+FMA (x86-64-v3) clone beside
 * the baseline one; the loader picks one per process through an ifunc. Elsewhere (aarch64,
 * compilers without target_clones) the attribute is empty and the baseline build is used. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && defined(__linux__) && \
    !defined(MSDA_NO_CLONES)
#define MSDA_CLONES __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define MSDA_CLONES
#endif

/* The level table read from the caller's int32/int64 shape tensors. */
typedef struct {
    int64_t h, w, start;
    double hd, wd, sd; /* h, w and start as doubles, for the sampling geometry */
} level_info;

static level_info *read_levels(const msda_problem *pr, const char *fn) {
    level_info *lv = (level_info *)malloc((size_t)pr->L * sizeof(level_info));
    if (!lv) {
        msda_set_error(MSDA_ERR_INTERNAL, "%s: host malloc of %lld level entries failed", fn,
                       (long long)pr->L);
        return NULL;
    }
    for (int64_t l = 0; l < pr->L; l++) {
        if (pr->index_dtype == MSDA_I64) {
            const int64_t *ss = (const int64_t *)pr->spatial_shapes;
            lv[l].h = ss[2 * l];
            lv[l].w = ss[2 * l + 1];
            lv[l].start = ((const int64_t *)pr->level_start_index)[l];
        } else {
            const int32_t *ss = (const int32_t *)pr->spatial_shapes;
            lv[l].h = ss[2 * l];
            lv[l].w = ss[2 * l + 1];
            lv[l].start = ((const int32_t *)pr->level_start_index)[l];
        }
        /* A level no point can land in (empty, or too large for exact double geometry). */
        if (lv[l].h <= 0 || lv[l].w <= 0 || lv[l].h > ((int64_t)1 << 40) ||
            lv[l].w > ((int64_t)1 << 40))
            lv[l].h = lv[l].w = 0;
        lv[l].hd = (double)lv[l].h;
        lv[l].wd = (double)lv[l].w;
        lv[l].sd = (double)lv[l].start;
    }
    return lv;
}

/* Threads for a call with `work` sampling points: the caller's count (torch.get_num_threads()),
 * the OpenMP default when it passed <= 0, and 1 for tiny calls (a team costs more than it saves)
 * or when called from inside an OpenMP parallel region (a nested team would oversubscribe).
 * With 1 thread no OpenMP function is called at all, which keeps a forked DataLoader worker
 * (torch sets 1 thread there) clear of the parent's thread pool, which fork does not copy. */
static int thread_count(const msda_problem *pr, int64_t work) {
#ifdef _OPENMP
    if (pr->num_threads == 1 || work < 2048) return 1;
    if (omp_in_parallel()) return 1;
    const int n = pr->num_threads > 0 ? pr->num_threads : omp_get_max_threads();
    return n > 1 ? n : 1;
#else
    (void)pr, (void)work;
    return 1;
#endif
}

static inline int msda_thread_num(void) {
#ifdef _OPENMP
    return omp_get_thread_num();
#else
    return 0;
#endif
}

static inline int msda_num_threads(void) {
#ifdef _OPENMP
    return omp_get_num_threads();
#else
    return 1;
#endif
}

/* Asks Linux to back a large output buffer, which the kernel is about to write in full, with
 * transparent huge pages. Python allocates outputs fresh on every call and glibc maps buffers
 * above 32 MB afresh each time, so their first touch is one page fault per 4 KB (ddetr_dec
 * grad_value, 40 MB: 11-21 ms of faults here, against ~3 ms with huge pages). Only whole 2 MB
 * pages inside the buffer are advised, so no other memory is affected; failure is harmless. */
static void advise_huge_pages(void *ptr, int64_t bytes) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    const uintptr_t huge = (uintptr_t)2 << 20;
    if (!ptr || bytes < ((int64_t)8 << 20)) return;
    uintptr_t begin = ((uintptr_t)ptr + huge - 1) & ~(huge - 1);
    uintptr_t end = ((uintptr_t)ptr + (uintptr_t)bytes) & ~(huge - 1);
    if (end > begin) (void)madvise((void *)begin, end - begin, MADV_HUGEPAGE);
#else
    (void)ptr, (void)bytes;
#endif
}

/* Prefetches the cache lines of a row about to be read / written (the first 256 bytes: wider
 * rows are streams the hardware prefetcher follows). */
#ifndef MSDA_PF_LOCALITY
#define MSDA_PF_LOCALITY 1
#endif
static inline void msda_prefetch_read(const void *row, int64_t bytes) {
    const uintptr_t first = (uintptr_t)row & ~(uintptr_t)63;
    const uintptr_t end = (uintptr_t)row + (uintptr_t)(bytes < 256 ? bytes : 256);
    for (uintptr_t a = first; a < end; a += 64) __builtin_prefetch((const void *)a, 0, MSDA_PF_LOCALITY);
}

static inline void msda_prefetch_write(void *row, int64_t bytes) {
    const uintptr_t first = (uintptr_t)row & ~(uintptr_t)63;
    const uintptr_t end = (uintptr_t)row + (uintptr_t)(bytes < 256 ? bytes : 256);
    for (uintptr_t a = first; a < end; a += 64) __builtin_prefetch((const void *)a, 1, MSDA_PF_LOCALITY);
}

/* Part `part` of `parts` of [0, n), in whole multiples of `align`. */
static void split_range(int64_t n, int64_t align, int part, int parts, int64_t *begin,
                        int64_t *end) {
    int64_t blocks = (n + align - 1) / align;
    *begin = blocks * part / parts * align;
    *end = blocks * (part + 1) / parts * align;
    if (*begin > n) *begin = n;
    if (*end > n) *end = n;
}

/* Element loads and stores; ACC is the accumulation type. The half loads are branch-free so the
 * channel loops that convert a value row while reading it still vectorise. */
static inline float load_f32(const float *p, int64_t i) { return p[i]; }
static inline double load_f64(const double *p, int64_t i) { return p[i]; }
static inline float load_f16(const uint16_t *p, int64_t i) { return msda_half_to_float(p[i]); }
static inline float load_bf16(const uint16_t *p, int64_t i) { return msda_bf16_to_float(p[i]); }
static inline void store_f32(float *p, int64_t i, float v) { p[i] = v; }
static inline void store_f64(double *p, int64_t i, double v) { p[i] = v; }
static inline void store_f16(uint16_t *p, int64_t i, float v) { p[i] = msda_float_to_half(v); }
static inline void store_bf16(uint16_t *p, int64_t i, float v) { p[i] = msda_float_to_bf16(v); }

// ---------------------------------------------------------------------------------------------
// kernels, one set per element type (CHUNK: channels one register-resident accumulator holds;
// LANES: partial sums per dot product in the backward, 16 for halves so a 256-bit vector is full)

/* Points located together (lane-wise) before their channel loops run. */
#define GROUP 16
/* value tensors above this size get the rows the backward gathers prefetched */
#define PREFETCH_MIN_BYTES ((int64_t)4 << 20)

#define SCALAR float
#define ACC float
#define SUFFIX f32
#define CHUNK 32
#define LANES 8
#define HALF_STORAGE 0
#include "cpu_kernels.inc"

#define SCALAR double
#define ACC double
#define SUFFIX f64
#define CHUNK 16
#define LANES 4
#define HALF_STORAGE 0
#include "cpu_kernels.inc"

#define SCALAR uint16_t
#define ACC float
#define SUFFIX f16
#define CHUNK 32
#define LANES 16
#define HALF_STORAGE 1
#include "cpu_kernels.inc"

#define SCALAR uint16_t
#define ACC float
#define SUFFIX bf16
#define CHUNK 32
#define LANES 16
#define HALF_STORAGE 1
#include "cpu_kernels.inc"

// ---------------------------------------------------------------------------------------------
// entry points

int msda_cpu_forward(const msda_problem *pr) {
    level_info *lv = read_levels(pr, "msda_forward");
    if (!lv) return MSDA_ERR_INTERNAL;
    int st;
    switch (pr->dtype) {
    case MSDA_F32: st = forward_f32(pr, lv); break;
    case MSDA_F64: st = forward_f64(pr, lv); break;
    case MSDA_F16: st = forward_f16(pr, lv); break;
    case MSDA_BF16: st = forward_bf16(pr, lv); break;
    default: st = msda_set_error(MSDA_ERR_INTERNAL, "msda_forward: dtype %d", pr->dtype);
    }
    free(lv);
    return st;
}

int msda_cpu_backward(const msda_problem *pr) {
    level_info *lv = read_levels(pr, "msda_backward");
    if (!lv) return MSDA_ERR_INTERNAL;
    int st;
    switch (pr->dtype) {
    case MSDA_F32: st = backward_f32(pr, lv); break;
    case MSDA_F64: st = backward_f64(pr, lv); break;
    case MSDA_F16: st = backward_f16(pr, lv); break;
    case MSDA_BF16: st = backward_bf16(pr, lv); break;
    default: st = msda_set_error(MSDA_ERR_INTERNAL, "msda_backward: dtype %d", pr->dtype);
    }
    free(lv);
    return st;
}
