/* kernels/common.cuh: what the MSDA CUDA kernels share: element conversions, the sampling-point
 * geometry (identical in forward and backward, so both see the same corners and weights), the
 * device guard and the one error-check macro of the CUDA side. */
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

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

template <typename T> struct AccOf { typedef float type; };
template <> struct AccOf<double> { typedef double type; };

__device__ __forceinline__ float fma_acc(float a, float b, float c) { return fmaf(a, b, c); }
__device__ __forceinline__ double fma_acc(double a, double b, double c) { return fma(a, b, c); }

// ---------------------------------------------------------------------------------------------
// sampling geometry

__device__ __forceinline__ int64_t load_index(const void *p, int index_dtype, int64_t i) {
    return index_dtype == MSDA_I64 ? ((const int64_t *)p)[i] : (int64_t)((const int32_t *)p)[i];
}

/* One sampling point of one (b, h): element offsets of its 4 corner rows in (B, S, H, C), their
 * bilinear weights (k = 2*dy + dx), the in-cell fraction, and which corners are inside. */
template <typename Acc> struct Point {
    int64_t off[4];
    Acc w[4];
    Acc fx, fy;
    bool inside[4];
};

/* Returns false when no corner can be inside the level (NaN or infinite locations included).
 * loc*W is split into its rounded product and the exact rounding error (fma), so the in-cell
 * fraction is accurate to about one ulp of itself rather than one ulp of x. A corner counts as
 * inside only if it is inside the level and its flat index lies in [0, S): lying shape tables
 * give wrong numbers at worst, never an out-of-bounds access. */
template <typename Acc>
__device__ __forceinline__ bool sample_point(Acc loc_x, Acc loc_y, int64_t H_l, int64_t W_l,
                                             int64_t start, int64_t S, int64_t H, int64_t C,
                                             int64_t b, int64_t h, Point<Acc> &pt) {
    if (H_l <= 0 || W_l <= 0 || H_l > ((int64_t)1 << 40) || W_l > ((int64_t)1 << 40)) return false;
    const Acc Wf = (Acc)W_l, Hf = (Acc)H_l;
    const Acc px = loc_x * Wf, py = loc_y * Hf;
    const Acc ex = fma_acc(loc_x, Wf, -px), ey = fma_acc(loc_y, Hf, -py);
    const Acc x = px - (Acc)0.5, y = py - (Acc)0.5;
    if (!(x > (Acc)-1 && y > (Acc)-1 && x < Wf && y < Hf)) return false;
    const Acc x0f = floor(x), y0f = floor(y);
    const int64_t x0 = (int64_t)x0f, y0 = (int64_t)y0f;
    const Acc fx = (x - x0f) + ex, fy = (y - y0f) + ey;
    pt.fx = fx;
    pt.fy = fy;
    pt.w[0] = ((Acc)1 - fx) * ((Acc)1 - fy);
    pt.w[1] = fx * ((Acc)1 - fy);
    pt.w[2] = ((Acc)1 - fx) * fy;
    pt.w[3] = fx * fy;
    bool any = false;
#pragma unroll
    for (int k = 0; k < 4; k++) {
        const int64_t yy = y0 + (k >> 1), xx = x0 + (k & 1);
        const uint64_t idx = (uint64_t)start + (uint64_t)yy * (uint64_t)W_l + (uint64_t)xx;
        const bool in = yy >= 0 && yy < H_l && xx >= 0 && xx < W_l && idx < (uint64_t)S;
        pt.inside[k] = in;
        pt.off[k] = in ? ((b * S + (int64_t)idx) * H + h) * C : 0;
        any |= in;
    }
    return any;
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

/* Blocks for a grid-stride loop over `items` warps of 32 threads, 256 threads a block. */
static inline unsigned int warp_blocks(int64_t items) {
    const int64_t warps_per_block = 8;
    int64_t blocks = (items + warps_per_block - 1) / warps_per_block;
    if (blocks > 0x7fffffff) blocks = 0x7fffffff;
    return (unsigned int)(blocks < 1 ? 1 : blocks);
}
