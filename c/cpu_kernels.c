/* c/cpu_kernels.c: MSDA forward and backward on the CPU, threaded with OpenMP.
 *
 * out[b,q,h,c] = sum_{l,p} A[b,q,h,l,p] * bilinear(V_l[b,:,:,h,c], x = loc_x*W_l - 0.5,
 *                                                                  y = loc_y*H_l - 0.5)
 * Layouts as in msda.h; a "row" is the C channels of value[b, s, h, :] (H*C elements apart from
 * the next position). The per-dtype kernels are cpu_kernels.inc, included once per element type.
 *
 * Geometry (GEOMETRY in the .inc): the points of one (b, q, h) are located GROUP = 16 at a time,
 * lane-wise so the loops vectorise: x, y, the cell, the fraction and the four corner indices in
 * double, where they are exact, so fx = x - floor(x) is rounded once; a point or corner outside
 * its level (or outside [0, S), for lying shape tables) reads a zero row with weight 0.
 * Forward: tasks of (b, q) rows, all heads of a query together (its heads read neighbouring value
 *   rows). Per (b, q, h): the group's 4 x 16 corner rows are summed into CHUNK accumulators that
 *   stay in vector registers (GATHER_FULL: 4 FMAs a corner for C = 32 with AVX2), while the next
 *   group is located and its rows prefetched.
 * Backward: grad_value is zeroed in 2 MB pieces by all threads, then one task per (b, h) owns
 *   grad_value[b, :, h, :] and writes the location and weight gradients of its (b, *, h) points:
 *   no two threads write the same element, no lock or atomic. Per point: four dot products
 *   go . corner row kept as LANES partial sums, combined lane-wise into the three sums the point
 *   gradients need and reduced by a fixed tree (vectorised without -ffast-math, same sums on any
 *   vector width), and the four grad_value rows updated. Groups are located one ahead and, for a
 *   map over 4 MB, their value and grad_value rows prefetched; the (b, h) slice's strided rows of
 *   grad_output, sampling_locations and attention_weights are prefetched 4 queries ahead. With
 *   fewer (b, h) slices than 4 per thread (B = H = 1, many threads) the work splits instead into
 *   point-gradient tasks over (b, h, query block) and grad_value tasks over (b, h, channel block).
 * Numerics: f32 accumulation for f32/f16/bf16, f64 for f64. f16/bf16 values are converted as they
 *   are loaded (once per use; half.h's conversions are branch-free so those loops vectorise) and
 *   a grad_output row once per (b, q, h). Results do not depend on the thread count.
 * Vector width: the kernels (FORWARD_ROWS, BACKWARD_TASK) are built twice with target_clones,
 *   x86-64-v3 (AVX2 + FMA) and the baseline; an ifunc picks one at load time. No -march=native.
 *   Elsewhere (aarch64, clang) the baseline build only.
 * Threads: the caller's count (pymsda passes torch.get_num_threads()), tasks handed out through
 *   an atomic counter, so a thread that starts late or is preempted leaves its share to the
 *   others. libpymsda links libgomp.so.1 and torch's pip wheels ship a libgomp.so.1 too: the
 *   loader resolves both to the one already loaded (torch's, as pymsda imports torch first), so
 *   torch and pymsda share one OpenMP runtime and one thread pool (tests/test_cpu_threads.py
 *   checks it) and no second runtime spins against torch's; hence OpenMP rather than a pool of
 *   our own. One thread (a DataLoader worker: torch sets 1 there) calls no OpenMP function at
 *   all, which keeps a forked worker clear of the parent's pool (libgomp is not fork-safe, for
 *   torch's own ops either); inside an OpenMP parallel region the op runs on one thread.
 * Memory: per-thread scratch of a few C-element rows; outputs larger than 8 MB are madvise'd to
 *   transparent huge pages before their first write (fresh 40 MB grad_value: 11-21 ms of 4 KB
 *   page faults, ~3-4 ms with huge pages).
 *
 * Tried (times: kernel only, 3 input sets in rotation, this 2-core AMD EPYC VM; ratios from
 * interleaved single-thread A/B runs, which the machine's noise (often +-25%) allows):
 *   v0 (the first version): per-(b,q) forward with a C-loop per corner into an accumulator in
 *      memory; per-(b,h) backward with runtime-C loops. 2 threads: small_enc f32 fwd 3.0 /
 *      bwd 12.0 ms, dec300 3.3 / 8.8, ddetr_dec 5.5 / 15.0.
 *   v1 CHUNK accumulators in registers: 1.4x SLOWER at first: GCC's unroll-and-jam (-O3) paired
 *      corners and left the channel loop scalar; -fno-loop-unroll-and-jam: forward 2x faster.
 *   v2 backward per-corner loops with `omp simd reduction`: GCC sums the lanes one by one from
 *      the stack; the fixed LANES partial sums and tree instead: backward -15..-20%.
 *   v3 LANES 16 for f16/bf16 (a 16-bit load fills a 256-bit vector only at 16 lanes; at 8 the
 *      sums went through the stack with failed store forwarding): bf16 backward -10..-15%;
 *      LANES 4 for f64: -7%.
 *   v4 backward prefetch of the rows a group will touch: decoders -20..-25%, small_enc +8%
 *      (1.4 MB map, in cache) -> only for maps over 4 MB; strided loc/attn/go rows prefetched
 *      4 queries ahead: -5..-20%; prefetch into L2 (locality 1) rather than L1: -10..-30%.
 *   v5 forward: next group located and prefetched while the current one is summed: f32 decoders
 *      -10%, bf16 -30..-40%.
 *   v6 vectorised geometry (it was 78-85% of the forward): forward -20..-27% (f32, bf16);
 *      needs -fno-trapping-math, else GCC will not if-convert the floating-point compares.
 *      2 threads: small_enc f32 fwd 2.5 / bwd 5.2 ms, dec300 1.0 / 2.9, ddetr_dec 1.2 / 5.8
 *      <- shipped.
 *   Not shipped: an AVX-512 clone (f32/f64 -3..-7%, bf16 backward +18..+27%); zeroing each
 *   (b, h) slice in its own task instead of the shared memset (+0..+15%); a two-phase backward,
 *   point gradients over (b, q) rows like the forward and grad_value over (b, h) (small_enc
 *   +12..+21%, decoders +-3%); grad_value contributions counting-sorted by row and applied in
 *   one sweep that writes each row once, no memset (1.15-2.7x slower: strided stores read each
 *   line first); the split mode for every shape (dec300 backward +15%).
 */
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
 * rows are streams the hardware prefetcher follows). Locality 1 (prefetcht2 / prefetchw on x86):
 * into the outer caches, which measured 10-30% faster on the decoder shapes than into L1
 * (locality 3) and much faster than non-temporal (0). */
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

/* Part `part` of `parts` of [0, n). */
static void split_range(int64_t n, int part, int parts, int64_t *begin, int64_t *end) {
    *begin = n * part / parts;
    *end = n * (part + 1) / parts;
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
