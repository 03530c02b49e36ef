/* kernels/common.cuh: what every MSDA CUDA kernel shares (the math: c/msda.h).
 * Element conversions (Acc, the accumulation type: float for f32/f16/bf16, double for f64), warp
 * and group sums, 4- and 8-channel vector loads and stores (16-byte aligned; bf16 widened by a
 * shift or a mask), and on the host the device guard and the one error-check macro,
 * MSDA_CUDA_CHECK, which records the failing statement, file and line as the library's error. */
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include <type_traits>

#include "../c/msda_internal.h"

// ---------------------------------------------------------------------------------------------
// element conversions: Acc is float for f32/f16/bf16, double for f64

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

/* Each CUDA storage type's row of the dtype table (c/dtypes.h): AccOf<T>::type, its accumulation
 * type; IsHalf<T>::value, its half column; HasFast<T>::value, whether the fast kernels serve it
 * (f32 accumulation; the others take the generic kernels); msda_cuda_type_<suffix>, the type
 * itself by its suffix (the instance files compile one row by its suffix: kernels/instances/). */
template <typename T> struct AccOf;
template <typename T> struct IsHalf;
#define MSDA_CUDA_TRAITS(code, suffix, cpu_type, acc_type, cuda_type, half)                      \
    template <> struct AccOf<cuda_type> { typedef acc_type type; };                              \
    template <> struct IsHalf<cuda_type> { static constexpr bool value = half; };                \
    typedef cuda_type MSDA_CAT(msda_cuda_type, suffix);
MSDA_DTYPES(MSDA_CUDA_TRAITS)
#undef MSDA_CUDA_TRAITS
template <typename T> struct HasFast {
    static constexpr bool value = std::is_same<typename AccOf<T>::type, float>::value;
};
/* The dispatch tables below list the rows in order: row i must be dtype code i. */
constexpr int kDtypeCodes[] = {
#define MSDA_CODE_OF(code, ...) code,
    MSDA_DTYPES(MSDA_CODE_OF)
#undef MSDA_CODE_OF
};
constexpr bool dtype_rows_in_code_order(int i = 0) {
    return i == MSDA_DTYPE_COUNT || (kDtypeCodes[i] == i && dtype_rows_in_code_order(i + 1));
}
static_assert(dtype_rows_in_code_order(), "c/dtypes.h: row i of MSDA_DTYPES must be code i");

/* A point tensor (sampling_locations, attention_weights or one of their gradients) of a
 * problem whose value is T, read as Acc and written from Acc. Its elements: P (T, or float
 * with a half T), or with P = void as pr.flags says: T, or float32 with MSDA_POINTS_F32 (half
 * T only; for f32 and f64 the test folds to false at compile time). The aggregated backward,
 * which the runtime test slows, is compiled for each P; elsewhere the test costs nothing
 * measurable (the forward gained with it: its loads are issued earlier). kernels/TUNING.md,
 * "Float32 points with a half value". */
template <typename T, typename P = void> struct PointTensor {
    typedef typename AccOf<T>::type Acc;
    static constexpr bool RUNTIME = std::is_same<P, void>::value;
    char *p;
    bool f32;
    __device__ __forceinline__ PointTensor(const void *ptr, const msda_problem &pr)
        : p((char *)ptr),
          f32(IsHalf<T>::value && (RUNTIME ? (pr.flags & MSDA_POINTS_F32) != 0
                                           : std::is_same<P, float>::value)) {}
    __device__ __forceinline__ explicit operator bool() const { return p != nullptr; }
    __device__ __forceinline__ Acc operator[](int64_t i) const {
        if (IsHalf<T>::value && f32) return (Acc)((const float *)p)[i];
        return to_acc(((const T *)p)[i]);
    }
    __device__ __forceinline__ void set(int64_t i, Acc v) const {
        if (IsHalf<T>::value && f32) ((float *)p)[i] = (float)v;
        else ((T *)p)[i] = from_acc<T>(v);
    }
    /* the tensor from element i on */
    __device__ __forceinline__ PointTensor operator+(int64_t i) const {
        PointTensor t = *this;
        t.p += i * (IsHalf<T>::value && f32 ? 4 : (int64_t)sizeof(T));
        return t;
    }
};

__device__ __forceinline__ float fma_acc(float a, float b, float c) { return fmaf(a, b, c); }
__device__ __forceinline__ double fma_acc(double a, double b, double c) { return fma(a, b, c); }

template <typename Acc> __device__ __forceinline__ Acc warp_sum(Acc v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

/* Sum over the G lanes of a group (aligned at multiples of G inside the warp). */
template <int G> __device__ __forceinline__ float group_sum(float v) {
#pragma unroll
    for (int o = G / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// ---------------------------------------------------------------------------------------------
// 4 and 8 channels at once (16-byte aligned vectors)

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

// ---------------------------------------------------------------------------------------------
// host side: errors and the device guard

/* Records a CUDA failure with the failing statement, file and line; returns MSDA_ERR_CUDA. */
static inline int cuda_error(const char *fn, cudaError_t e, const char *stmt, const char *file,
                             int line) {
    return msda_set_error(MSDA_ERR_CUDA, "%s: %s failed: %s (%s) at %s:%d", fn, stmt,
                          cudaGetErrorName(e), cudaGetErrorString(e), file, line);
}

#define MSDA_CUDA_CHECK(fn, stmt)                                                                \
    do {                                                                                         \
        cudaError_t e_ = (stmt);                                                                 \
        if (e_ != cudaSuccess) return cuda_error(fn, e_, #stmt, __FILE__, __LINE__);            \
    } while (0)

/* Makes `device` current for the launch and gives the caller's device back on scope exit. */
struct DeviceGuard {
    int prev = -1;
    ~DeviceGuard() {
        if (prev >= 0) cudaSetDevice(prev);
    }
    cudaError_t select(int device) {
        cudaError_t e = cudaGetDevice(&prev);
        if (e != cudaSuccess) {
            prev = -1;
            return e;
        }
        if (prev == device) {
            prev = -1; /* nothing to restore */
            return cudaSuccess;
        }
        return cudaSetDevice(device);
    }
};

/* A launcher of one dtype's kernels on a stream. */
typedef cudaError_t (*msda_launcher)(const msda_problem *pr, cudaStream_t stream);

/* The frame of a CUDA entry point: `device` made current, an error an earlier call of this
 * thread left behind cleared, the launcher of pr->dtype run on pr->stream (by_dtype indexed by
 * msda_dtype: {MSDA_DTYPES(entry)}), and the launch checked. */
static inline int run_launcher(const char *fn, const msda_problem *pr,
                               const msda_launcher (&by_dtype)[MSDA_DTYPE_COUNT]) {
    DeviceGuard guard;
    MSDA_CUDA_CHECK(fn, guard.select(pr->device));
    cudaGetLastError();
    if (pr->dtype < 0 || pr->dtype >= MSDA_DTYPE_COUNT)
        return msda_set_error(MSDA_ERR_INTERNAL, "%s: dtype %d", fn, pr->dtype);
    MSDA_CUDA_CHECK(fn, by_dtype[pr->dtype](pr, (cudaStream_t)pr->stream));
    MSDA_CUDA_CHECK(fn, cudaGetLastError());
    return MSDA_OK;
}

static inline bool aligned16(const void *p) { return ((uintptr_t)p & 15) == 0; }

/* launch(std::integral_constant<int, G>()) for a runtime group size G (the fast kernels' threads
 * an item: 1, 2, 4, ..., 32), the one place where G becomes a template argument; any other G is
 * cudaErrorNotSupported. */
template <typename Launch> static cudaError_t with_group(int G, Launch &&launch) {
    switch (G) {
    case 1: return launch(std::integral_constant<int, 1>());
    case 2: return launch(std::integral_constant<int, 2>());
    case 4: return launch(std::integral_constant<int, 4>());
    case 8: return launch(std::integral_constant<int, 8>());
    case 16: return launch(std::integral_constant<int, 16>());
    case 32: return launch(std::integral_constant<int, 32>());
    default: return cudaErrorNotSupported;
    }
}
