/* kernels/msda_forward.cu: MSDA forward on CUDA.
 *
 * out[b,q,h,c] = sum_{l,p} A[b,q,h,l,p] * bilinear(V_l[b,:,:,h,c], x = loc_x*W_l - 0.5,
 *                                                                  y = loc_y*H_l - 0.5)
 * Thread map (fast path, f32/f16/bf16 with C = 4*G, G a power of two <= 32): a group of G
 *   threads per (b, q, h), each owning 4 channels (8 for half types in problems of >= 65536
 *   items, with G = C / 8), one vector load per corner; 256 / G items per block (128 / G with
 *   8 channels a thread, v20); the block first stages the sampling geometry of its items (K points each) in
 *   shared memory, one thread per point (level table, 32-bit index math, corner weights
 *   premultiplied by A), then every group gathers. Items are head-major: a block holds
 *   consecutive queries of one head, which sample nearby pixels (L1 and L2 reuse).
 *   Generic path (f64, any other C, unaligned pointers): one warp per (b, q, h), lane j owns
 *   channels j, j+32, ...; every lane computes the geometry itself.
 *   Both paths serve per-level point counts, nearest sampling (one corner of weight 1) and fused
 *   softmax (the warp or group first finds its item's logit maximum and 1 / sum(exp), by
 *   shuffles in a fixed order; the fast path keeps them in shared memory for the staging).
 * Numerics: f32 accumulation for f32/f16/bf16, f64 for f64; corners outside the level or outside
 *   [0, S) contribute 0 (locate / pixel_index in common.cuh).
 * Tried (H100, torch 2.11, CUDA events; "realistic" inputs unless said; f32 / bf16):
 *   v1 generic kernel, one warp per (b, q, h), geometry per lane
 *      ddetr_enc (uniform locations) ............................... 1.605 / 1.534 ms
 *   v2 groups of C/V threads, V = 16 bytes of channels, geometry staged per block in shared
 *      memory, 64-bit index math: ddetr_enc 0.303 / 0.222 ms (ncu: 62% of issue slots used,
 *      so instruction-bound: int64 divisions and per-point level loads in the staging)
 *   v3 v2 with a persistent grid, each block walking a contiguous run of items: ddetr_enc
 *      0.406 / 0.279 ms (slower: resident blocks spread over all of value, L2 reuse lost)
 *   v4 v2 with the level table in shared memory, 32-bit index math, weights premultiplied:
 *      ddetr_enc 0.198 / 0.163 ms, dino_dec900 0.021 / 0.032 ms
 *   v5 v4 with V = 4 channels for every type (8-byte loads in half precision, twice the
 *      groups): ddetr_enc 0.198 / 0.161 ms, dino_dec900 0.021 / 0.017 ms
 *   v6 v5 with head-major items (a block: 32 consecutive queries of one head, which sample
 *      overlapping pixels): ddetr_enc 0.177 / 0.168, m2f_enc 0.161 / 0.152 (v5 same run:
 *      0.204 / 0.162, 0.182 / 0.146)
 *   v7 v6 with each item's row and head offset computed once per block instead of per point
 *      (two integer divisions): ddetr_enc 0.188 / 0.157, f16 0.143; m2f_enc 0.171 / 0.140
 *      (v5 with the same change, same run: 0.211 / 0.158, 0.188 / 0.140) <- shipped
 *   v8 v7 with 8 channels a thread for half types (one 16-byte load a corner, half the groups):
 *      ddetr_enc bf16 / f16 0.156 / 0.149 (v7 same run 0.158 / 0.145), m2f_enc 0.142 / 0.137
 *      (0.142 / 0.132), dino_dec900 0.031 / 0.031 (0.017 / 0.016): no gain where the half
 *      forward is issue-bound, and decoders lose half their threads.
 *   v9 v7 with each corner's address one IMAD.WIDE.U32 (the lane's value pointer held opaque in
 *      a register pair; before, the lane offset was folded into the index and every corner paid
 *      a 64-bit add, a shift and the base reloaded from the constant bank: 5-6 instructions) and
 *      bf16 widened by a shift or a mask (was a PRMT and a shift for the high half): per corner
 *      17 -> 11 instructions in bf16, 11 -> 7 in f32. ddetr_enc f32 / bf16 / f16 0.188 / 0.158
 *      / 0.144 -> 0.186 / 0.137 / 0.134 ms, m2f_enc 0.172 / 0.142 / 0.132 -> 0.170 / 0.124 /
 *      0.123, dino_dec900 bf16 0.017 -> 0.015 (v7 alternated in the same session)
 *   v10 v9 with 8 channels a thread (one 16-byte load a corner) for half types when the
 *      problem has >= 65536 items (encoders; decoders keep 4, see v8): ddetr_enc bf16 / f16
 *      0.137 / 0.134 -> 0.131 / 0.129 ms, m2f_enc 0.124 / 0.123 -> 0.120 / 0.118; decoders
 *      unchanged (v9 alternated in the same session). With v9's cheaper corners the wider
 *      load now pays (v8, tried on v7, did not).
 *   v11 v10 with each point's corners staged in the order of their pixels' parities (slot k:
 *      x parity k & 1, y parity k >> 1), so that groups of a warp whose points share a pixel
 *      gather it in the same load. A simulation of realistic ddetr_enc inputs counted 25% fewer
 *      distinct lines per load with 8 items a warp (half types) and 17% with 4 (f32); measured:
 *      ddetr_enc f32 / bf16 / f16 0.186 / 0.131 / 0.130 -> 0.185 / 0.129 / 0.128 ms, m2f_enc
 *      0.170 / 0.120 / 0.118 -> 0.169 / 0.119 / 0.118, uniform ddetr_enc 0.220 / 0.142 ->
 *      0.219 / 0.140, decoders unchanged (v10 alternated in the same session). Line lookups
 *      were not the whole limit: ncu (bf16 ddetr_enc) then showed L1 78%, issue slots 69%,
 *      ALU pipe 54% (the bf16 widening), 2.2 eligible warps a scheduler.
 *   v12 v11 with each block, as it takes its items, prefetching into L2 the sampling locations
 *      and weights of the items one wave of resident blocks later (5 blocks a multiprocessor;
 *      fill_items; read once, they come from DRAM): ddetr_enc f32 0.184 -> 0.172 ms, m2f_enc
 *      0.168 -> 0.154, uniform ddetr_enc 0.217 -> 0.203; half types and decoders unchanged
 *      (v11 alternated in the same session). A first version computing the distance once per
 *      block held it in registers across the loop (46 -> 51 in the half kernels: 4 blocks a
 *      multiprocessor, bf16 0.129 -> 0.136; capped at 5 blocks it spilled). The same prefetch
 *      in the aggregated backward: no change (0.522 vs 0.521 ms); with grad_output's line
 *      too, slower (0.520 -> 0.525).
 *   v13 v12 with the 8 half-precision channels of a thread stored as one 16-byte word (two
 *      8-byte stores half-filled every 32-byte sector of a warp's store twice; ncu: 16 of 32
 *      bytes a sector used): ddetr_enc bf16 / f16 0.128 / 0.127 -> 0.126-0.127 / 0.125-0.126
 *      ms, m2f_enc 0.120 / 0.119 -> 0.119-0.120 / 0.118 (v12 alternated in the same session).
 *      <- shipped
 *   v14 v13 with 16 points staged per chunk for the 8-channel kernels (one chunk for 16
 *      points; 36.6 instead of 18.4 KB of shared memory a block): ddetr_enc bf16 0.127 ->
 *      0.128-0.129, f16 0.126 -> 0.125, m2f_enc 0.119 / 0.118 -> 0.118 / 0.116-0.117. Mixed;
 *      not shipped.
 *   v15 v13 with an encoder's queries taken in tiles of pixels per block (common.cuh,
 *      tiled_query: 8 x 8 for the 64 items of a half-precision block, 8 wide x 4 tall for 32),
 *      as the backward takes them (msda_backward.cu v27): ddetr_enc f32 / bf16 0.173 / 0.127 ->
 *      0.189 / 0.140 ms, m2f_enc 0.154 / 0.119 -> 0.172 / 0.129 (alternated twice in one session; a
 *      first version with slower index arithmetic: bf16 0.144). Not shipped: rows of 32 or 64
 *      pixels gather faster here, though the tiles touch fewer distinct rows.
 *   v16 v13 with 16 channels a thread for half types in encoders (two 16-byte loads a corner,
 *      C / 16 threads an item, 128 items a block, 48 registers, no spills): ddetr_enc bf16 /
 *      f16 0.127 / 0.128 -> 0.177 / 0.177 ms, m2f_enc 0.120 / 0.118 -> 0.156 / 0.156
 *      (alternated twice in one session). Not shipped. Likely cause, not profiled: a warp's
 *      load then reaches the rows of 16 items instead of 8, twice the L1 lines an instruction.
 *   ncu of v13 (bf16 ddetr_enc, 150 us at base clock): the L1's LSU data-pipe wavefronts are
 *      the busiest unit (75%; issue 69%): 19.3 M for the 2.55 M gathers (7.5 each, with 4.4-4.9
 *      line lookups each) and 4.4 M for shared memory (all at their ideal). The counts fit a
 *      16-byte gather served a quarter warp (8 lanes, two items here) at a time, each line a
 *      quarter touches a wavefront: one per item and corner unless the two items of a quarter
 *      share the line, in half precision as in f32 (whose 8-lane item fills the line).
 *      So the half forward moves half the bytes of f32 at about the same wavefronts; the value
 *      layout (B, S, H, C) gives a line of a pixel two heads' rows, never two corners.
 *   v17 v13 with half types' 8-channel kernel capped for 6 or 7 blocks a multiprocessor (40
 *      registers and 16 bytes of spills; 32 and 56): ddetr_enc bf16 / f16 0.127 / 0.126 ->
 *      0.129 / 0.129 (6) and 0.184 / 0.185 (7), m2f_enc 0.119 / 0.118 -> 0.119 / 0.118 and 0.168
 *      / 0.168 (alternated twice in one session). Not shipped.
 *   v18 v13 with 1, 2 or 4 of a point's 4 corners gathered through the texture pipe
 *      (tex1Dfetch of 16-byte texels from a texture object over value), hoping its
 *      wavefronts would add to the LSU's: ddetr_enc bf16 0.127 -> 0.146 / 0.171 / 0.171 ms,
 *      m2f_enc 0.119 -> 0.135 / 0.160 / 0.154 (alternated twice in one session). The texture
 *      path is slower and not additive. Not shipped.
 *   v19 v13 with the blocks taking the item tiles last first (as the aggregated backward, v40,
 *      where it gained 4%): ddetr_enc bf16 / f16 0.128-0.127 / 0.127-0.126 -> 0.126-0.127 /
 *      0.125-0.126 ms, m2f_enc 0.120-0.119 / 0.118-0.120 -> 0.122-0.123 / 0.121 (alternated
 *      twice in one session); f32 lost its v12 prefetch (aimed at the items a wave later in
 *      index order): 0.173 -> 0.191. The forward's blocks cost about the same whatever their
 *      queries' level. Not shipped.
 *   v20 v13 with blocks of 128 threads for the 8-channel kernels (32 items a block, K = 16
 *      points staged at once, 10 blocks a multiprocessor at 46 registers; the 4-channel
 *      kernels keep 256): ddetr_enc bf16 / f16 0.129-0.126 / 0.127-0.125 -> 0.124 / 0.122 ms,
 *      m2f_enc 0.120-0.119 / 0.118-0.117 -> 0.114 / 0.112; f32 and decoders unchanged (same
 *      kernels); 64 threads (16 items): 0.133 / 0.130, m2f_enc 0.127 / 0.123 (alternated twice
 *      in one session each). Shorter blocks leave less of a tail, and one chunk of 16 points
 *      one barrier fewer; not profiled. A first version also gave every fast forward kernel
 *      __launch_bounds__(NT, 1280 / NT): with 256 threads that bound alone made f32 / f16
 *      slower (0.173 -> 0.181, 0.126 -> 0.134; the compiler's code changed), so the bounds
 *      stay as they were. <- shipped
 *   v21 v20 with the point loop unrolled 8 times instead of 4 (46 registers in the half
 *      kernels as before; 42 instead of 40 in the 4-channel ones): ddetr_enc f32 / bf16 / f16
 *      0.173 / 0.123-0.124 / 0.121-0.122 -> 0.166 / 0.119 / 0.118 ms, m2f_enc 0.154 / 0.115 /
 *      0.112 -> 0.151 / 0.113 / 0.110; unrolled 16: 0.168 / 0.119 / 0.117, m2f_enc 0.157 /
 *      0.114 / 0.112; unrolled 2: 0.174 / 0.125 / 0.123 (alternated twice in one session
 *      each). <- shipped
 *   Not tried: a 16-byte staged record per point instead of 32 (the ncu source view of v13
 *   has the staging's shared-memory reads and writes at 4.1 M of the 23.4 M L1 wavefronts; a
 *   half record would save about 1.9 M, 8%), which needs the location fraction in 14 bits or
 *   each corner's validity folded into its weight (0 * Inf would then differ from skipping).
 */
#include <type_traits>

#include "common.cuh"

// ---------------------------------------------------------------------------------------------
// kernel

template <typename T>
__global__ void __launch_bounds__(256) msda_forward_kernel(msda_problem pr) {
    typedef typename AccOf<T>::type Acc;
    const T *value = (const T *)pr.value;
    const T *loc = (const T *)pr.sampling_locations;
    const T *attn = (const T *)pr.attention_weights;
    T *out = (T *)pr.output;
    const int64_t H = pr.H, C = pr.C, L = pr.L, Q = pr.Q, NP = pr.NP;
    const int lane = threadIdx.x & 31;
    const int64_t n_items = pr.B * Q * H;
    const int64_t stride = ((int64_t)gridDim.x * blockDim.x) >> 5;
    for (int64_t qh = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) >> 5; qh < n_items;
         qh += stride) {
        const int64_t b = qh / (Q * H), h = qh % H;
        Acc mx = 0, inv = 1;
        if (pr.flags & MSDA_SOFTMAX) softmax_stats<Acc>(attn + qh * NP, NP, lane, mx, inv);
        for (int64_t c0 = 0; c0 < C; c0 += 32) {
            const int64_t c = c0 + lane;
            Acc acc = 0;
            for (int64_t l = 0; l < L; l++) {
                const int64_t H_l = load_index(pr.spatial_shapes, pr.index_dtype, 2 * l);
                const int64_t W_l = load_index(pr.spatial_shapes, pr.index_dtype, 2 * l + 1);
                const int64_t start = load_index(pr.level_start_index, pr.index_dtype, l);
                const int64_t p_end = level_point_begin(pr, l + 1);
                for (int64_t p = level_point_begin(pr, l); p < p_end; p++) {
                    const int64_t i = qh * NP + p;
                    Point<Acc> pt;
                    if (!generic_point<Acc>(pr, loc, i, H_l, W_l, start, b, h, pt)) continue;
                    const Acc a = attention<Acc>(pr, to_acc(attn[i]), mx, inv);
                    if (c < C) {
#pragma unroll
                        for (int k = 0; k < 4; k++)
                            if (pt.inside[k]) acc += a * pt.w[k] * to_acc(value[pt.off[k] + c]);
                    }
                }
            }
            if (c < C) out[qh * C + c] = from_acc<T>(acc);
        }
    }
}

/* Threads a block of the 8-channel (half-type) kernels (v20: 32 items of 4 threads, all 16
 * points of an item staged at once; 10 blocks a multiprocessor): 128 measured 3-5% faster than
 * 256 and 8% faster than 64. The 4-channel kernels keep 256. */
#ifndef MSDA_FWD_WIDE_THREADS
#define MSDA_FWD_WIDE_THREADS 128
#endif
/* Unrolling of the point loop (v21): 8 measured 2-4% faster than 4 (more gathers in flight, the
 * same registers), 16 slower in f32 and m2f_enc. */
#ifndef MSDA_FWD_UNROLL
#define MSDA_FWD_UNROLL 8
#endif
static constexpr int kFwdUnroll = MSDA_FWD_UNROLL;
template <int V> struct FwdThreads {
    static constexpr int NT = V == 8 ? MSDA_FWD_WIDE_THREADS : 256;
};

template <typename T, int G, bool OPT, int V>
__global__ void __launch_bounds__(FwdThreads<V>::NT) msda_forward_fast(msda_problem pr) {
    static_assert(V == 4 || V == 8, "4 or 8 channels a thread");
    typedef Stage<G, FwdThreads<V>::NT> St;
    __shared__ int4 s_lvl[MSDA_FAST_MAX_LEVELS];
    __shared__ int4 s_offs[St::IPB * St::STRIDE];
    __shared__ float4 s_w[St::IPB * St::STRIDE];
    __shared__ float2 s_soft[OPT ? St::IPB : 1]; /* softmax {max, 1 / sum} per item */
    __shared__ int2 s_item[St::IPB];             /* {row, head offset} per item */
    const T *value = (const T *)pr.value + threadIdx.x % G * V;
    /* value held in a register pair, opaque to the compiler: a corner's address is then one
     * IMAD.WIDE.U32 (value + o) instead of the lane offset folded into the index, a 64-bit
     * add, a shift and the base reloaded from the constant bank (5-6 instructions a corner) */
    asm("" : "+l"(value));
    T *out = (T *)pr.output;
    const int n_items = (int)(pr.B * pr.Q * pr.H), LP = (int)pr.NP, C = (int)pr.C;
    const int local = threadIdx.x / G, g = threadIdx.x % G;
    load_levels(pr, s_lvl);
    __syncthreads();
    /* unsigned: with more than 2^30 items, base + gridDim.x * IPB passes 2^31 - 1 (int would
     * wrap negative and run again on items before the first), never 2^32 - 1 */
    for (unsigned ub = blockIdx.x * St::IPB; ub < (unsigned)n_items; ub += gridDim.x * St::IPB) {
        const int base = (int)ub;
        const int item = base + local;
        float acc[V];
#pragma unroll
        for (int j = 0; j < V; j++) acc[j] = 0.f;
        fill_items<T, true, 0>(pr, s_lvl, base, n_items, St::IPB, s_item);
        __syncthreads();
        const int row = s_item[local].x;
        group_softmax_stats<T, G, OPT>(pr, item, row, n_items, s_soft);
        if (OPT && (pr.flags & MSDA_SOFTMAX)) __syncthreads();
        for (int p0 = 0; p0 < LP; p0 += St::K) {
            const int kn = LP - p0 < St::K ? LP - p0 : St::K;
            stage_chunk<T, true, OPT, St>(pr, s_lvl, s_item, base, n_items, p0, kn, s_soft, s_offs,
                                          s_w);
            __syncthreads();
#pragma unroll kFwdUnroll
            for (int k = 0; k < kn; k++) {
                const int4 o4 = s_offs[local * St::STRIDE + k];
                const float4 w4 = s_w[local * St::STRIDE + k];
                const int o[4] = {o4.x, o4.y, o4.z, o4.w};
                const float w[4] = {w4.x, w4.y, w4.z, w4.w};
#pragma unroll
                for (int c = 0; c < 4; c++) {
                    if (o[c] < 0) continue;
                    float v[V];
                    if constexpr (V == 8) load_vec8(value + (unsigned)o[c], v);
                    else load_vec(value + (unsigned)o[c], v); /* o >= 0: one IMAD.WIDE.U32 */
#pragma unroll
                    for (int j = 0; j < V; j++) acc[j] += w[c] * v[j];
                }
            }
            __syncthreads();
        }
        if (item < n_items) {
            if constexpr (V == 8) store_vec8(out + (int64_t)row * C + g * V, acc);
            else store_vec(out + (int64_t)row * C + g * V, acc);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// launcher

/* Items from which half types take 8 channels a thread (one 16-byte load a corner, half the
 * threads): encoders gain (v10), while a decoder's few thousand items would fill too few
 * threads (v8: dino_dec900 twice as slow). */
#define MSDA_FWD_WIDE_MIN_ITEMS 65536

template <typename T, int G, int V>
static void launch_fast_v(const msda_problem *pr, cudaStream_t stream) {
    constexpr int NT = FwdThreads<V>::NT;
    const unsigned int blocks = item_blocks(pr->B * pr->Q * pr->H, NT / G);
    if (msda_needs_general(pr)) msda_forward_fast<T, G, true, V><<<blocks, NT, 0, stream>>>(*pr);
    else msda_forward_fast<T, G, false, V><<<blocks, NT, 0, stream>>>(*pr);
}

/* G = C / 4 (fast_group) */
template <typename T, int G>
static cudaError_t launch_fast(const msda_problem *pr, cudaStream_t stream) {
    if constexpr (!std::is_same<T, float>::value && G >= 2) {
        if (pr->B * pr->Q * pr->H >= MSDA_FWD_WIDE_MIN_ITEMS) {
            launch_fast_v<T, G / 2, 8>(pr, stream);
            return cudaSuccess;
        }
    }
    launch_fast_v<T, G, 4>(pr, stream);
    return cudaSuccess;
}

template <typename T> static cudaError_t launch(const msda_problem *pr, cudaStream_t stream) {
    if constexpr (HasFast<T>::value) {
        const void *ptrs[] = {pr->value, pr->output};
        switch (fast_group(pr, ptrs, 2)) {
        case 1: return launch_fast<T, 1>(pr, stream);
        case 2: return launch_fast<T, 2>(pr, stream);
        case 4: return launch_fast<T, 4>(pr, stream);
        case 8: return launch_fast<T, 8>(pr, stream);
        case 16: return launch_fast<T, 16>(pr, stream);
        case 32: return launch_fast<T, 32>(pr, stream);
        default: break;
        }
    }
    msda_forward_kernel<T><<<warp_blocks(pr->B * pr->Q * pr->H), 256, 0, stream>>>(*pr);
    return cudaSuccess;
}

// ---------------------------------------------------------------------------------------------
// entry point

extern "C" int msda_cuda_forward(const msda_problem *pr) {
    static const char fn[] = "msda_forward";
    DeviceGuard guard;
    MSDA_CUDA_CHECK(fn, guard.select(pr->device));
    cudaGetLastError(); /* clear an error an earlier call of this thread left behind */
    cudaStream_t stream = (cudaStream_t)pr->stream;
    switch (pr->dtype) {
    case MSDA_F32: MSDA_CUDA_CHECK(fn, launch<float>(pr, stream)); break;
    case MSDA_F64: MSDA_CUDA_CHECK(fn, launch<double>(pr, stream)); break;
    case MSDA_F16: MSDA_CUDA_CHECK(fn, launch<__half>(pr, stream)); break;
    case MSDA_BF16: MSDA_CUDA_CHECK(fn, launch<__nv_bfloat16>(pr, stream)); break;
    default: return msda_set_error(MSDA_ERR_INTERNAL, "%s: dtype %d", fn, pr->dtype);
    }
    MSDA_CUDA_CHECK(fn, cudaGetLastError());
    return MSDA_OK;
}
