/* kernels/common.cuh: what every MSDA CUDA kernel shares (the math: c/msda.h).
 * Each dtype's traits read from its row of c/dtypes.h (AccOf, IsHalf, HasFast; the element
 * conversions and vector loads and stores live beside the row there), point tensors read in
 * their dtype, warp and group sums, and on the host the device guard and the one error-check
 * macro, MSDA_CUDA_CHECK, which records the failing statement, file and line as the library's
 * error. */
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include <type_traits>

#include "../c/msda_internal.h"


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
