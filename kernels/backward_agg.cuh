/* kernels/backward_agg.cuh: the aggregated backward (MSDA_ROUTE_AGGREGATED: encoders, whose
 * Q * L * P >= 2 * S; gradients: c/msda.h). A block's queries sample many of the same pixels
 * (realistic ddetr_enc: the corners of a chunk hit ~7x fewer distinct value rows), so the block
 * first merges its corners per value row in a shared-memory hash table, then loads and updates
 * each distinct row once: global atomics drop by the duplication factor. The steps per chunk
 * are described above msda_backward_agg.
 * Thread map: two items a group of G threads (staging as in kernels/staging.cuh); walkers of
 * G / 2 lanes, 8 channels a lane, one walker per row segment.
 * Numerics: f32 sums; per-point gradients from dots summed in a fixed order (bitwise repeatable);
 * grad_value per row and block by atomics, or fixed point with MSDA_DETERMINISTIC.
 * Why: the rule (Q * NP >= 2 * S) sends encoders here, where the merged rows take about half
 * the per-point kernel's time, and keeps decoders off, where it loses (kernels/TUNING.md,
 * "Backward, aggregated (encoders)", v8-v40; "Backward, per-point and generic", v53); today's
 * times: BENCHMARKS.md. */
#pragma once

#include "backward_agg_rows.cuh"

/* Slot lists longer than MSDA_AGG_CAP are walked in segments by several walkers: the filer of a
 * row's n-th slot (n = MSDA_AGG_CAP, 2 * MSDA_AGG_CAP, ...) marks it, and a segment runs from
 * the list's head, or from a marked slot, to the next marked slot. */
#define MSDA_AGG_CAP 16 /* 8, 12, 24, 32 slower (kernels/TUNING.md, aggregated v28, v37) */
#define MSDA_AGG_MARK 0x4000
#define MSDA_AGG_LINK 0x3fff

/* Per slot, one 8-byte word: {coefficient A * w_k as bits, (next slot of the row + 1) |
 * MSDA_AGG_MARK}, so a step of the walk reads both at once. */

/* The first slot of walk entry v (< 0: none), the key of its row and that slot's word m. A row
 * entry (v < HS, its hash position) starts at the list's head unless that slot is marked (its
 * own entry walks it); a marked entry (HS + slot) at its slot. */
template <typename St>
__device__ __forceinline__ void walk_entry(int v, const int *s_key, const int *s_head,
                                           const int2 *s_meta, const int4 *s_offs, int &key,
                                           int &j, int2 &m) {
    key = 0, j = -1, m = make_int2(0, 0);
    if (v < 0) return;
    if (v < St::HS) {
        key = s_key[v], j = s_head[v];
        m = s_meta[j];
        if (m.y & MSDA_AGG_MARK) j = -1;
    } else {
        j = v - St::HS;
        const int il = j / (St::K * 4), k = (j >> 2) % St::K, c = j & 3;
        key = reinterpret_cast<const int *>(&s_offs[il * St::STRIDE + k])[c];
        m = s_meta[j];
    }
}

/* walk_entry for walker `walker` of WPB in the round of entries [e0, e0 + WPB). Every other
 * round is handed out in reverse: the entries are sorted longest first, so warp 0 would
 * otherwise get the longest segments of every round. */
template <typename St, int WPB>
__device__ __forceinline__ void round_entry(int e0, int walker, int nent, const short *s_ent,
                                            const int *s_key, const int *s_head,
                                            const int2 *s_meta, const int4 *s_offs, int &key,
                                            int &j, int2 &m) {
    const int e = e0 + ((e0 / WPB) & 1 ? WPB - 1 - walker : walker);
    walk_entry<St>(e < nent ? s_ent[e] : -1, s_key, s_head, s_meta, s_offs, key, j, m);
}

/* The slot after the current one (whose word is m) in its segment, or -1; m becomes that
 * slot's word. */
__device__ __forceinline__ int next_slot_of(const int2 *s_meta, int2 &m) {
    const int nx = (m.y & MSDA_AGG_LINK) - 1;
    if (nx < 0) return -1;
    m = s_meta[nx];
    return m.y & MSDA_AGG_MARK ? -1 : nx;
}

/* Staging of the aggregated backward: IPB items (two per group of G threads) x K points per
 * chunk (4 for C = 32, one level of Deformable DETR's points), NS corner slots, a hash table of
 * HS = NS positions (at most NS distinct rows). */
template <int G> struct StageAgg {
    static constexpr int NT = MSDA_BLOCK_THREADS; /* threads a block */
    static constexpr int GPB = NT / G;            /* groups per block */
    static constexpr int K0 = G < 2 ? 2 : (G > 16 ? 16 : G);
    static constexpr int MUL = K0 >= 2 ? 2 : 1; /* items per group */
    static constexpr int IPB = GPB * MUL;       /* items per block */
    static constexpr int K = K0 / MUL;          /* points per item per chunk */
    /* unpadded: every access here takes (item, point) from consecutive threads, where
     * Stage's padding (for groups that each read one point) only made bank conflicts */
    static constexpr int STRIDE = K;
    static constexpr int NS = IPB * K * 4; /* corner slots per chunk (<= 1024 for G >= 2) */
    static constexpr int HS = NS;          /* hash positions */
    static constexpr int HBITS = HS >= 2048 ? 11 : (HS >= 1024 ? 10 : 9);
    static_assert((1 << HBITS) == HS, "HS is a power of two");
    static_assert(G < 2 || NS % NT == 0, "every thread files the same number of slots");
    static_assert(IPB == MSDA_AGG_BLOCK_ITEMS(G), "c/routes.c sizes the grid for these items");
};

/* Aggregated backward (G >= 4; c/routes.c chooses it where Q * NP >= 2 * S). A block holds
 * 2 * 256 / G neighbouring queries of one head (head-major items; an encoder's in a tile of
 * pixels, fill_items), whose points land on many of the same pixels: on realistic ddetr_enc
 * inputs the 64 x 4 x 4 corners of a chunk hit ~7x fewer distinct value rows. Per staged chunk,
 * one function a phase:
 *   1. file (agg_file_corners): one thread per corner ("slot") files it under its row (value /
 *      grad_value offset) in a shared-memory hash table (open addressing; a linked list of
 *      slots per row and a count; new rows numbered warp by warp), with its coefficient
 *      A * w_k. The row's MSDA_AGG_CAP-th, 2 * MSDA_AGG_CAP-th, ... slot is marked: it starts a
 *      segment of the list. Walk entries: one per row (its list's head segment), one per
 *      marked slot;
 *   2. sort (agg_sort_entries) the entries by their segments' estimated lengths (from the
 *      counts; counting sort, longest first), so the walkers of a warp, which step together,
 *      have about the same number of slots;
 *   3. walk (agg_walk): one walker of G/2 lanes (8 channels a lane) per entry loads the value
 *      row once and, over the segment's slots, sums coefficient * grad_output (then one 16-byte
 *      atomic per 4 channels: global atomics drop by the duplication factor) and parks each
 *      slot's grad_output . row in s_dot;
 *   4. point gradients (agg_point_gradients) from the four dots of each point: with
 *      d_k = g . v_k, dL/dA = sum_k w_k d_k, dL/dfx = (1-fy)(d1-d0) + fy(d3-d2),
 *      dL/dfy = (1-fx)(d2-d0) + fx(d3-d1).
 * DET (MSDA_DETERMINISTIC): each contribution is rounded to the 64-bit fixed point on its own
 * (as in msda_backward_fast, so grad_value has the same bits), the walk sums them as integers
 * and adds each row's sums with one integer atomic per channel; lanes own channels
 * part + (G/2) * q there, so a walker's atomics cover whole sectors. The point gradients come
 * from dots summed in a fixed order either way. */
#define MSDA_AGG_BUCKETS 16 /* segment lengths 1 .. 15 and 16 or more */

/* The kernel's shared memory, one object, so every array is one base address plus a constant:
 * with separate __shared__ arrays the compiler (48 registers) rebuilt each array's
 * shared-window address (S2UR SR_CgaCtaId, ULEA) inside the walk loop, 13 of its 59
 * instructions a step. */
template <int G> struct AggShared {
    typedef StageAgg<G> St;
    int4 lvl[MSDA_FAST_MAX_LEVELS];
    int4 offs[St::IPB * St::STRIDE];
    float4 geo[St::IPB * St::STRIDE]; /* {A, fx, fy, 0} */
    float4 go[St::IPB * G];           /* grad_output of the block's items */
    int2 meta[St::NS];                /* {A * w_k, link}, per slot (walk_entry) */
    alignas(16) float dot[St::NS];    /* g . corner row, per slot (read as float4s) */
    int2 item[St::IPB];               /* {row, head offset} per item */
    int key[St::HS];
    int head[St::HS];
    int cnt2[St::HS / 2]; /* slots filed per row, two 16-bit counts a word */
    int bucket[MSDA_AGG_BUCKETS];
    int nent;
    short ent[St::NS]; /* walk entries (see above), filed, then longest first */
};

/* grad_output (gout, C channels) of the block's items into s_go; thread g of group `local`
 * loads its 4 channels of St::MUL items (zeros past the last item). */
template <typename T, int G>
__device__ __forceinline__ void agg_load_grad_output(AggShared<G> &sm, const T *gout, int C,
                                                     int g, int local, int base, int n_items) {
    typedef StageAgg<G> St;
    constexpr int V = 4;
#pragma unroll
    for (int m = 0; m < St::MUL; m++) {
        const int il = local + m * St::GPB, item = base + il, row = sm.item[il].x;
        float go[V];
        if (item < n_items) {
            load_vec(gout + (int64_t)row * C + g * V, go);
        } else {
#pragma unroll
            for (int j = 0; j < V; j++) go[j] = 0.f;
        }
        sm.go[il * G + g] = make_float4(go[0], go[1], go[2], go[3]);
    }
}

/* Phase 1: every inside corner of the staged chunk filed under its row; new rows numbered warp
 * by warp. */
template <int G> __device__ __forceinline__ void agg_file_corners(AggShared<G> &sm, int lane) {
    typedef StageAgg<G> St;
    for (int j = threadIdx.x; j < St::NS; j += St::NT) { /* same trip count in every lane */
        const int il = j / (St::K * 4), k = (j >> 2) % St::K, c = j & 3;
        const int o = reinterpret_cast<const int *>(&sm.offs[il * St::STRIDE + k])[c];
        unsigned hp = ((unsigned)o * 2654435761u) >> (32 - St::HBITS);
        bool fresh = false, marked = false;
        if (o >= 0) {
            const float4 geo = sm.geo[il * St::STRIDE + k];
            const float wx = (c & 1) ? geo.y : 1.f - geo.y;
            const float wy = (c & 2) ? geo.z : 1.f - geo.z;
            const float cf = geo.x * (wx * wy);
            for (;;) {
                const int prev = atomicCAS(&sm.key[hp], -1, o);
                if (prev == -1 || prev == o) {
                    fresh = prev == -1;
                    break;
                }
                hp = (hp + 1) & (St::HS - 1);
            }
            const int sh = 16 * (hp & 1);
            const int n = (atomicAdd(&sm.cnt2[hp >> 1], 1 << sh) >> sh) & 0xffff;
            marked = n >= MSDA_AGG_CAP && n % MSDA_AGG_CAP == 0;
            const int prev = atomicExch(&sm.head[hp], j);
            sm.meta[j] = make_int2(__float_as_int(cf), (prev + 1) | (marked ? MSDA_AGG_MARK : 0));
        }
        /* a walk entry for every new row (its hash position) and every marked slot
         * (HS + the slot) */
        const unsigned m = __ballot_sync(0xffffffffu, fresh || marked);
        int first = 0;
        if (lane == 0 && m) first = atomicAdd(&sm.nent, __popc(m));
        first = __shfl_sync(0xffffffffu, first, 0);
        if (fresh || marked)
            sm.ent[first + __popc(m & ((1u << lane) - 1u))] =
                (short)(fresh ? (int)hp : St::HS + j);
        if (fresh && marked) { /* the row's first filer came late: both entries */
            const int e2 = atomicAdd(&sm.nent, 1);
            sm.ent[e2] = (short)(St::HS + j);
        }
    }
}

/* Phase 2: the nent walk entries ordered by the length of their slot lists, longest first (a
 * counting sort into MSDA_AGG_BUCKETS buckets), so the walkers of a warp, which step together,
 * get lists of about the same length. Synchronises the block. */
template <int G>
__device__ __forceinline__ void agg_sort_entries(AggShared<G> &sm, int nent, int lane) {
    typedef StageAgg<G> St;
    constexpr int EPT = St::NS / St::NT; /* entries per thread at most */
    int bucket[EPT], rank[EPT], entry[EPT];
#pragma unroll
    for (int r = 0; r < EPT; r++) {
        const int e = threadIdx.x + r * St::NT;
        bucket[r] = -1, rank[r] = 0, entry[r] = 0;
        /* a warp with no entry in this round skips it whole: rows are a seventh
         * of the slots, so most warps have none past the first round */
        if ((threadIdx.x & ~31) + r * St::NT >= nent) continue;
        int b = -1; /* -1: no entry */
        entry[r] = e < nent ? sm.ent[e] : 0;
        if (e < nent) { /* segment length, estimated from the row's count */
            int len = MSDA_AGG_CAP;
            if (entry[r] < St::HS) {
                const int hp = entry[r], c = (sm.cnt2[hp >> 1] >> (16 * (hp & 1))) & 0xffff;
                len = c <= MSDA_AGG_CAP ? c : (c - 1) % MSDA_AGG_CAP;
            }
            len = len < 1 ? 1 : (len > MSDA_AGG_BUCKETS ? MSDA_AGG_BUCKETS : len);
            b = MSDA_AGG_BUCKETS - len;
        }
        /* one shared atomic per bucket and warp: most rows fall into a few
         * buckets, and lanes adding to one shared word are serialised */
        const unsigned peers = __match_any_sync(0xffffffffu, b);
        const int leader = __ffs(peers) - 1;
        int first = 0;
        if (b >= 0 && lane == leader) first = atomicAdd(&sm.bucket[b], __popc(peers));
        first = __shfl_sync(0xffffffffu, first, leader);
        bucket[r] = b;
        rank[r] = first + __popc(peers & ((1u << lane) - 1u));
    }
    __syncthreads();
    if (threadIdx.x < 32) { /* exclusive prefix sum of the bucket sizes */
        const int n = threadIdx.x < MSDA_AGG_BUCKETS ? sm.bucket[threadIdx.x] : 0;
        int incl = n;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const int t = __shfl_up_sync(0xffffffffu, incl, o);
            if (lane >= o) incl += t;
        }
        if (threadIdx.x < MSDA_AGG_BUCKETS) sm.bucket[threadIdx.x] = incl - n;
    }
    __syncthreads();
#pragma unroll
    for (int r = 0; r < EPT; r++) {
        const int e = threadIdx.x + r * St::NT;
        if (e < nent) sm.ent[sm.bucket[bucket[r]] + rank[r]] = (short)entry[r];
    }
    __syncthreads();
}

/* Phase 3, the walk: one walker of WG lanes per entry; all the loops below run the same trip
 * count in every lane of a warp (full-warp votes), so the group sums shuffle with the full
 * mask. Each walker's grad_value sums go out once a segment (sums.flush); with point_grads
 * each slot's grad_output . row goes to s_dot. FULL: every gradient wanted (compile-time, so the
 * walk tests no pointer). */
template <typename T, int G, bool DET, bool FULL>
__device__ __forceinline__ void agg_walk(const msda_problem &pr, AggShared<G> &sm, int nent,
                                         bool point_grads, long long *det_acc, float scale) {
    typedef StageAgg<G> St;
    constexpr int WG = G / 2, WPB = St::NT / WG;
    const int walker = threadIdx.x / WG, part = threadIdx.x % WG;
    /* half sums straight into grad_value where the code has half atomics */
    constexpr bool NATIVE = NativeHalf<T, false>::value;
    typename std::conditional<DET, DetRowSums<T, G>, RowSums<T, G, NATIVE>>::type sums(
        walker, part, det_acc, scale);
    const bool want_gv = DET ? det_acc != nullptr : FULL || pr.grad_value;
    if (!DET && want_gv) grid_dep_wait(); /* zero_kernel done (at once after the first) */
    for (int e0 = 0; e0 < nent; e0 += WPB) {
        int key, j;
        int2 m;
        round_entry<St, WPB>(e0, walker, nent, sm.ent, sm.key, sm.head, sm.meta, sm.offs, key, j,
                             m);
        const bool active = j >= 0;
        sums.load(pr, key, point_grads && j >= 0);
        while (__any_sync(0xffffffffu, j >= 0)) {
            float d = 0.f;
            int next = -1;
            if (j >= 0) {
                d = sums.step(sm.go, j / (St::K * 4), __int_as_float(m.x), want_gv, point_grads);
                next = next_slot_of(sm.meta, m);
            }
            if (point_grads) {
                d = group_sum<WG>(d);
                if (j >= 0 && part == 0) sm.dot[j] = d;
            }
            j = next;
        }
        if (want_gv && active) sums.flush(pr, key);
    }
}

/* The table emptied (the next chunk's barrier orders this before its filing). */
template <int G> __device__ __forceinline__ void agg_clear_table(AggShared<G> &sm, int nent) {
    typedef StageAgg<G> St;
    for (int e = threadIdx.x; e < nent; e += St::NT) {
        const int hp = sm.ent[e];
        if (hp < St::HS) sm.key[hp] = -1, sm.head[hp] = -1, sm.cnt2[hp >> 1] = 0;
    }
    if (threadIdx.x < MSDA_AGG_BUCKETS) sm.bucket[threadIdx.x] = 0;
}

/* Phase 4: the point gradients of the chunk's points [p0, p0 + kn) from the four dots each
 * (one thread a point). */
template <typename T, typename P, bool OPT, int G>
__device__ __forceinline__ void agg_point_gradients(const msda_problem &pr, AggShared<G> &sm,
                                                    int base, int n_items, int LP, int p0,
                                                    int kn, const PointTensor<T, P> &grad_loc,
                                                    const PointTensor<T, P> &grad_attn,
                                                    bool nearest) {
    typedef StageAgg<G> St;
    for (int j = threadIdx.x; j < St::IPB * St::K; j += St::NT) {
        const int il = j / St::K, k = j % St::K;
        if (base + il >= n_items || k >= kn) continue;
        const int4 o4 = sm.offs[il * St::STRIDE + k];
        const float4 geo = sm.geo[il * St::STRIDE + k];
        const float a = geo.x, fx = geo.y, fy = geo.z;
        /* one 16-byte read of the point's four dots (four 4-byte reads at a 16-byte stride
         * took four wavefronts each); slots of corners outside hold stale values, masked
         * here */
        const float4 d4 = reinterpret_cast<const float4 *>(sm.dot)[j];
        const float d0 = o4.x >= 0 ? d4.x : 0.f;
        const float d1 = o4.y >= 0 ? d4.y : 0.f;
        const float d2 = o4.z >= 0 ? d4.z : 0.f;
        const float d3 = o4.w >= 0 ? d4.w : 0.f;
        const float s_a = (1.f - fx) * (1.f - fy) * d0 + fx * (1.f - fy) * d1 +
                          (1.f - fx) * fy * d2 + fx * fy * d3;
        const bool hit = o4.x >= 0 || o4.y >= 0 || o4.z >= 0 || o4.w >= 0;
        const int pidx = p0 + k;
        const int64_t i = (int64_t)sm.item[il].x * LP + pidx;
        if (grad_attn) grad_attn.set(i, s_a);
        if (grad_loc && (!hit || nearest)) {
            grad_loc.set(2 * i, 0.f), grad_loc.set(2 * i + 1, 0.f);
        } else if (grad_loc) {
            const float s_x = (1.f - fy) * (d1 - d0) + fy * (d3 - d2);
            const float s_y = (1.f - fx) * (d2 - d0) + fx * (d3 - d1);
            const int l = level_of<OPT>(pr, pidx);
            const float W_l = (float)sm.lvl[l].y, H_l = (float)sm.lvl[l].x;
            grad_loc.set(2 * i, a * s_x * W_l);
            grad_loc.set(2 * i + 1, a * s_y * H_l);
        }
    }
}

/* What an instance of msda_backward_agg is compiled for (its Form): OPT, the option code
 * (per-level points, nearest); DET, grad_value in fixed point; FULL, every gradient wanted (the
 * walk tests no pointer); P, the points' storage (kernels/common.cuh: PointTensor). A launch
 * names one of the forms below. */
template <bool OPT_, bool DET_, bool FULL_, typename P_> struct AggForm {
    static constexpr bool OPT = OPT_, DET = DET_, FULL = FULL_;
    typedef P_ P;
};
/* MSDA_ROUTE_AGGREGATED: plain, with the option code, or plain with every gradient wanted */
template <bool DET, typename P> using Aggregated = AggForm<false, DET, false, P>;
template <bool DET, typename P> using AggregatedWithOptions = AggForm<true, DET, false, P>;
template <typename P> using AggregatedAllGradients = AggForm<false, false, true, P>;

template <typename T, int G, typename Form>
__global__ void __launch_bounds__(MSDA_BLOCK_THREADS, MSDA_BWD_MIN_BLOCKS) msda_backward_agg(msda_problem pr) {
    constexpr bool OPT = Form::OPT, DET = Form::DET, FULL = Form::FULL;
    typedef typename Form::P P;
    typedef StageAgg<G> St;
    __shared__ AggShared<G> sm;
    const int g = threadIdx.x % G, local = threadIdx.x / G, lane = threadIdx.x & 31;
    const T *gout = (const T *)pr.grad_output;
    const PointTensor<T, P> grad_loc(pr.grad_sampling_locations, pr);
    const PointTensor<T, P> grad_attn(pr.grad_attention_weights, pr);
    /* FULL: every gradient wanted (compile-time, so the walk tests no pointer) */
    const bool point_grads = FULL || grad_loc || grad_attn;
    const int n_items = (int)(pr.B * pr.Q * pr.H), LP = (int)pr.NP, C = (int)pr.C;
    const bool nearest = OPT && (pr.flags & MSDA_NEAREST);
    long long *det_acc = nullptr; /* DET: the fixed-point grad_value (deterministic.cuh) */
    float scale = 0.f;
    if (DET && pr.grad_value) {
        det_acc = (long long *)((char *)pr.workspace + MSDA_DET_HEADER_BYTES);
        scale = (float)det_scale(pr, (const DetHeader *)pr.workspace);
    }
    load_levels(pr, sm.lvl);
    for (int j = threadIdx.x; j < St::HS; j += St::NT) sm.key[j] = -1, sm.head[j] = -1;
    for (int j = threadIdx.x; j < St::HS / 2; j += St::NT) sm.cnt2[j] = 0;
    if (threadIdx.x == 0) sm.nent = 0;
    if (threadIdx.x < MSDA_AGG_BUCKETS) sm.bucket[threadIdx.x] = 0;
    __syncthreads();
    /* blocks take the tiles last first: an encoder's items end with the queries of its
     * coarse levels, whose points spread over the finer levels and aggregate least (the
     * costliest blocks); started first, they no longer make the grid's tail */
    const int n_tiles = (int)(((unsigned)n_items + St::IPB - 1) / St::IPB); /* no overflow */
    for (int t = blockIdx.x; t < n_tiles; t += gridDim.x) {
        const int base = (n_tiles - 1 - t) * St::IPB;
        fill_items<T, false, St::IPB>(pr, sm.lvl, base, n_items, St::IPB, sm.item);
        __syncthreads();
        agg_load_grad_output<T, G>(sm, gout, C, g, local, base, n_items);
        const int p_end = (int)((int64_t)LP * (blockIdx.y + 1) / gridDim.y);
        for (int p0 = (int)((int64_t)LP * blockIdx.y / gridDim.y); p0 < p_end; p0 += St::K) {
            const int kn = p_end - p0 < St::K ? p_end - p0 : St::K;
            stage_chunk<T, false, OPT, St, P>(pr, sm.lvl, sm.item, base, n_items, p0, kn, sm.offs,
                                              sm.geo);
            __syncthreads();
            agg_file_corners<G>(sm, lane);
            __syncthreads();
            const int nent = sm.nent;
            agg_sort_entries<G>(sm, nent, lane);
            agg_walk<T, G, DET, FULL>(pr, sm, nent, point_grads, det_acc, scale);
            __syncthreads();
            agg_clear_table<G>(sm, nent);
            if (point_grads)
                agg_point_gradients<T, P, OPT, G>(pr, sm, base, n_items, LP, p0, kn,
                                                  grad_loc, grad_attn, nearest);
            if (threadIdx.x == 0) sm.nent = 0;
            __syncthreads();
        }
    }
}
