/* kernels/geometry.cuh: where a sampling location falls (the math: c/msda.h), once for every
 * kernel, so the forward and the backward see the same corners and weights.
 * locate (generic kernels, 64-bit) and locate32 (fast kernels, sides up to 2^24) place
 * (loc_x, loc_y) on a level: x = loc_x*W - 0.5, the top-left corner of its cell and the in-cell
 * fraction, with loc*W split into its rounded product and the exact rounding error (fma), so the
 * fraction is accurate to an ulp of itself, not of x. A corner outside the level, or whose flat
 * index falls outside [0, S), is skipped: lying shape tables give wrong numbers at worst, never
 * an out-of-bounds access. Also nearest-pixel sampling and the
 * fast kernels' level table in shared memory. */
#pragma once

#include "common.cuh"

// ---------------------------------------------------------------------------------------------
// sampling geometry

__device__ __forceinline__ int64_t load_index(const void *p, int index_dtype, int64_t i) {
    return index_dtype == MSDA_I64 ? ((const int64_t *)p)[i] : (int64_t)((const int32_t *)p)[i];
}

/* The one statement of the bilinear geometry (c/msda.h), in float or double, with int64 or int
 * cell coordinates: places (loc_x, loc_y) on a level of Wf x Hf pixels: x = loc_x*Wf - 0.5
 * (likewise y), the top-left corner (x0, y0) of its cell and the in-cell fraction (fx, fy).
 * Returns false when no corner can be inside the level (NaN and infinite locations included).
 * loc*W is split into its rounded product and the exact rounding error (fma), so the fraction
 * is accurate to about one ulp of itself rather than one ulp of x. */
template <typename Acc, typename Int>
__device__ __forceinline__ bool cell_of(Acc loc_x, Acc loc_y, Acc Wf, Acc Hf, Int &x0, Int &y0,
                                        Acc &fx, Acc &fy) {
    const Acc px = loc_x * Wf, py = loc_y * Hf;
    const Acc ex = fma_acc(loc_x, Wf, -px), ey = fma_acc(loc_y, Hf, -py);
    const Acc x = px - (Acc)0.5, y = py - (Acc)0.5;
    if (!(x > (Acc)-1 && y > (Acc)-1 && x < Wf && y < Hf)) return false;
    const Acc x0f = floor(x), y0f = floor(y);
    x0 = (Int)x0f;
    y0 = (Int)y0f;
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

/* cell_of for the generic kernels' level sizes (false for an absurd level). */
template <typename Acc>
__device__ __forceinline__ bool locate(Acc loc_x, Acc loc_y, int64_t H_l, int64_t W_l,
                                       int64_t &x0, int64_t &y0, Acc &fx, Acc &fy) {
    if (H_l <= 0 || W_l <= 0 || H_l > ((int64_t)1 << 40) || W_l > ((int64_t)1 << 40)) return false;
    return cell_of<Acc, int64_t>(loc_x, loc_y, (Acc)W_l, (Acc)H_l, x0, y0, fx, fy);
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

/* The one statement of nearest-pixel sampling's coordinate (c/msda.h): clamp(floor(loc * size
 * + 0.5), 0, size - 1), clamped as a float first, so a huge coordinate never overflows the
 * integer conversion. */
template <typename Acc> __device__ __forceinline__ Acc nearest_pixel(Acc loc, Acc size) {
    return fmin(fmax(floor(mul_rn(loc, size) + (Acc)0.5), (Acc)0), size - (Acc)1);
}

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
    const Acc xf = nearest_pixel(loc_x, Wf), yf = nearest_pixel(loc_y, Hf);
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
__device__ __forceinline__ bool generic_point(const msda_problem &pr, const PointTensor<T> &loc, int64_t i,
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

/* Level l as the generic kernels walk it: its sides, its start in S and its points
 * [p_begin, p_end) among an item's. */
struct GenericLevel {
    int64_t H, W, start, p_begin, p_end;
};
__device__ __forceinline__ GenericLevel generic_level(const msda_problem &pr, int64_t l) {
    return {load_index(pr.spatial_shapes, pr.index_dtype, 2 * l),
            load_index(pr.spatial_shapes, pr.index_dtype, 2 * l + 1),
            load_index(pr.level_start_index, pr.index_dtype, l), level_point_begin(pr, l),
            level_point_begin(pr, l + 1)};
}

// ---------------------------------------------------------------------------------------------
// the fast kernels' 32-bit form (sides up to 2^24, a level table in shared memory)


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

/* cell_of in 32-bit arithmetic for the fast kernels' level table (sides up to 2^24, exact as
 * floats; load_levels stores a level it rejects as {0, 0, 0}). */
__device__ __forceinline__ bool locate32(float loc_x, float loc_y, int4 lvl, int &x0, int &y0,
                                         float &fx, float &fy) {
    if (lvl.y <= 0) return false;
    return cell_of<float, int>(loc_x, loc_y, (float)lvl.y, (float)lvl.x, x0, y0, fx, fy);
}

/* Level of point `pidx` of an item. OPT (in every fast-path helper): the problem may use
 * options (per-level point counts, MSDA_NEAREST); without it their code is
 * compiled out, which keeps the plain kernels' registers as they were. */
template <bool OPT> __device__ __forceinline__ int level_of(const msda_problem &pr, int pidx) {
    if (!OPT || pr.uniform_points) return pidx / (int)pr.P;
    int l = 0;
    while (pidx >= pr.point_start[l + 1]) l++; /* pidx < point_start[L] = NP */
    return l;
}
