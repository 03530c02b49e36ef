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

/* Places (loc_x, loc_y) on a level of H_l x W_l pixels: x = loc_x*W_l - 0.5 (likewise y), the
 * top-left corner (x0, y0) of its cell and the in-cell fraction (fx, fy). Returns false when no
 * corner can be inside the level (NaN and infinite locations included) or the level is absurd.
 * loc*W is split into its rounded product and the exact rounding error (fma), so the fraction
 * is accurate to about one ulp of itself rather than one ulp of x. */
template <typename Acc>
__device__ __forceinline__ bool locate(Acc loc_x, Acc loc_y, int64_t H_l, int64_t W_l,
                                       int64_t &x0, int64_t &y0, Acc &fx, Acc &fy) {
    if (H_l <= 0 || W_l <= 0 || H_l > ((int64_t)1 << 40) || W_l > ((int64_t)1 << 40)) return false;
    const Acc Wf = (Acc)W_l, Hf = (Acc)H_l;
    const Acc px = loc_x * Wf, py = loc_y * Hf;
    const Acc ex = fma_acc(loc_x, Wf, -px), ey = fma_acc(loc_y, Hf, -py);
    const Acc x = px - (Acc)0.5, y = py - (Acc)0.5;
    if (!(x > (Acc)-1 && y > (Acc)-1 && x < Wf && y < Hf)) return false;
    const Acc x0f = floor(x), y0f = floor(y);
    x0 = (int64_t)x0f;
    y0 = (int64_t)y0f;
    fx = (x - x0f) + ex;
    fy = (y - y0f) + ey;
    /* x rounded onto or across an integer that the exact x = x + ex does not reach: take the
     * cell of the exact x, or the location gradient would use the neighbouring cell's slope. */
    if (fx < (Acc)0) x0 -= 1, fx += (Acc)1;
    else if (fx >= (Acc)1) x0 += 1, fx -= (Acc)1;
    if (fy < (Acc)0) y0 -= 1, fy += (Acc)1;
    else if (fy >= (Acc)1) y0 += 1, fy -= (Acc)1;
    return true;
}

/* Flat position in [0, S) of pixel (yy, xx) of the level starting at `start`, or -1 when the
 * pixel is outside the level or the position outside [0, S): lying shape tables give wrong
 * numbers at worst, never an out-of-bounds access (unsigned arithmetic wraps, never overflows). */
__device__ __forceinline__ int64_t pixel_index(int64_t yy, int64_t xx, int64_t H_l, int64_t W_l,
                                               int64_t start, int64_t S) {
    const uint64_t idx = (uint64_t)start + (uint64_t)yy * (uint64_t)W_l + (uint64_t)xx;
    const bool in = yy >= 0 && yy < H_l && xx >= 0 && xx < W_l && idx < (uint64_t)S;
    return in ? (int64_t)idx : -1;
}

/* One sampling point of one (b, h) for the generic kernels: element offsets of its 4 corner rows
 * in (B, S, H, C), their bilinear weights (k = 2*dy + dx), the in-cell fraction, and which
 * corners are inside. */
template <typename Acc> struct Point {
    int64_t off[4];
    Acc w[4];
    Acc fx, fy;
    bool inside[4];
};

template <typename Acc>
__device__ __forceinline__ bool sample_point(Acc loc_x, Acc loc_y, int64_t H_l, int64_t W_l,
                                             int64_t start, int64_t S, int64_t H, int64_t C,
                                             int64_t b, int64_t h, Point<Acc> &pt) {
    int64_t x0, y0;
    Acc fx, fy;
    if (!locate(loc_x, loc_y, H_l, W_l, x0, y0, fx, fy)) return false;
    pt.fx = fx;
    pt.fy = fy;
    pt.w[0] = ((Acc)1 - fx) * ((Acc)1 - fy);
    pt.w[1] = fx * ((Acc)1 - fy);
    pt.w[2] = ((Acc)1 - fx) * fy;
    pt.w[3] = fx * fy;
    bool any = false;
#pragma unroll
    for (int k = 0; k < 4; k++) {
        const int64_t idx = pixel_index(y0 + (k >> 1), x0 + (k & 1), H_l, W_l, start, S);
        pt.inside[k] = idx >= 0;
        pt.off[k] = idx >= 0 ? ((b * S + idx) * H + h) * C : 0;
        any |= idx >= 0;
    }
    return any;
}

/* A product rounded on its own, never fused into a following addition (as the CPU and torch
 * compute loc * W + 0.5). */
__device__ __forceinline__ float mul_rn(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ double mul_rn(double a, double b) { return __dmul_rn(a, b); }

/* nearest-pixel sampling (MSDA_NEAREST): the single pixel (clamp(floor(x*W + 0.5), 0, W-1),
 * clamp(floor(y*H + 0.5), 0, H-1)) as a Point whose corner 0 carries weight 1 (fx = fy = 0).
 * False for a non-finite location or a pixel outside [0, S). */
template <typename Acc>
__device__ __forceinline__ bool nearest_point(Acc loc_x, Acc loc_y, int64_t H_l, int64_t W_l,
                                              int64_t start, int64_t S, int64_t H, int64_t C,
                                              int64_t b, int64_t h, Point<Acc> &pt) {
    if (H_l <= 0 || W_l <= 0 || H_l > ((int64_t)1 << 40) || W_l > ((int64_t)1 << 40)) return false;
    if (!(isfinite(loc_x) && isfinite(loc_y))) return false;
    const Acc Wf = (Acc)W_l, Hf = (Acc)H_l;
    /* clamped as floats first, so a huge coordinate never overflows the integer conversion */
    const Acc xf = fmin(fmax(floor(mul_rn(loc_x, Wf) + (Acc)0.5), (Acc)0), Wf - (Acc)1);
    const Acc yf = fmin(fmax(floor(mul_rn(loc_y, Hf) + (Acc)0.5), (Acc)0), Hf - (Acc)1);
    const int64_t idx = pixel_index((int64_t)yf, (int64_t)xf, H_l, W_l, start, S);
    if (idx < 0) return false;
    pt.fx = pt.fy = (Acc)0;
#pragma unroll
    for (int k = 0; k < 4; k++) pt.w[k] = (Acc)(k == 0), pt.inside[k] = k == 0, pt.off[k] = 0;
    pt.off[0] = ((b * S + idx) * H + h) * C;
    return true;
}

/* The point of sampling_locations index i (of level l) for the generic kernels, bilinear or
 * nearest as pr.flags says. */
template <typename Acc, typename T>
__device__ __forceinline__ bool generic_point(const msda_problem &pr, const T *loc, int64_t i,
                                              int64_t H_l, int64_t W_l, int64_t start, int64_t b,
                                              int64_t h, Point<Acc> &pt) {
    const Acc x = to_acc(loc[2 * i]), y = to_acc(loc[2 * i + 1]);
    if (pr.flags & MSDA_NEAREST) return nearest_point<Acc>(x, y, H_l, W_l, start, pr.S, pr.H, pr.C, b, h, pt);
    return sample_point<Acc>(x, y, H_l, W_l, start, pr.S, pr.H, pr.C, b, h, pt);
}

/* First point of level l (l = L gives the total) in the (b, q, h) item's points. */
__device__ __forceinline__ int64_t level_point_begin(const msda_problem &pr, int64_t l) {
    return pr.uniform_points ? l * pr.P : (int64_t)pr.point_start[l];
}

template <typename Acc> __device__ __forceinline__ Acc warp_max(Acc v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmax(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}
template <typename Acc> __device__ __forceinline__ Acc warp_sum(Acc v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

/* MSDA_SOFTMAX, generic kernels: the whole warp computes the maximum and 1 / sum(exp(z - max))
 * of the n logits z of one item (lane-strided, then shuffles: every lane gets the same result
 * in the same order). */
template <typename Acc, typename T>
__device__ __forceinline__ void softmax_stats(const T *z, int64_t n, int lane, Acc &mx, Acc &inv) {
    Acc m = -INFINITY;
    for (int64_t j = lane; j < n; j += 32) m = fmax(m, to_acc(z[j]));
    m = warp_max(m);
    Acc s = 0;
    for (int64_t j = lane; j < n; j += 32) s += exp(to_acc(z[j]) - m);
    s = warp_sum(s);
    mx = m;
    inv = (Acc)1 / s;
}

/* The attention weight of a point: the given weight, or its softmax probability. */
template <typename Acc>
__device__ __forceinline__ Acc attention(const msda_problem &pr, Acc z, Acc mx, Acc inv) {
    return (pr.flags & MSDA_SOFTMAX) ? exp(z - mx) * inv : z;
}

// ---------------------------------------------------------------------------------------------
// deterministic grad_value (MSDA_DETERMINISTIC): 64-bit fixed point
//
// workspace = DetHeader, padded to 256 bytes, then one int64 per grad_value element. A scan
// kernel finds max|grad_output| and max|A| (1 with softmax); with N = Q * NP samples at most
// touching one pixel (each once, with a bilinear weight <= 1), every pixel's sum is bounded by
// bound = N * max|A| * max|g|, so contributions scaled by 2^(62 - e), bound < 2^e, and rounded
// to integers never overflow an int64. Integer addition is associative: the atomics' order no
// longer matters. A convert kernel writes grad_value = acc / scale. A non-finite maximum makes
// grad_value NaN everywhere.

struct DetHeader {
    unsigned long long max_g; /* bits of the largest |grad_output| as a double (>= 0) */
    unsigned long long max_a; /* same for |attention weight| */
};
#define MSDA_DET_HEADER_BYTES 256

__device__ __forceinline__ double det_scale(const msda_problem &pr, const DetHeader *hd) {
    const double bound = __longlong_as_double((long long)hd->max_g) *
                         __longlong_as_double((long long)hd->max_a) * (double)pr.Q *
                         (double)pr.NP;
    if (!(bound > 0.0) || !isfinite(bound)) return isfinite(bound) ? 1.0 : 0.0; /* 0: NaN out */
    int e;
    frexp(bound, &e); /* bound < 2^e */
    /* f32 accumulation scales in float: at most 2^100, so the scale is a float too (sums of
     * contributions below 2^-101 are lost, far below f32 resolution of anything larger) */
    return ldexp(1.0, pr.dtype == MSDA_F64 || 62 - e <= 100 ? 62 - e : 100);
}

/* contrib * scale is exact (scale is a power of two), so rounding it is the only error. */
__device__ __forceinline__ void det_add(long long *acc, float contrib, float scale) {
    const long long v = llrintf(contrib * scale);
    if (v != 0) atomicAdd((unsigned long long *)acc, (unsigned long long)v);
}
__device__ __forceinline__ void det_add(long long *acc, double contrib, double scale) {
    const long long v = llrint(contrib * scale);
    if (v != 0) atomicAdd((unsigned long long *)acc, (unsigned long long)v);
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

// ---------------------------------------------------------------------------------------------
// fast path: 16-byte channel vectors and sampling geometry staged in shared memory
//
// A group of G = C / 4 threads owns one (b, q, h) item, each thread 4 channels (one 16-byte load
// per corner in f32, 8 bytes in f16/bf16; one 16-byte f32 atomic per corner in the backward). A block of 256 threads holds 256 / G items. The geometry of the
// items' sampling points is computed once per point (not once per thread, as in the generic
// kernels) by the whole block, K points per item at a time, and kept in shared memory:
//   offs: for each corner, the element offset of its channel 0 for this head, or -1 if outside;
//   geo:  the 4 corner weights times A (forward), or {A, fx, fy, 0} (backward).
// Conditions: T is float, __half or __nv_bfloat16; C = 4*G with G a power of two <= 32;
// B*S*H*C < 2^31, B*Q*H <= 2^31 - 1024 (c/routes.c, msda_fast_group); value (and grad_value,
// output) 16-byte aligned. Otherwise the generic kernels run.

/* f64 always takes the generic kernels (no fast-path instantiation for it). */
template <typename T> struct HasFast { static constexpr bool value = true; };
template <> struct HasFast<double> { static constexpr bool value = false; };

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
 * left each 32-byte sector of a warp's stores half-filled twice, msda_forward.cu v13) */
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

/* Points per item staged at once: 16, fewer for small groups so shared memory stays small. */
template <int G, int NT_ = 256> struct Stage {
    static constexpr int NT = NT_;                                       /* threads a block */
    static constexpr int IPB = NT / G;                                   /* items per block */
    static constexpr int K = (512 / IPB) > 16 ? 16 : ((512 / IPB) < 2 ? 2 : 512 / IPB);
    static constexpr int STRIDE = K + 1; /* padded so groups in a warp hit different banks */
};

/* The fast kernels' level table, read into shared memory once per block as {H_l, W_l, start}.
 * A level whose sizes or start cannot belong to value (a side outside [1, 2^24], a start outside
 * [0, S)) is stored as {0, 0, 0} and rejected by locate32. The caller synchronises. */
__device__ __forceinline__ void load_levels(const msda_problem &pr, int4 *s_lvl) {
    for (int l = threadIdx.x; l < pr.L; l += blockDim.x) {
        const int64_t h = load_index(pr.spatial_shapes, pr.index_dtype, 2 * l);
        const int64_t w = load_index(pr.spatial_shapes, pr.index_dtype, 2 * l + 1);
        const int64_t start = load_index(pr.level_start_index, pr.index_dtype, l);
        const bool ok = h >= 1 && w >= 1 && h <= (1 << 24) && w <= (1 << 24) && start >= 0 &&
                        start < pr.S;
        s_lvl[l] = ok ? make_int4((int)h, (int)w, (int)start, 0) : make_int4(0, 0, 0, 0);
    }
}

/* locate() in 32-bit arithmetic, for sides up to 2^24 (exact as floats). */
__device__ __forceinline__ bool locate32(float loc_x, float loc_y, int4 lvl, int &x0, int &y0,
                                         float &fx, float &fy) {
    if (lvl.y <= 0) return false;
    const float Wf = (float)lvl.y, Hf = (float)lvl.x;
    const float px = loc_x * Wf, py = loc_y * Hf;
    const float ex = fmaf(loc_x, Wf, -px), ey = fmaf(loc_y, Hf, -py);
    const float x = px - 0.5f, y = py - 0.5f;
    if (!(x > -1.f && y > -1.f && x < Wf && y < Hf)) return false;
    const float x0f = floorf(x), y0f = floorf(y);
    x0 = (int)x0f;
    y0 = (int)y0f;
    fx = (x - x0f) + ex;
    fy = (y - y0f) + ey;
    if (fx < 0.f) x0 -= 1, fx += 1.f; /* the cell of the exact x: see locate() */
    else if (fx >= 1.f) x0 += 1, fx -= 1.f;
    if (fy < 0.f) y0 -= 1, fy += 1.f;
    else if (fy >= 1.f) y0 += 1, fy -= 1.f;
    return true;
}

/* Level of point `pidx` of an item. OPT (in every fast-path helper): the problem may use
 * options (per-level point counts, MSDA_NEAREST, MSDA_SOFTMAX); without it their code is
 * compiled out, which keeps the plain kernels' registers as they were. */
template <bool OPT> __device__ __forceinline__ int level_of(const msda_problem &pr, int pidx) {
    if (!OPT || pr.uniform_points) return pidx / (int)pr.P;
    int l = 0;
    while (pidx >= pr.point_start[l + 1]) l++; /* pidx < point_start[L] = NP */
    return l;
}

/* Item order of the fast kernels: head-major, item = (b*H + h)*Q + r, so a block's items are
 * queries of one head that sample overlapping pixels of that head's value rows (the aggregated
 * backward depends on it; the forward gains L1 hits). The query of rank r is r itself, or, in
 * the backward of an encoder (encoder_tiles), the r-th pixel in tile order, so that a block's
 * items are a tile of pixels (8 x 8 for the aggregated backward's 64) instead of a run of one
 * pixel row: on realistic ddetr_enc inputs 32 items' corners then fall on 0.18 distinct value
 * rows per corner instead of 0.28 (64 items: 0.14), and the aggregated backward loads and
 * updates that many fewer rows (msda_backward.cu v27, v28; the forward lost with it,
 * msda_forward.cu v15). item_row gives the item's row (b*Q + q)*H + h in
 * grad_output / sampling_locations / attention_weights / output, item_head_off the element
 * offset of (b, s = 0, h, c = 0) in value. */

/* Whether the queries are the value's pixels level by level (Q == S and the levels, in order,
 * cover [0, S) exactly, as in an encoder): then a block can take a tile of neighbouring pixels
 * instead of a run of one pixel row. Every block computes the same answer from the same level
 * table, so all agree on the order. */
__device__ __forceinline__ bool encoder_tiles(const msda_problem &pr, const int4 *s_lvl) {
    if (pr.Q != pr.S) return false;
    int64_t next = 0;
    for (int l = 0; l < (int)pr.L; l++) {
        if (s_lvl[l].y <= 0 || s_lvl[l].z != next) return false;
        next += (int64_t)s_lvl[l].x * s_lvl[l].y;
    }
    return next == pr.S;
}

/* The query of rank r in tile order (encoder_tiles true): within each level, tiles of TW x TH
 * pixels (TW * TH = IPB, a block's items; TH = TW or 2 * TW: 4 wide and 8 tall for 32 items)
 * row by row, each tile row-major; the pixels outside whole tiles (a right strip, then a bottom
 * strip) follow row-major. A bijection of each level's ranks onto its pixels. */
template <int IPB> struct Tile {
    static constexpr int LOG = IPB >= 256 ? 8 : IPB >= 128 ? 7 : IPB >= 64 ? 6 : IPB >= 32 ? 5 :
                               IPB >= 16 ? 4 : IPB >= 8 ? 3 : IPB >= 4 ? 2 : IPB >= 2 ? 1 : 0;
    static constexpr int TH = 1 << ((LOG + 1) / 2), TW = IPB / TH;
    static_assert((1 << LOG) == IPB, "IPB is a power of two");
};
template <int IPB> __device__ __forceinline__ int tiled_query(const int4 *s_lvl, int L, int r) {
    constexpr int TW = Tile<IPB>::TW, TH = Tile<IPB>::TH;
    int l = 0;
    for (int j = 1; j < L; j++) l = s_lvl[j].z <= r ? j : l; /* starts increase */
    const int4 lv = s_lvl[l];
    const int W = lv.y, Hl = lv.x, k = r - lv.z;
    const int Wm = W & ~(TW - 1), Hm = Hl & ~(TH - 1), n_tiled = Wm * Hm, strip = Hm * (W - Wm);
    int x, y;
    if (k < n_tiled) {
        const int t = k / IPB, u = k % IPB, ntx = Wm / TW, ty = t / ntx;
        y = ty * TH + u / TW;
        x = (t - ty * ntx) * TW + u % TW;
    } else if (k < n_tiled + strip) {
        const int k2 = k - n_tiled, w = W - Wm, yy = k2 / w;
        y = yy;
        x = Wm + k2 - yy * w;
    } else {
        const int k3 = k - n_tiled - strip, yy = k3 / W;
        y = Hm + yy;
        x = k3 - yy * W;
    }
    return lv.z + y * W + x;
}

/* TILE: 0 for queries in rank order, else the block size of tiled_query. */
template <int TILE>
__device__ __forceinline__ int item_row(const msda_problem &pr, const int4 *s_lvl, int item,
                                        bool tiled) {
    const int Q = (int)pr.Q, H = (int)pr.H, hq = H * Q;
    const int b = item / hq, r = item - b * hq, h = r / Q;
    int q = r - h * Q;
    if (TILE && tiled) q = tiled_query<TILE ? TILE : 1>(s_lvl, (int)pr.L, q);
    return (b * Q + q) * H + h;
}
__device__ __forceinline__ int item_head_off(const msda_problem &pr, int item) {
    const int Q = (int)pr.Q, H = (int)pr.H, S = (int)pr.S, C = (int)pr.C, hq = H * Q;
    const int b = item / hq, h = (item - b * hq) / Q;
    return b * S * H * C + h * C;
}

/* {row, head_off} of the block's items [base, base + ipb) into s_item, computed once per item
 * (the staging needs them for every point; integer divisions are not cheap). TILE: 0, or ipb to
 * take an encoder's queries in tile order (encoder_tiles). s_lvl must be loaded and
 * synchronised before; the caller synchronises before reading s_item. */
template <typename T, bool PREFETCH, int TILE>
__device__ __forceinline__ void fill_items(const msda_problem &pr, const int4 *s_lvl, int base,
                                           int n_items, int ipb, int2 *s_item) {
    if (threadIdx.x >= ipb) return;
    const bool tiled = TILE && encoder_tiles(pr, s_lvl);
    for (int il = threadIdx.x; il < ipb; il += blockDim.x) {
        const int item = base + il < n_items ? base + il : n_items - 1;
        const int row = item_row<TILE>(pr, s_lvl, item, tiled);
        s_item[il] = make_int2(row, item_head_off(pr, item));
        if (PREFETCH) {
            /* the sampling locations and weights of the item a wave of resident blocks (5 a
             * multiprocessor) later, fetched into L2 for that block's staging: read once,
             * they come from DRAM (for the 128-thread half-type forward, 10 blocks of half the
             * items, the distance is half a wave; those kernels gained nothing from it, v12) */
            unsigned n_sm; /* volatile: read here, not held in a register across the loop */
            asm volatile("mov.u32 %0, %%nsmid;" : "=r"(n_sm));
            /* unsigned: item < 2^31 and the distance < 2^31, so the sum cannot wrap */
            const unsigned later = (unsigned)item + n_sm * 5u * (unsigned)ipb;
            if (later < (unsigned)n_items) {
                const int64_t r = item_row<TILE>(pr, s_lvl, (int)later, tiled);
                asm volatile("prefetch.global.L2 [%0];" ::"l"((const T *)pr.sampling_locations + r * pr.NP * 2));
                asm volatile("prefetch.global.L2 [%0];" ::"l"((const T *)pr.attention_weights + r * pr.NP));
            }
        }
    }
}

/* MSDA_SOFTMAX, fast kernels: each group of G lanes computes {max, 1 / sum(exp(z - max))} of
 * its item's logits into s_soft[local] (lane-strided, then group shuffles: a fixed order);
 * items past the end get {0, 1}. The caller synchronises. */
template <typename T, int G, bool OPT>
__device__ __forceinline__ void group_softmax_stats(const msda_problem &pr, int item, int row,
                                                    int n_items, float2 *s_soft,
                                                    int local = threadIdx.x / G) {
    const int g = threadIdx.x % G;
    if (!OPT) return; /* s_soft is not read (nor sized for the items) */
    if (!(pr.flags & MSDA_SOFTMAX)) { /* uniform over the grid: no shuffle is skipped */
        if (g == 0) s_soft[local] = make_float2(0.f, 1.f);
        return;
    }
    const int NP = item < n_items ? (int)pr.NP : 0; /* every lane still joins the shuffles */
    const T *z = (const T *)pr.attention_weights + (int64_t)row * (int)pr.NP;
    float m = -INFINITY, sum = 0.f;
    for (int j = g; j < NP; j += G) m = fmaxf(m, to_acc(z[j]));
#pragma unroll
    for (int o = G / 2; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    for (int j = g; j < NP; j += G) sum += expf(to_acc(z[j]) - m);
#pragma unroll
    for (int o = G / 2; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    if (g == 0) s_soft[local] = NP ? make_float2(m, 1.f / sum) : make_float2(0.f, 1.f);
}

/* Geometry of sampling point `pidx` (0 <= pidx < L*P) of item (b, q, h) = `item`:
 *   offs: element offset in value of each corner's channel 0 for this head, or -1 if outside;
 *   geo:  WEIGHTS ? the corner weights times the attention weight : {A, fx, fy, 0}.
 * Offsets are int32: the fast path needs B*S*H*C < 2^31. Unsigned arithmetic wraps instead of
 * overflowing on lying shape tables; the final idx < S test keeps every read inside value. */
template <typename T, bool WEIGHTS, bool OPT>
__device__ __forceinline__ void stage_point(const msda_problem &pr, const int4 *s_lvl, int2 it,
                                            int pidx, float2 soft, int4 &offs, float4 &geo) {
    const T *loc = (const T *)pr.sampling_locations;
    const T *attn = (const T *)pr.attention_weights;
    const int64_t i = (int64_t)it.x * (int)pr.NP + pidx;
    const int4 lvl = s_lvl[level_of<OPT>(pr, pidx)];
    const int flags = OPT ? pr.flags : 0;
    float a = to_acc(attn[i]);
    if (flags & MSDA_SOFTMAX) a = expf(a - soft.x) * soft.y;
    offs = make_int4(-1, -1, -1, -1);
    geo = make_float4(WEIGHTS ? 0.f : a, 0.f, 0.f, 0.f);
    const int HC = (int)(pr.H * pr.C), S = (int)pr.S;
    const float lx = to_acc(loc[2 * i]), ly = to_acc(loc[2 * i + 1]);
    if (flags & MSDA_NEAREST) { /* nearest_point() in 32-bit: one corner of weight 1 */
        if (lvl.y <= 0 || !(isfinite(lx) && isfinite(ly))) return;
        const float Wf = (float)lvl.y, Hf = (float)lvl.x;
        const int xx = (int)fminf(fmaxf(floorf(__fmul_rn(lx, Wf) + 0.5f), 0.f), Wf - 1.f);
        const int yy = (int)fminf(fmaxf(floorf(__fmul_rn(ly, Hf) + 0.5f), 0.f), Hf - 1.f);
        const unsigned idx = (unsigned)lvl.z + (unsigned)yy * (unsigned)lvl.y + (unsigned)xx;
        if (idx >= (unsigned)S) return;
        offs.x = it.y + (int)idx * HC;
        geo = make_float4(a, 0.f, 0.f, 0.f); /* weights {A, 0, 0, 0} = {A, fx = 0, fy = 0, 0} */
        return;
    }
    int x0, y0;
    float fx, fy;
    if (!locate32(lx, ly, lvl, x0, y0, fx, fy)) return;
    const int head_off = it.y;
    /* WEIGHTS (forward): slot k holds the corner whose pixel has parities (k & 1, k >> 1), so
     * the groups of a warp, gathering slot k of neighbouring queries, all ask for the pixels
     * they share in the same load (one line lookup for them): see msda_forward.cu v11. */
    const int m = WEIGHTS ? ((x0 & 1) | (y0 & 1) << 1) : 0;
    int o[4];
#pragma unroll
    for (int k = 0; k < 4; k++) {
        const int yy = y0 + ((k ^ m) >> 1), xx = x0 + ((k ^ m) & 1);
        const unsigned idx = (unsigned)lvl.z + (unsigned)yy * (unsigned)lvl.y + (unsigned)xx;
        const bool in = (unsigned)yy < (unsigned)lvl.x && (unsigned)xx < (unsigned)lvl.y &&
                        idx < (unsigned)S;
        o[k] = in ? head_off + (int)idx * HC : -1;
    }
    offs = make_int4(o[0], o[1], o[2], o[3]);
    if (WEIGHTS) {
        const float wx0 = m & 1 ? fx : 1.f - fx, wx1 = m & 1 ? 1.f - fx : fx;
        const float wy0 = m & 2 ? fy : 1.f - fy, wy1 = m & 2 ? 1.f - fy : fy;
        geo = make_float4(a * wx0 * wy0, a * wx1 * wy0, a * wx0 * wy1, a * wx1 * wy1);
    }
    else
        geo = make_float4(a, fx, fy, 0.f);
}

/* Stages points [p0, p0 + kn) of the block's items [base, base + IPB) (s_item: fill_items) in
 * shared memory, one thread per point (stage_point); slots past the last item or point get
 * offsets -1. The caller synchronises before reading them. */
template <typename T, bool WEIGHTS, bool OPT, typename St>
__device__ __forceinline__ void stage_chunk(const msda_problem &pr, const int4 *s_lvl,
                                            const int2 *s_item, int base, int n_items, int p0,
                                            int kn, const float2 *s_soft, int4 *s_offs,
                                            float4 *s_geo) {
    for (int j = threadIdx.x; j < St::IPB * St::K; j += St::NT) {
        const int il = j / St::K, k = j % St::K;
        int4 offs = make_int4(-1, -1, -1, -1);
        float4 geo = make_float4(0.f, 0.f, 0.f, 0.f);
        /* s_soft is read only with softmax, the one case in which the caller synchronises
         * after group_softmax_stats (its value is unused otherwise, and reading it then would
         * race with the write of another group) */
        const bool soft = OPT && (pr.flags & MSDA_SOFTMAX);
        if (base + il < n_items && k < kn)
            stage_point<T, WEIGHTS, OPT>(pr, s_lvl, s_item[il], p0 + k,
                                         soft ? s_soft[il] : make_float2(0.f, 1.f), offs, geo);
        s_offs[il * St::STRIDE + k] = offs;
        s_geo[il * St::STRIDE + k] = geo;
    }
}

/* G = C / 4 when the fast kernels can serve this problem (msda_fast_group) and the tensors in
 * ptrs are 16-byte aligned, else 0. */
static inline int fast_group(const msda_problem *pr, const void *const *ptrs, int n_ptrs) {
    for (int j = 0; j < n_ptrs; j++)
        if (ptrs[j] && ((uintptr_t)ptrs[j] & 15) != 0) return 0;
    return msda_fast_group(pr);
}

/* Blocks for a fast kernel of ipb items a block (256 / G with G threads per item; twice that in
 * the aggregated backward): one block per ipb consecutive items, so the blocks resident at any
 * moment cover a compact window of neighbouring queries (good L2 reuse); grid-stride beyond
 * 2^31 - 1 blocks. A persistent grid whose blocks each walk a contiguous run of items was
 * slower (ddetr_enc f32 forward 0.41 vs 0.30 ms on an H100): its resident blocks spread over
 * the whole value tensor at once. */
static inline unsigned int item_blocks(int64_t items, int64_t ipb) {
    int64_t blocks = (items + ipb - 1) / ipb;
    if (blocks > 0x7fffffff) blocks = 0x7fffffff;
    return (unsigned int)(blocks < 1 ? 1 : blocks);
}
