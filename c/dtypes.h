/* c/dtypes.h: the element types the library serves, everything a type is in one file: one row
 * each (MSDA_DTYPES), the table the entry points, the route chooser and both dispatches (CPU:
 * c/cpu_common.h, CUDA: kernels/common.cuh) read; each type's element loads and stores for the
 * CPU kernels (host C only); and each type's conversions for the CUDA kernels (nvcc only).
 * Adding a dtype: docs/changing.md. Plain C, includable from CUDA C++. */
#ifndef MSDA_DTYPES_H
#define MSDA_DTYPES_H

#include <stdint.h>
#include <string.h>

#include "msda.h"

/* ---- the table ------------------------------------------------------------------------------
 * Row i is dtype code i (msda_dtype, c/msda.h), in that order: X(code, suffix, CPU storage type,
 * accumulation type, CUDA storage type, half), where the suffix names the functions and files of
 * the type (forward_f32, build/instances/backward_f32.o), and half is 1 for a half type:
 * 2-byte storage computed in f32, which takes MSDA_POINTS_F32, the wide forward, and (before
 * sm_90) a grad_value summed in an f32 workspace. A type accumulated in f32 has the fast CUDA
 * kernels; one accumulated in f64 the generic ones. A new row: MSDA_DTYPE_<i> and its name in
 * MSDA_DTYPES. */
#define MSDA_DTYPE_0(X) X(MSDA_F32, f32, float, float, float, 0)
#define MSDA_DTYPE_1(X) X(MSDA_F64, f64, double, double, double, 0)
#define MSDA_DTYPE_2(X) X(MSDA_F16, f16, uint16_t, float, __half, 1)
#define MSDA_DTYPE_3(X) X(MSDA_BF16, bf16, uint16_t, float, __nv_bfloat16, 1)
#define MSDA_DTYPES(X) MSDA_DTYPE_0(X) MSDA_DTYPE_1(X) MSDA_DTYPE_2(X) MSDA_DTYPE_3(X)

/* The number of rows, a constant expression the preprocessor can test too. */
#define MSDA_DTYPE_PLUS_ONE(...) +1
#define MSDA_DTYPE_COUNT (0 MSDA_DTYPES(MSDA_DTYPE_PLUS_ONE))
/* One column of row `row` (a number or a macro naming one): MSDA_DTYPE_AT(0, MSDA_DTYPE_SUFFIX)
 * is f32. */
#define MSDA_DTYPE_AT(row, column) MSDA_DTYPE_AT_(row, column)
#define MSDA_DTYPE_AT_(row, column) MSDA_DTYPE_##row(column)
#define MSDA_DTYPE_CODE(code, suffix, cpu_type, acc_type, cuda_type, half) code
#define MSDA_DTYPE_SUFFIX(code, suffix, cpu_type, acc_type, cuda_type, half) suffix
#define MSDA_DTYPE_CPU_TYPE(code, suffix, cpu_type, acc_type, cuda_type, half) cpu_type
#define MSDA_DTYPE_ACC_TYPE(code, suffix, cpu_type, acc_type, cuda_type, half) acc_type
#define MSDA_DTYPE_HALF(code, suffix, cpu_type, acc_type, cuda_type, half) half

/* name_suffix, with both arguments macro-expanded first (FN(forward) is forward_f32). */
#define MSDA_CAT_(a, b) a##_##b
#define MSDA_CAT(a, b) MSDA_CAT_(a, b)

/* Bytes of one element of `dtype` (0 for an unknown code). */
static inline int64_t msda_dtype_size(int dtype) {
#define MSDA_DTYPE_SIZE_CASE(code, suffix, cpu_type, acc_type, cuda_type, half) \
    case code: return (int64_t)sizeof(cpu_type);
    switch (dtype) { MSDA_DTYPES(MSDA_DTYPE_SIZE_CASE) default: return 0; }
#undef MSDA_DTYPE_SIZE_CASE
}
/* 1 for a half type (see the table), 0 otherwise. */
static inline int msda_dtype_half(int dtype) {
#define MSDA_DTYPE_HALF_CASE(code, suffix, cpu_type, acc_type, cuda_type, half) \
    case code: return half;
    switch (dtype) { MSDA_DTYPES(MSDA_DTYPE_HALF_CASE) default: return 0; }
#undef MSDA_DTYPE_HALF_CASE
}
/* Bytes of `dtype`'s accumulation type (0 for an unknown code). */
static inline int64_t msda_dtype_acc_size(int dtype) {
#define MSDA_DTYPE_ACC_CASE(code, suffix, cpu_type, acc_type, cuda_type, half) \
    case code: return (int64_t)sizeof(acc_type);
    switch (dtype) { MSDA_DTYPES(MSDA_DTYPE_ACC_CASE) default: return 0; }
#undef MSDA_DTYPE_ACC_CASE
}
/* 1 for a type accumulated in f32 (the fast CUDA kernels serve it), 0 otherwise. */
static inline int msda_dtype_acc_f32(int dtype) { return msda_dtype_acc_size(dtype) == 4; }

#if !defined(__CUDACC__)
/* ---- the CPU's element loads and stores -----------------------------------------------------
 * IEEE binary16 and bfloat16 <-> float conversions, written out in integer arithmetic so any C99
 * compiler builds them (no _Float16, no F16C); float -> half rounds to nearest even, NaN stays
 * NaN, overflow goes to infinity. */

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

/* 32-byte vectors (GCC / clang vector extensions) for the channel loops of the plain op's backward
 * (c/cpu_plain_backward.inc): lanes of the accumulation type; loadv_<suffix> converts one
 * vector's worth of stored elements. A target without 256-bit registers splits each operation
 * in two, with the same results. */
typedef float msda_v8f __attribute__((vector_size(32)));
typedef double msda_v4d __attribute__((vector_size(32)));
typedef uint16_t msda_v8h __attribute__((vector_size(16)));
typedef uint32_t msda_v8u __attribute__((vector_size(32)));

/* (Vectors travel through pointers: a vector argument or return value would change the ABI
 * between the clones, which GCC warns about.) */
static inline void loadv_f32(msda_v8f *v, const float *p) { memcpy(v, p, sizeof *v); }
static inline void loadv_f64(msda_v4d *v, const double *p) { memcpy(v, p, sizeof *v); }
static inline void loadv_bf16(msda_v8f *v, const uint16_t *p) {
    msda_v8h h;
    memcpy(&h, p, sizeof h);
    const msda_v8u u = __builtin_convertvector(h, msda_v8u) << 16;
    memcpy(v, &u, sizeof *v);
}
static inline void loadv_f16(msda_v8f *v, const uint16_t *p) {
    for (int i = 0; i < 8; i++) (*v)[i] = msda_half_to_float(p[i]);
}

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

#endif /* !__CUDACC__ */

/* ---- CUDA: each type's conversions (nvcc only) ----------------------------------------------
 * What the kernels (kernels/) read of a type besides its row: to_acc / from_acc, the 2-, 4- and
 * 8-channel vector loads and stores, and for a half type the pair packing and vector reduction
 * by which sm_90 sums its grad_value in its own type. */
#ifdef __CUDACC__
#include <cuda_bf16.h>
#include <cuda_fp16.h>

/* one element to and from its accumulation type (Acc: float for f32/f16/bf16, double for f64) */
__device__ __forceinline__ float to_acc(float v) { return v; }
__device__ __forceinline__ double to_acc(double v) { return v; }
__device__ __forceinline__ float to_acc(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_acc(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T> __device__ __forceinline__ T from_acc(float v);
template <> __device__ __forceinline__ float from_acc<float>(float v) { return v; }
template <> __device__ __forceinline__ __half from_acc<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_acc<__nv_bfloat16>(float v) {
    return __float2bfloat16_rn(v);
}
template <typename T> __device__ __forceinline__ T from_acc(double v);
template <> __device__ __forceinline__ double from_acc<double>(double v) { return v; }

/* 2, 4 and 8 channels at once (16-byte aligned vectors) */
__device__ __forceinline__ void load_vec(const float *p, float (&v)[2]) {
    const float2 u = __ldg(reinterpret_cast<const float2 *>(p));
    v[0] = u.x, v[1] = u.y;
}
__device__ __forceinline__ void load_vec(const float *p, float (&v)[4]) {
    const float4 u = __ldg(reinterpret_cast<const float4 *>(p));
    v[0] = u.x, v[1] = u.y, v[2] = u.z, v[3] = u.w;
}

__device__ __forceinline__ void load_vec(const __half *p, float (&v)[4]) {
    const uint2 u = __ldg(reinterpret_cast<const uint2 *>(p));
    const __half2 *h = reinterpret_cast<const __half2 *>(&u);
    const float2 a = __half22float2(h[0]), b = __half22float2(h[1]);
    v[0] = a.x, v[1] = a.y, v[2] = b.x, v[3] = b.y;
}
/* bf16 is the upper half of an f32: the low element of a word widens with a shift, the high one
 * with a mask (one instruction each; __bfloat1622float2 took a PRMT and a shift for the high) */
__device__ __forceinline__ void bf16x2_to_float(unsigned w, float &lo, float &hi) {
    lo = __uint_as_float(w << 16);
    hi = __uint_as_float(w & 0xffff0000u);
}
__device__ __forceinline__ void load_vec(const __nv_bfloat16 *p, float (&v)[4]) {
    const uint2 u = __ldg(reinterpret_cast<const uint2 *>(p));
    bf16x2_to_float(u.x, v[0], v[1]);
    bf16x2_to_float(u.y, v[2], v[3]);
}

/* 8 consecutive channels as floats (16-byte aligned: 32 bytes in f32, 16 in f16/bf16). */
__device__ __forceinline__ void load_vec8(const float *p, float (&v)[8]) {
    const float4 a = __ldg(reinterpret_cast<const float4 *>(p));
    const float4 b = __ldg(reinterpret_cast<const float4 *>(p) + 1);
    v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
}
__device__ __forceinline__ void load_vec8(const __half *p, float (&v)[8]) {
    const uint4 u = __ldg(reinterpret_cast<const uint4 *>(p));
    const __half2 *h = reinterpret_cast<const __half2 *>(&u);
#pragma unroll
    for (int q = 0; q < 4; q++) {
        const float2 f = __half22float2(h[q]);
        v[2 * q] = f.x, v[2 * q + 1] = f.y;
    }
}
__device__ __forceinline__ void load_vec8(const __nv_bfloat16 *p, float (&v)[8]) {
    const uint4 u = __ldg(reinterpret_cast<const uint4 *>(p));
    bf16x2_to_float(u.x, v[0], v[1]);
    bf16x2_to_float(u.y, v[2], v[3]);
    bf16x2_to_float(u.z, v[4], v[5]);
    bf16x2_to_float(u.w, v[6], v[7]);
}

__device__ __forceinline__ void store_vec(float *p, const float (&v)[4]) {
    *reinterpret_cast<float4 *>(p) = make_float4(v[0], v[1], v[2], v[3]);
}
__device__ __forceinline__ void store_vec(__half *p, const float (&v)[4]) {
    uint2 u;
    __half2 *h = reinterpret_cast<__half2 *>(&u);
    h[0] = __floats2half2_rn(v[0], v[1]), h[1] = __floats2half2_rn(v[2], v[3]);
    *reinterpret_cast<uint2 *>(p) = u;
}
__device__ __forceinline__ void store_vec(__nv_bfloat16 *p, const float (&v)[4]) {
    uint2 u;
    __nv_bfloat162 *h = reinterpret_cast<__nv_bfloat162 *>(&u);
    h[0] = __floats2bfloat162_rn(v[0], v[1]), h[1] = __floats2bfloat162_rn(v[2], v[3]);
    *reinterpret_cast<uint2 *>(p) = u;
}

/* 8 channels: two 4-channel stores in f32; one 16-byte store in half types (two 8-byte ones
 * left each 32-byte sector of a warp's stores half-filled twice) */
template <typename T> __device__ __forceinline__ void store_vec8(T *p, const float (&v)[8]) {
    const float a[4] = {v[0], v[1], v[2], v[3]}, b[4] = {v[4], v[5], v[6], v[7]};
    store_vec(p, a);
    store_vec(p + 4, b);
}
__device__ __forceinline__ void store_vec8(__half *p, const float (&v)[8]) {
    uint4 u;
    __half2 *h = reinterpret_cast<__half2 *>(&u);
#pragma unroll
    for (int j = 0; j < 4; j++) h[j] = __floats2half2_rn(v[2 * j], v[2 * j + 1]);
    *reinterpret_cast<uint4 *>(p) = u;
}
__device__ __forceinline__ void store_vec8(__nv_bfloat16 *p, const float (&v)[8]) {
    uint4 u;
    __nv_bfloat162 *h = reinterpret_cast<__nv_bfloat162 *>(&u);
#pragma unroll
    for (int j = 0; j < 4; j++) h[j] = __floats2bfloat162_rn(v[2 * j], v[2 * j + 1]);
    *reinterpret_cast<uint4 *>(p) = u;
}

__device__ __forceinline__ unsigned pack2(const __nv_bfloat16 *, float a, float b) {
    const __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
    return *reinterpret_cast<const unsigned *>(&h);
}
__device__ __forceinline__ unsigned pack2(const __half *, float a, float b) {
    const __half2 h = __floats2half2_rn(a, b);
    return *reinterpret_cast<const unsigned *>(&h);
}
__device__ __forceinline__ unsigned pack2(const float *, float, float) { return 0; }

/* sm_90 and newer: N f32 sums of a half type's grad_value, packed in pairs (pack2), added to N
 * consecutive channels by one reduction of M = N / 2 pairs (kernels/backward_common.cuh's
 * red_half): 16 bytes (M = 4) or 8 (M = 2). */
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define MSDA_RED_PAIRS(PAIR)                                                                     \
    do {                                                                                         \
        if constexpr (M == 4)                                                                    \
            asm volatile("red.global.add.noftz.v4." PAIR " [%0], {%1, %2, %3, %4};" ::"l"(p),    \
                         "r"(w[0]), "r"(w[1]), "r"(w[2]), "r"(w[3]) : "memory");                 \
        else                                                                                     \
            asm volatile("red.global.add.noftz.v2." PAIR " [%0], {%1, %2};" ::"l"(p), "r"(w[0]), \
                         "r"(w[1]) : "memory");                                                   \
    } while (0)
template <int M> __device__ __forceinline__ void red_pairs(__nv_bfloat16 *p, const unsigned (&w)[M]) {
    MSDA_RED_PAIRS("bf16x2");
}
template <int M> __device__ __forceinline__ void red_pairs(__half *p, const unsigned (&w)[M]) {
    MSDA_RED_PAIRS("f16x2");
}
#undef MSDA_RED_PAIRS
template <typename T, int M> __device__ __forceinline__ void red_pairs(T *, const unsigned (&)[M]) {
    static_assert(sizeof(T) == 0, "c/dtypes.h: a half type needs its pack2 and red_pairs");
}
#endif
#endif /* __CUDACC__ */

#endif /* MSDA_DTYPES_H */
