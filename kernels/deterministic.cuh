/* kernels/deterministic.cuh: MSDA_DETERMINISTIC's 64-bit fixed point (the rule: c/msda.h).
 * Integer additions do not depend on their order, so grad_value comes out bitwise the same from
 * run to run whatever order the atomics land in; the scale keeps every sum inside an int64. */
#pragma once

#include "common.cuh"

// ---------------------------------------------------------------------------------------------
// deterministic grad_value (MSDA_DETERMINISTIC): 64-bit fixed point
//
// workspace = DetHeader, padded to 256 bytes, then one int64 per grad_value element. A scan
// kernel finds max|grad_output| and max|A|; with N = Q * NP samples at most
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
