/* c/half.h: IEEE binary16 and bfloat16 <-> float conversions for the CPU kernels.
 * Written out in integer arithmetic so any C99 compiler builds them (no _Float16, no F16C);
 * float -> half rounds to nearest even, NaN stays NaN, overflow goes to infinity. */
#ifndef MSDA_HALF_H
#define MSDA_HALF_H

#include <stdint.h>
#include <string.h>

static inline float msda_bits_to_float(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static inline uint32_t msda_float_to_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }

/* Branch-free, so a loop converting a row vectorises: the exponent and mantissa shifted into
 * place and rebiased are a normal number's bits; all-ones exponents (inf, nan) get the float's
 * all-ones exponent; subnormals are the mantissa times 2^-24, formed exactly as
 * (2^-14 + man * 2^-24) - 2^-14. */
static inline float msda_half_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    const uint32_t em = (uint32_t)(h & 0x7fffu) << 13; /* exponent and mantissa, float places */
    const uint32_t exp = em & 0x0f800000u;
    const uint32_t normal = em + 0x38000000u;           /* rebias: (127 - 15) << 23 */
    const uint32_t special = em | 0x7f800000u;          /* inf / nan, payload kept */
    const float sub = msda_bits_to_float(em + 0x38800000u) - 6.103515625e-05f; /* - 2^-14 */
    const uint32_t bits = exp == 0x0f800000u ? special : exp == 0 ? msda_float_to_bits(sub) : normal;
    return msda_bits_to_float(bits | sign);
}

static inline uint16_t msda_float_to_half(float f) {
    uint32_t u = msda_float_to_bits(f);
    uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
    uint32_t a = u & 0x7fffffffu;
    if (a >= 0x7f800000u) return sign | (a > 0x7f800000u ? 0x7e00u : 0x7c00u); /* nan / inf */
    if (a >= 0x477ff000u) return sign | 0x7c00u;      /* rounds past 65504: inf */
    if (a < 0x38800000u) {                            /* below 2^-14: subnormal half or zero */
        /* man * 2^-24 with round-to-nearest-even, done by the FPU: adding 0.5 (2^-1) shifts
         * the value's bits so the half's subnormal mantissa lands in the low bits. */
        float t = msda_bits_to_float(a) + 0.5f;
        return sign | (uint16_t)(msda_float_to_bits(t) - 0x3f000000u);
    }
    uint32_t mant_odd = (a >> 13) & 1u;
    a += 0xc8000fffu + mant_odd; /* rebias exponent (-112 << 23) and round to nearest even */
    return sign | (uint16_t)(a >> 13);
}

static inline float msda_bf16_to_float(uint16_t b) { return msda_bits_to_float((uint32_t)b << 16); }

static inline uint16_t msda_float_to_bf16(float f) {
    uint32_t u = msda_float_to_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u); /* quiet nan */
    u += 0x7fffu + ((u >> 16) & 1u); /* round to nearest even */
    return (uint16_t)(u >> 16);
}

/* Element loads and stores of the CPU kernels by storage type (the half ones convert; f32 is
 * the accumulation type of f32, f16 and bf16). Branch-free, so channel loops that convert a row
 * while reading it still vectorise. */
static inline float load_f32(const float *p, int64_t i) { return p[i]; }
static inline double load_f64(const double *p, int64_t i) { return p[i]; }
static inline float load_f16(const uint16_t *p, int64_t i) { return msda_half_to_float(p[i]); }
static inline float load_bf16(const uint16_t *p, int64_t i) { return msda_bf16_to_float(p[i]); }
static inline void store_f32(float *p, int64_t i, float v) { p[i] = v; }
static inline void store_f64(double *p, int64_t i, double v) { p[i] = v; }
static inline void store_f16(uint16_t *p, int64_t i, float v) { p[i] = msda_float_to_half(v); }
static inline void store_bf16(uint16_t *p, int64_t i, float v) { p[i] = msda_float_to_bf16(v); }

/* Locations, weights and their gradients inside the kernel templates (c/cpu_plain.inc,
 * c/cpu_options.inc, which define SCALAR, LOAD, STORE and HALF_STORAGE): elements of SCALAR, or
 * float32 with MSDA_POINTS_F32 (c/msda.h), which only half storage has. points_f32 is
 * POINTS_F32(pr); with HALF_STORAGE 0 every test folds to the SCALAR case at compile time, so
 * the f32 and f64 kernels compile as if it were not there. POINT_AT: the address of element i;
 * POINT_BYTES: the size of one. */
#define POINTS_F32(pr) (HALF_STORAGE && ((pr)->flags & MSDA_POINTS_F32))
#define LOAD_POINT(p, i, points_f32)                                                            \
    ((HALF_STORAGE && (points_f32)) ? load_f32((const float *)(p), i)                           \
                                    : LOAD((const SCALAR *)(p), i))
#define STORE_POINT(p, i, v, points_f32)                                                        \
    ((HALF_STORAGE && (points_f32)) ? store_f32((float *)(p), i, v) : STORE((SCALAR *)(p), i, v))
#define POINT_AT(p, i, points_f32)                                                              \
    ((HALF_STORAGE && (points_f32)) ? (void *)((float *)(p) + (i))                              \
                                    : (void *)((SCALAR *)(p) + (i)))
#define POINT_BYTES(points_f32) \
    ((HALF_STORAGE && (points_f32)) ? (int64_t)sizeof(float) : (int64_t)sizeof(SCALAR))

#endif /* MSDA_HALF_H */
