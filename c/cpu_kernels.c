/* c/cpu_kernels.c: MSDA forward and backward on the CPU, threaded with OpenMP.
 *
 * out[b,q,h,c] = sum_{l,p} A[b,q,h,l,p] * bilinear(V_l[b,:,:,h,c], x = loc_x*W_l - 0.5,
 *                                                                  y = loc_y*H_l - 0.5)
 * Work split:
 *   forward  - one task per (b, q): writes out[b, q, :, :] only.
 *   backward - one task per (b, h): owns grad_value[b, :, h, :] and the (b, *, h) slices of the
 *              location and weight gradients, so no two threads write the same element and no
 *              lock or atomic is needed.
 * Numerics: f32 accumulation for f32/f16/bf16 (half types converted once per load), f64 for f64.
 * The sampling coordinate is split into an exact integer part and a fraction that keeps the
 * rounding error of loc*W out of it (see sample_point in cpu_kernels.inc).
 * Every corner read is bounds-checked against the level and against [0, S), so shape tables that
 * disagree with the value tensor give wrong numbers at worst, never an out-of-bounds access.
 * The per-dtype kernels are cpu_kernels.inc included once per element type.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "half.h"
#include "msda_internal.h"

#ifdef _OPENMP
#include <omp.h>
#endif

// ---------------------------------------------------------------------------------------------
// helpers

/* The level table read from the caller's int32/int64 shape tensors. */
typedef struct {
    int64_t h, w, start;
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
    }
    return lv;
}

static int thread_count(const msda_problem *pr) {
#ifdef _OPENMP
    return pr->num_threads > 0 ? pr->num_threads : omp_get_max_threads();
#else
    (void)pr;
    return 1;
#endif
}

/* Element loads and stores; acc is the accumulation type. */
static inline float load_f32(const float *p, int64_t i) { return p[i]; }
static inline double load_f64(const double *p, int64_t i) { return p[i]; }
static inline float load_f16(const uint16_t *p, int64_t i) { return msda_half_to_float(p[i]); }
static inline float load_bf16(const uint16_t *p, int64_t i) { return msda_bf16_to_float(p[i]); }
static inline void store_f32(float *p, int64_t i, float v) { p[i] = v; }
static inline void store_f64(double *p, int64_t i, double v) { p[i] = v; }
static inline void store_f16(uint16_t *p, int64_t i, float v) { p[i] = msda_float_to_half(v); }
static inline void store_bf16(uint16_t *p, int64_t i, float v) { p[i] = msda_float_to_bf16(v); }

// ---------------------------------------------------------------------------------------------
// kernels, one set per element type

#define SCALAR float
#define ACC float
#define SUFFIX f32
#include "cpu_kernels.inc"

#define SCALAR double
#define ACC double
#define SUFFIX f64
#include "cpu_kernels.inc"

#define SCALAR uint16_t
#define ACC float
#define SUFFIX f16
#include "cpu_kernels.inc"

#define SCALAR uint16_t
#define ACC float
#define SUFFIX bf16
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
