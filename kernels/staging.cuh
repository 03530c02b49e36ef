/* kernels/staging.cuh: the fast kernels' staging (forward and backward).
 * Thread map: a group of G = C / 4 threads owns one (b, q, h) item, 4 channels a thread; a block
 * holds 256 / G items, taken head-major (a block's items are queries of one head, which sample
 * overlapping pixels), an encoder's as tiles of neighbouring pixels. The geometry of K points
 * per item is computed once per point by the whole block and kept in shared memory (corner
 * offsets, or -1 outside; weights), then read by every thread of the item's group.
 * Item indices and offsets are int32: the fast path needs B*S*H*C < 2^31 (c/routes.c chooses
 * where it serves: msda_fast_group). */
#pragma once

#include "geometry.cuh"

// ---------------------------------------------------------------------------------------------
// fast path: 16-byte channel vectors and sampling geometry staged in shared memory
//
// A group of G = C / 4 threads owns one (b, q, h) item, each thread 4 channels (one 16-byte load
// per corner in f32, 8 bytes in f16/bf16; one 16-byte f32 atomic per corner in the backward). A
// block of 256 threads holds 256 / G items. The geometry of the items' sampling points is
// computed once per point (not once per thread, as in the generic kernels) by the whole block,
// K points per item at a time, and kept in shared memory:
//   offs: for each corner, the element offset of its channel 0 for this head, or -1 if outside;
//   geo:  the 4 corner weights times A (forward), or {A, fx, fy, 0} (backward).
// Conditions: T is float, __half or __nv_bfloat16; C = 4*G with G a power of two <= 32;
// B*S*H*C < 2^31, B*Q*H <= 2^31 - 1024 (c/routes.c, msda_fast_group); value (and grad_value,
// output) 16-byte aligned. Otherwise the generic kernels run.


/* Points per item staged at once: 16, fewer for small groups so shared memory stays small. */
template <int G, int NT_ = MSDA_BLOCK_THREADS> struct Stage {
    static constexpr int NT = NT_;                              /* threads a block */
    static constexpr int IPB = MSDA_STAGED_BLOCK_ITEMS(NT, G); /* items per block */
    static constexpr int K = (512 / IPB) > 16 ? 16 : ((512 / IPB) < 2 ? 2 : 512 / IPB);
    static constexpr int STRIDE = K + 1; /* padded so groups in a warp hit different banks */
};

/* Item order of the fast kernels: head-major, item = (b*H + h)*Q + r, so a block's items are
 * queries of one head that sample overlapping pixels of that head's value rows (the aggregated
 * backward depends on it; the forward gains L1 hits). The query of rank r is r itself, or, in
 * the backward of an encoder (encoder_tiles), the r-th pixel in tile order, so that a block's
 * items are a tile of pixels (8 x 8 for the aggregated backward's 64) instead of a run of one
 * pixel row: the block's corners fall on fewer distinct value rows, which the aggregated
 * backward loads and updates once each (kernels/TUNING.md, aggregated v27 and v28; the forward
 * lost with it, forward v15). item_row gives the item's row (b*Q + q)*H + h in grad_output /
 * sampling_locations / attention_weights / output, item_head_off the element offset of
 * (b, s = 0, h, c = 0) in value. */

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
             * items, the distance is half a wave; kernels/TUNING.md, forward v12) */
            unsigned n_sm; /* volatile: read here, not held in a register across the loop */
            asm volatile("mov.u32 %0, %%nsmid;" : "=r"(n_sm));
            /* unsigned: item < 2^31 and the distance < 2^31, so the sum cannot wrap */
            const unsigned later = (unsigned)item + n_sm * 5u * (unsigned)ipb;
            if (later < (unsigned)n_items) {
                const int64_t r = item_row<TILE>(pr, s_lvl, (int)later, tiled);
                const PointTensor<T> loc(pr.sampling_locations, pr), attn(pr.attention_weights, pr);
                asm volatile("prefetch.global.L2 [%0];" ::"l"((loc + r * pr.NP * 2).p));
                asm volatile("prefetch.global.L2 [%0];" ::"l"((attn + r * pr.NP).p));
            }
        }
    }
}

/* Where the point (lx, ly) of attention weight a falls on level lvl ({H_l, W_l, start} as
 * load_levels stores it), for the head whose channel 0 of position 0 is at head_off in value
 * (HC = H * C elements a position, S positions):
 *   offs: element offset in value of each corner's channel 0 for this head, or -1 if outside;
 *   geo:  WEIGHTS ? the corner weights times the attention weight : {A, fx, fy, 0}.
 * flags: the problem's (MSDA_NEAREST), 0 without the option code.
 * Offsets are int32: the fast path needs B*S*H*C < 2^31. Unsigned arithmetic wraps instead of
 * overflowing on lying shape tables; the final idx < S test keeps every read inside value. */
template <bool WEIGHTS>
__device__ __forceinline__ void place_point(int flags, int4 lvl, int head_off, int HC, int S,
                                            float lx, float ly, float a, int4 &offs,
                                            float4 &geo) {
    offs = make_int4(-1, -1, -1, -1);
    geo = make_float4(WEIGHTS ? 0.f : a, 0.f, 0.f, 0.f);
    if (flags & MSDA_NEAREST) { /* nearest_point() in 32-bit: one corner of weight 1 */
        if (lvl.y <= 0 || !(isfinite(lx) && isfinite(ly))) return;
        const float Wf = (float)lvl.y, Hf = (float)lvl.x;
        const int xx = (int)nearest_pixel(lx, Wf), yy = (int)nearest_pixel(ly, Hf);
        const unsigned idx = (unsigned)lvl.z + (unsigned)yy * (unsigned)lvl.y + (unsigned)xx;
        if (idx >= (unsigned)S) return;
        offs.x = head_off + (int)idx * HC;
        geo = make_float4(a, 0.f, 0.f, 0.f); /* weights {A, 0, 0, 0} = {A, fx = 0, fy = 0, 0} */
        return;
    }
    int x0, y0;
    float fx, fy;
    if (!locate32(lx, ly, lvl, x0, y0, fx, fy)) return;
    /* WEIGHTS (forward): slot k holds the corner whose pixel has parities (k & 1, k >> 1), so
     * the groups of a warp, gathering slot k of neighbouring queries, all ask for the pixels
     * they share in the same load (one line lookup for them). */
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

/* place_point of sampling point `pidx` (0 <= pidx < L*P, on level lvl) of the item it = {row,
 * head offset}, its location and weight read here. */
template <typename T, bool WEIGHTS, bool OPT, typename P = void>
__device__ __forceinline__ void stage_point_at(const msda_problem &pr, int4 lvl, int2 it,
                                               int pidx, int4 &offs, float4 &geo) {
    const PointTensor<T, P> loc(pr.sampling_locations, pr), attn(pr.attention_weights, pr);
    const int64_t i = (int64_t)it.x * (int)pr.NP + pidx;
    const float a = to_acc(attn[i]);
    const float lx = to_acc(loc[2 * i]), ly = to_acc(loc[2 * i + 1]);
    place_point<WEIGHTS>(OPT ? pr.flags : 0, lvl, it.y, (int)(pr.H * pr.C), (int)pr.S, lx, ly, a,
                         offs, geo);
}
/* stage_point_at for the level table in shared memory (s_lvl: load_levels) */
template <typename T, bool WEIGHTS, bool OPT, typename P = void>
__device__ __forceinline__ void stage_point(const msda_problem &pr, const int4 *s_lvl, int2 it,
                                            int pidx, int4 &offs, float4 &geo) {
    stage_point_at<T, WEIGHTS, OPT, P>(pr, s_lvl[level_of<OPT>(pr, pidx)], it, pidx, offs, geo);
}

/* Stages points [p0, p0 + kn) of the block's items [base, base + IPB) (s_item: fill_items) in
 * shared memory, one thread per point (stage_point); slots past the last item or point get
 * offsets -1. The caller synchronises before reading them. */
template <typename T, bool WEIGHTS, bool OPT, typename St, typename P = void>
__device__ __forceinline__ void stage_chunk(const msda_problem &pr, const int4 *s_lvl,
                                            const int2 *s_item, int base, int n_items, int p0,
                                            int kn, int4 *s_offs, float4 *s_geo) {
    for (int j = threadIdx.x; j < St::IPB * St::K; j += St::NT) {
        const int il = j / St::K, k = j % St::K;
        int4 offs = make_int4(-1, -1, -1, -1);
        float4 geo = make_float4(0.f, 0.f, 0.f, 0.f);
        if (base + il < n_items && k < kn)
            stage_point<T, WEIGHTS, OPT, P>(pr, s_lvl, s_item[il], p0 + k, offs, geo);
        s_offs[il * St::STRIDE + k] = offs;
        s_geo[il * St::STRIDE + k] = geo;
    }
}
