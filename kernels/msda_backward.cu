/* kernels/msda_backward.cu: MSDA backward on CUDA.
 *
 * With g = grad_out[b,q,h,:], s = bilinear sample of (b,q,h,l,p), A its weight, (fx, fy) its
 * in-cell fraction and v0..v3 its corners (k = 2*dy + dx):
 *   grad_A        = sum_c g[c] * s[c]
 *   grad_loc_x    = A * W_l * sum_c g[c] * ((1-fy)(v1-v0) + fy(v3-v2))[c]
 *   grad_loc_y    = A * H_l * sum_c g[c] * ((1-fx)(v2-v0) + fx(v3-v1))[c]
 *   grad_value[corner k] += A * w_k * g          (scattered with atomics)
 * Three kernels. Encoders (Q * NP >= 2 * S, C >= 16; not deterministic with softmax):
 *   msda_backward_agg, which first merges the corners of a block's points that fall on the
 *   same value row (see its comment), so each distinct row is loaded and atomically updated
 *   once per block; where the queries are the value's pixels, a block takes a tile of them
 *   (common.cuh, tiled_query; v27).
 * Thread map (fast path, as in msda_forward.cu; items head-major): a group of G = C / 4 threads
 *   per (b, q, h), 4 channels each; the block stages the geometry of K points per item in
 *   shared memory; each
 *   group gathers the 4 corners, scatters A * w_k * g into grad_value with 16-byte vector
 *   atomics (sm_90 red.global.add.v4.f32; 4 scalar atomics before sm_90), reduces its
 *   three per-point sums over the G lanes with shuffles, and parks them in shared memory; the
 *   block then writes the location and weight gradients coalesced, one thread per point.
 *   Generic path (f64, other C, unaligned pointers): one warp per (b, q, h), lane j owns channels
 *   j, j+32, ...; warp-shuffle sums written by lane 0.
 *   grad_value is zeroed on the same stream first (cudaMemsetAsync; with sm_90 code, for the
 *   aggregated kernel and for the plain per-point kernel with sliced points, zero_kernel and a
 *   programmatic dependent launch, v39 and v43); it is the only
 *   output written with atomics (so its summation order, and its last bits, vary from run to
 *   run).
 * Options (both paths): per-level point counts (level of a point from pr.point_start), nearest
 *   sampling (one corner of weight 1, location gradient 0), fused softmax (each item's logit
 *   maximum and 1 / sum(exp) first, by its warp or group, in a fixed order; the logit gradient
 *   A_j * (dL/dA_j - sum_k A_k dL/dA_k) needs every dL/dA of the item, so they are parked in
 *   grad_attention_weights and rewritten by the same warp or group at the end of the item).
 * MSDA_DETERMINISTIC: grad_value accumulates as 64-bit fixed point in the caller's workspace
 *   (common.cuh: scan kernel for the scale, the same fast or generic kernel with integer
 *   atomics, a convert kernel). Integer sums do not depend on the order, so runs are bitwise
 *   equal; the point gradients never used atomics. In the fast kernel the integer atomics of a
 *   group go to consecutive words (thread g owns channels g, g+G, g+2G, g+3G for them).
 *   Tried (H200, ddetr_enc backward, f32 / bf16, default 0.76 / 0.79 ms "realistic"):
 *   d1 thread-owned 4 consecutive channels, double-precision scaling: 8.1 / 8.0 ms (uniform
 *      locations, vs 1.18 / 1.11 default on an H100): each warp-wide 64-bit atomic touched 8
 *      sectors
 *   d2 channels g + j*G per thread, so a group's atomics cover whole sectors: 3.14 / 3.14 ms
 *      (uniform, vs 1.06 / 0.92)
 *   d3 d2 scaling in float (exact: the scale is a power of two <= 2^100): 2.62 / 2.50 ms
 *      realistic (3.4x / 3.2x the default) <- shipped. 64-bit integer atomics have no vector
 *      form, and there are 4x as many as the default's 16-byte f32 ones, of twice the bytes.
 *   H100, same run: ddetr_enc 2.96 / 2.86 ms against the default's 0.95 / 0.95 (3.1x / 3.0x);
 *   dino_dec900 0.280 / 0.288 ms against 0.085 / 0.102.
 * Options cost: the fast kernels are compiled twice, with and without the option code (OPT),
 *   because with it inlined the plain backward spilled and slowed from 0.885 to 1.078 ms
 *   (ddetr_enc f32, H100). Compiled out, the plain backward still measures 0.913 against the
 *   0.884 ms of the kernel before the options existed (same run, repeated), cause not found.
 * Numerics: f32 accumulation for f32/f16/bf16, f64 for f64. A half type's grad_value (v30):
 *   in code for sm_90 and newer the f32 sums go into grad_value itself with half-precision
 *   vector atomics (red.global.add.noftz.v4.bf16x2 / .f16x2: 8 channels, 16 bytes; in the
 *   aggregated kernel one per merged row and block, in the others one per corner), each sum
 *   rounded once as it is added; older code accumulates in an f32 buffer in the workspace and a
 *   last kernel converts it. Deterministic: fixed point, converted once (one rounding).
 * Tried (H100, torch 2.11, CUDA events, backward alone incl. the grad_value memset (and the
 * f32 -> bf16 cast); "realistic" inputs unless said; f32 / bf16):
 *   v1 generic kernel, warp per (b, q, h), scalar atomics: ddetr_enc fwd+bwd (uniform
 *      locations) 4.153 / 4.145 ms
 *   v2 fast path, 16-byte loads (8 channels a thread in half precision): ddetr_enc 0.876 /
 *      0.867 ms; with scalar instead of vector atomics (an sm_75 build run on sm_90): 3.2 ms
 *   v3 4 channels a thread for every type, 32-bit geometry as in the forward: ddetr_enc
 *      0.875 / 0.861 ms, rtdetr_dec_b8 0.115 / 0.146 ms
 *   v4 v3 capped at 5 blocks per multiprocessor: rtdetr_dec_b8 0.103 / 0.134 ms <- shipped
 *      (ddetr_enc 0.875 / 0.867 ms, dino_dec900 0.081 / 0.098 ms)
 *   v5 v4 split in two launches, one for the point gradients (loads only) and one that only
 *      scatters into grad_value (atomics only): ddetr_enc 1.170 / 1.295 ms. The scatter pass
 *      alone takes ~0.9 ms: the 2.3 GB of f32 vector atomics bound the backward.
 *   v6 v4 with 8 staged points per item instead of 16 (half the shared memory, more L1):
 *      ddetr_enc 0.885 / 0.916 ms, no gain.
 *   ncu (v2, ddetr_enc f32): L2 at 87% of its throughput, 71 M sectors of atomics and 60 M of
 *   loads missing L1 (23% L1 hits, against 46% in the forward): the atomics bound it. Reaching
 *   0.5 ms needs fewer atomics (a gather formulation of grad_value, or aggregation in shared
 *   memory), not a faster version of this kernel.
 *   Aggregation (H100, one bench run per line unless said; ddetr_enc f32 / bf16, m2f_enc f32):
 *   a simulation of realistic ddetr_enc locations counted, per block of consecutive queries of
 *   one head, corners / distinct rows = 2.7 (8 queries), 3.65 (32), 4.35 (128); the
 *   query-major blocks of v4 (4 queries x 8 heads) share almost none.
 *   v7 v4 with head-major items: 0.892 / 0.946, m2f 0.729 (v4 same run: 0.952 / 0.949, 0.799)
 *   v8 hash table per chunk, one group per distinct row sums A * w_k * g and issues the atomics;
 *      the corners still loaded per point for the point gradients: 0.696 / 0.744, m2f 0.631;
 *      decoders unchanged (dino_dec900 0.088 vs 0.086)
 *   v9 v8, rows also loaded once: the walk computes each slot's g . row and the point gradients
 *      come from those dots: 0.733 / 0.775 (ncu: 80% SM throughput, issue-bound: 4-lane groups
 *      redo the weight arithmetic per slot, 3 shuffles a slot)
 *   v10 v9 with the coefficient computed once when the slot is filed and 8 channels a lane in
 *      the walk (G / 2 lanes a row): 0.603 / 0.621, m2f 0.561 (v8 same run: 0.695 / 0.743)
 *   v11 v10 with the item rows computed once per block (no divisions per point) and the two
 *      walkers of a quarter warp reading s_go from different banks: 0.583 / 0.594 / f16 0.594,
 *      m2f 0.542 (v4 same run: m2f 0.769). ncu: 684 us at 1.6 GHz, issue 0.73 per scheduler,
 *      L1/shared 80%, L2 63%, 22 of 32 lanes active: the walk loop was 52% of the instructions,
 *      half of its steps idle (slot lists of different lengths in one warp) and each step
 *      paying a convergence check for the group shuffle.
 *      dino_dec900 0.097, rtdetr_dec_b8 0.125 (v4 0.083, 0.105): decoders keep v4
 *      (aggregates()).
 *   v12 v11 with the rows sorted by list length (counting sort, longest first) and warp-uniform
 *      walk loops (full-mask shuffles): 0.547 / 0.567, m2f 0.526 / 0.550 (v11 same run: 0.583 /
 *      0.599, 0.545 / 0.562); ncu 624 us at 1.6 GHz, 382 M instructions (v11 416 M), 28.7 of 32
 *      lanes active
 *   v13 v12 with staging and filing merged (a thread per point), a 1.5x table and {A * w_k,
 *      next} packed per slot: 372 M instructions but 0.561 / 0.579 (v12 same run 0.546 / 0.566)
 *   v14 v12 with only the packing: 0.592 / 0.610: 44.6 KB of shared memory leaves 4 blocks per
 *      multiprocessor instead of 5 (with 4 blocks and 64 registers: 0.586)
 *   v15 v12 with half the points per chunk (K = 4 for C = 32: 25 KB of shared memory), 5 or 6
 *      blocks per multiprocessor: ddetr_enc 0.605 / 0.580, m2f_enc 0.527 / 0.501 (v12 same run
 *      0.547, 0.527): a chunk then holds one level, and ddetr_enc loses more than m2f gains
 *   v17 v12 with s_go read as float4s of the shared array (through a generic pointer the
 *      compiler recomputed shared addresses in every step of the walk: 66 instructions a step)
 *      and an instantiation for "every gradient wanted" whose walk tests no pointer: ddetr_enc
 *      0.550 -> 0.532 / bf16 0.570 -> 0.547, m2f_enc 0.530 -> 0.510 (same run) <- shipped
 *   v16 MSDA_DETERMINISTIC through the aggregated kernel too (fixed-point sums in the walk, one
 *      integer atomic per row and channel): ddetr_enc 3.088 -> 1.600 ms / bf16 2.956 -> 1.613,
 *      m2f_enc 2.678 -> 1.564 (2.8-3.0x the default backward, was 5.2-5.6x); decoders keep the
 *      per-point kernel (dino_dec900 0.280, rtdetr_dec_b8 0.381: 3.3-3.6x).
 *   v18 v17 with a hash table of NS positions instead of 2 * NS (37.4 instead of 45.6 KB of
 *      shared memory a block, so the 5 resident blocks leave the L1 about 60 KB): ddetr_enc
 *      0.535 / 0.550, m2f_enc 0.514 / 0.533 (v17 in the same run, alternated: 0.532 / 0.546,
 *      0.509 / 0.529); uniform locations 1.229 vs 1.222 ms. The walk does not profit from L1.
 *   v19 v17 capped at 4 blocks per multiprocessor (56 registers instead of 48): 0.576 / 0.591,
 *      m2f 0.550 / 0.571: the lost warps cost more than the registers gain.
 *   v20 v18 with 6 blocks per multiprocessor (40 registers: 32 bytes of spills): 0.536 / 0.551,
 *      m2f 0.508 / 0.529: even.
 *   v21 v17 with the aggregated kernel's shared arrays in one struct (one base address: with
 *      separate arrays the compiler, at 48 registers, rebuilt each one's shared-window address
 *      inside the walk loop; the loop went from 59 to 47 instructions a step), offsets used as
 *      unsigned (one IMAD.WIDE.U32 an address) and bf16 widened by a shift or a mask: ddetr_enc
 *      f32 / bf16 0.532 / 0.547 -> 0.525 / 0.534 ms, m2f_enc 0.508 / 0.528 -> 0.499 / 0.515;
 *      decoders unchanged; deterministic 1.599 -> 1.610 (its instantiations now spill 8 bytes)
 *      (v17 alternated in the same session). The kernel is as much bound by L1 / shared-memory
 *      throughput (ncu: 81%) as by issue, so fewer instructions gained little.
 *      The forward's opaque register-pair pointer (msda_forward.cu v9) here: 8-32 bytes of
 *      spills in the per-point and aggregated kernels; not used.
 *   v22 grad_value zeroed by a kernel of one block per multiprocessor that lets the backward
 *      kernel start at once (programmatic dependent launch, griddepcontrol.wait before the first
 *      atomic), and msda_backward_fast's point loop split in two (loads and point gradients,
 *      then the atomics, so all of the first runs during the zeroing): dino_dec900 f32 0.083 ->
 *      0.093 ms (the split alone 0.084), rtdetr_dec_b8 0.104 -> 0.102, ddetr_enc 0.525 ->
 *      0.523, m2f_enc 0.504 -> 0.504. ncu of msda_backward_fast at dino_dec900 (63 us at 1.57
 *      GHz): L2 at 70% of its throughput, L1 hits 15%, 0.6 eligible warps a scheduler, 0.68
 *      waves of blocks; more slices of the points (point_slices) do not help there either.
 *      Not shipped. The aggregated kernel on decoders, retried with v21: dino_dec900 0.097 vs
 *      0.084, rtdetr_dec_b8 0.124 vs 0.103.
 *   v23 v21 with the counting sort's bucket counts added once per bucket and warp
 *      (__match_any_sync; lanes adding to one shared word are serialised, 1.2 M excess
 *      wavefronts at ddetr_enc) and each point's four dots read as one float4 (four strided
 *      4-byte reads took four wavefronts each): ddetr_enc f32 / bf16 0.525 / 0.534 -> 0.523 /
 *      0.533 ms, m2f_enc 0.500 / 0.516 -> 0.498 / 0.515; deterministic (its instantiations
 *      no longer spill) ddetr_enc 1.611 -> 1.557, m2f_enc 1.576 -> 1.512 (v21 alternated in the
 *      same session).
 *   v24 v23 with the points of an item cut into chunks of equal size (12 points as 6 + 6
 *      instead of 8 + 4): m2f_enc f32 / bf16 0.501 / 0.518 -> 0.539 / 0.553 ms (ddetr_enc, 16
 *      points as 8 + 8 either way, unchanged). A chunk of one level aggregates better than two
 *      chunks that mix levels. Not shipped.
 *   v25 v23 with every other round of the walk handed to the walkers in reverse order (rows
 *      are sorted longest first, so warp 0 had the longest lists of every round; ncu had 12% of
 *      the warp samples waiting at the barrier after the walk): ddetr_enc f32 / bf16 0.522 /
 *      0.534 -> 0.519 / 0.529 ms, m2f_enc 0.498 / 0.515 -> 0.495 / 0.511, deterministic and
 *      uniform unchanged (v23 alternated in the same session).
 *   v26 decoders' queries sorted first by where they sample (a kernel of one block per batch:
 *      counting sort by the cell of a 64 x 64 grid, Z-order, holding the first point of head 0;
 *      the order in a workspace of 4 bytes a query), so a block's 32 items sample nearby pixels
 *      (simulated: 0.35 distinct rows per corner in a block instead of 0.68 at dino_dec900).
 *      Per-point kernel: dino_dec900 f32 0.083 -> 0.091 ms, rtdetr_dec_b8 0.104 -> 0.109,
 *      ddetr_dec 0.043 -> 0.049; the aggregated kernel on the sorted queries 0.082 / 0.109 /
 *      0.049 (HEAD alternated in the same session). Profiled: the sort kernel takes 4-7 us and
 *      the per-point kernel none the faster (66.0 vs 66.2 us at dino_dec900; its L1 hits were
 *      not what bounds it). Not shipped.
 *   v27 v25 with an encoder's queries (Q == S, levels covering [0, S) in order) taken in tiles
 *      of 4 x 8 pixels per block of 32 items instead of runs of 32 pixels of one row
 *      (common.cuh, tiled_query; computed in fill_items, no memory). Simulated on realistic
 *      inputs: distinct value rows per corner in a block 0.28 -> 0.18 (ddetr_enc), 0.31 ->
 *      0.18 (m2f_enc); 8 x 4 tiles 0.19 / 0.18, 2 x 16 0.20 / 0.22. Measured (H100, alternated
 *      twice with v25 in one session): ddetr_enc f32 / bf16 0.520 / 0.529 -> 0.454 / 0.468 ms,
 *      m2f_enc 0.494 / 0.511 -> 0.440 / 0.457; 8 x 4 tiles: 0.460 / 0.474, 0.444 / 0.461;
 *      uniform ddetr_enc unchanged (1.219 vs 1.219); deterministic ddetr_enc / m2f_enc f32
 *      1.557 / 1.512 -> 1.471 / 1.446 (another run of the same session).
 *   v28 v27 with 64 items a block (two per group; 8 x 8 pixel tiles) and 4 points a chunk
 *      (one level of 4 points: the same 1024 slots), a hash table of NS positions (shared
 *      memory 42.8 KB, 5 blocks a multiprocessor), a count per row, and lists longer than 16
 *      slots walked in segments by several walkers (a simulation of realistic inputs had the
 *      longest list of each warp's walkers bound the walk: ddetr_enc's coarse levels put a
 *      64-query tile's 1024 slots on a few dozen rows). Alternated twice per library in one
 *      session, f32 / bf16 ms:
 *                                           ddetr_enc        m2f_enc
 *        v27                               0.455 / 0.471   0.443 / 0.460
 *        64 items, no segments             0.487 / 0.500   0.417 / 0.429
 *        64 items, segments of 16 <-       0.462 / 0.476   0.390 / 0.406
 *        64 items, segments of 8           0.484 / 0.501   0.413 / 0.431
 *        64 items, segments of 32          0.515 / 0.530   0.437 / 0.454  (with the next line)
 *        64 items, 16, peers of a warp filed with one set of atomics (__match_any_sync, the
 *          lowest lane probes, counts and links them all): 0.489 / 0.504   0.416 / 0.433
 *        32 items, segments of 16          0.461 / 0.477   0.449 / 0.468
 *      uniform ddetr_enc / m2f_enc 1.219 / 1.116 -> 1.121 / 1.075, deterministic 1.470 /
 *      1.444 -> 1.500 / 1.405. m2f_enc's 12 points also fill 3 chunks of 4 where they took
 *      chunks of 8 + 4.
 *   v29 v28 with each slot's coefficient and link in one 8-byte word (ncu of v28, ddetr_enc
 *      f32: L1 / shared memory at 85% of its throughput, 28% of the shared wavefronts excess
 *      (bank conflicts), the walk 44% of the warp samples and filing 17%; the walk read the
 *      coefficient and the link of every slot with two scattered loads): ddetr_enc f32 / bf16
 *      0.462 / 0.477 -> 0.450 / 0.470 ms, m2f_enc 0.390 / 0.406 -> 0.379 / 0.399, uniform
 *      ddetr_enc 1.121 -> 1.119, deterministic 1.508 / 1.412 -> 1.493 / 1.399 (alternated
 *      twice in one session). With it, reading each hash position before the CAS (most rows
 *      are already filed): 0.454 / 0.473, 0.382 / 0.403; that read alone on v28: 0.466 / 0.479.
 *      <- shipped
 *   v30 half types' grad_value accumulated in its own type with vector half atomics (sm_90),
 *      instead of an f32 buffer zeroed first (4 bytes an element) and cast after the kernel
 *      (reads 4, writes 2 bytes an element): bf16 / f16 ms, v29 -> v30, alternated twice in one
 *      session (H100):
 *        ddetr_enc        0.468 / 0.469 -> 0.421 / 0.421
 *        m2f_enc          0.399 / 0.399 -> 0.353 / 0.353
 *        dino_dec900      0.103 / 0.102 -> 0.052 / 0.051
 *        rtdetr_dec_b8    0.138 / 0.137 -> 0.063 / 0.061
 *      The decoders' per-point kernel halves its atomic bytes too (it is bound by L2 traffic).
 *      Cost in precision, relative L2 error of grad_value against f64 on the bench inputs
 *      (bf16 / f16): ddetr_enc 1.7e-3 / 2.1e-4 -> 7.6e-3 / 9.6e-4, m2f_enc -> 5.1e-3 / 6.6e-4,
 *      dino_dec900 -> 5.3e-3 / 6.9e-4, rtdetr_dec_b8 -> 3.5e-3 / 4.4e-4, against the
 *      reference's own (grid_sample in the same dtype) 1.9e-1 / 2.3e-2, 6.6e-2 / 8.2e-3,
 *      1.9e-1 / 2.3e-2 and 1.4e-1 / 1.7e-2: 12 to 40 times smaller still; the point gradients
 *      are unchanged. deterministic=True keeps one rounding per element. <- shipped
 *   v31 v30 with the aggregated kernel's grad_output kept in shared memory in the half type
 *      (8 bytes per 4 channels instead of 16: half the walk's s_go reads, 40.8 instead of 44.9
 *      KB of shared memory), widened as the walk reads it: ddetr_enc bf16 / f16 0.422 / 0.421
 *      -> 0.431 / 0.431 ms, m2f_enc 0.353 / 0.351 -> 0.360 / 0.360 (alternated twice in one
 *      session). The widening's 8 instructions a slot cost more than the shared-memory reads
 *      they save. Not shipped.
 *   v32 v30 with the aggregated kernel's staged points unpadded (StageAgg::STRIDE = K, was
 *      K + 1). ncu of v30 (bf16 ddetr_enc): shared-memory wavefronts are 81% of the L1's data
 *      wavefronts (54.4 M, 39.6 M ideal); the staging's stores, the filing's reads and the point
 *      gradients' reads all take (item, point) from consecutive threads, for which the padding
 *      made 2-way bank conflicts (3.2 M excess wavefronts). ddetr_enc f32 / bf16 0.449 / 0.418
 *      -> 0.445 / 0.415 ms, m2f_enc 0.377 / 0.352 -> 0.374 / 0.349 (alternated twice in one
 *      session). <- shipped
 *      With it, the filing's lanes spread over items 32 apart instead of neighbours (a warp's
 *      shared atomics to one address serialise like bank conflicts; simulated: 3.82 -> 3.51
 *      lanes on the busiest bank): ddetr_enc 0.452 / 0.425, m2f_enc 0.379 / 0.357, slower.
 *   v33 (decoders' per-point kernel, f32) each corner's 128-byte row of contributions written
 *      to shared memory and added by one TMA bulk reduction (cp.reduce.async.bulk .add.f32)
 *      instead of 8 16-byte vector atomics (ncu of dino_dec900: the L2 fabric between the two
 *      L2 halves 68% busy, requests into L2 61%): dino_dec900 0.083 -> 0.105 ms, rtdetr_dec_b8
 *      0.104 -> 0.128, ddetr_dec 0.044 -> 0.051 (alternated twice); ncu: the same 5.2 M
 *      sectors of reductions reach L2, requests into L2 69% busy. Not shipped.
 *   v34 v32 with each walker prefetching the value row of its next round's entry (the walk's
 *      row load was 4.6% of the warp samples, ncu of v32, bf16 ddetr_enc): into L1, ddetr_enc
 *      f32 / bf16 0.444 / 0.415 -> 0.452 / 0.419 ms, m2f_enc 0.373 / 0.348 -> 0.380 / 0.351;
 *      into L2, 0.453 / 0.421, 0.381 / 0.353 (alternated twice in one session). Not shipped.
 *   v35 v32 with the walk's entries claimed by warps as they finish (a shared counter; a warp
 *      takes one entry per walker, longest first) instead of dealt in fixed rounds (the barrier
 *      after the walk held 8% of the warp samples): ddetr_enc 0.456 / 0.428, m2f_enc 0.384 /
 *      0.358 (same session). Not shipped.
 *   v36 v32 with the corners of one item's points that fall on the same row merged before
 *      filing (a simulation of realistic ddetr_enc / m2f_enc inputs: 17% of the slots repeat a
 *      row of an earlier point of their item; the earliest files one slot with the summed
 *      coefficients, the others read its dot for their point gradients): ddetr_enc f32 / bf16
 *      0.446 / 0.417 -> 0.539 / 0.520 ms, m2f_enc 0.375 / 0.350 -> 0.450 / 0.435 (alternated
 *      twice in one session; a first version with 8 bytes of spills: 0.552 / 0.530). The
 *      search of the item's other points (4 offset and up to 3 weight reads per slot in the
 *      filing, 3 per point after the walk) costs far more than the steps it saves; not
 *      profiled. Not shipped.
 *   v37 v32 with the entry sort's rounds skipped by warps that have no entry in them (each
 *      thread looks at up to NS / 256 = 4 entries, one per round, and every round cost a
 *      __match_any_sync and a shuffle per warp; with about a seventh as many rows as slots most
 *      rounds are empty): ddetr_enc f32 / bf16 0.445 / 0.415 -> 0.439 / 0.406 ms, m2f_enc 0.374
 *      / 0.349 -> 0.370 / 0.342 (alternated twice in one session). <- shipped
 *      Without the sort (entries walked in filing order): 0.507 / 0.488, m2f_enc 0.434 / 0.417.
 *      Segments of 12 or 24 slots instead of 16 (MSDA_AGG_CAP) with it: ddetr_enc 0.457 / 0.425
 *      and 0.454 / 0.422 against 0.440 / 0.407, m2f_enc 0.385 / 0.358 and 0.380 / 0.355 against
 *      0.370 / 0.343 (alternated twice in one session).
 *   v38 v37 with every warp taking the bucket sizes' prefix sum itself (one barrier and warp
 *      0's pass fewer per chunk): ddetr_enc f32 / bf16 0.441 / 0.408 -> 0.443 / 0.413 ms,
 *      m2f_enc 0.370 / 0.343 -> 0.372 / 0.346; with grad_output's loads also left in registers
 *      until the first chunk is staged (their wait was 1.7% of the warp samples): 0.447 /
 *      0.421, 0.376 / 0.353 (alternated twice in one session). Not shipped.
 *   v39 v37 with grad_value zeroed by zero_kernel (one block of 64 threads a multiprocessor, which
 *      fits beside the aggregated kernel's 5 blocks) and the aggregated kernel launched as its
 *      programmatic dependent (griddepcontrol.wait before the first scatter), so its first
 *      blocks stage, file and sort their first chunk during the zeroing (torch profiler, bf16
 *      ddetr_enc: memset 6.1 us, then 1.2 us idle, then the kernel's 399 us). ms, alternated
 *      twice in one session (H100), f32 / bf16 / f16:
 *        ddetr_enc   0.440 / 0.407 / 0.407 -> 0.437 / 0.404 / 0.404
 *        m2f_enc     0.371 / 0.342 / 0.342 -> 0.367 / 0.339 / 0.339
 *      The wait moved to just before each walker's first scatter (after its first walk): the
 *      same times (0.437 / 0.404). v22 tried this with a zero kernel of 256-thread blocks,
 *      which left room for 4 aggregated blocks a multiprocessor while it ran. <- shipped
 *   v40 v39 with the blocks taking the item tiles last first. An encoder's items end with the
 *      queries of its coarse levels, whose points spread over the finer levels: simulated
 *      (realistic ddetr_enc, 8 x 8 query tiles of one head), distinct value rows per tile
 *      331 / 594 / 1215 / 1912 for queries of levels 0 / 1 / 2 / 3, of ~3900 slots each, so
 *      the last tiles cost the most and made the grid's tail (7.6 waves of blocks). ms,
 *      alternated twice in one session, f32 / bf16:
 *        ddetr_enc   0.437 / 0.404 -> 0.421 / 0.389
 *        m2f_enc     0.368 / 0.339 -> 0.364 / 0.331  <- shipped
 *   v41 (decoders) grad_value gathered instead of zeroed and scattered: msda_backward_fast run
 *      without grad_value (loads and point gradients only), then a band kernel: a block owns
 *      256 consecutive value positions of one (b, h) (f32 sums in 32 KB of shared memory),
 *      scans every point of the band's level for all queries, sorts the corners that fall in
 *      the band by owner group (position % 32, a counting sort, so no two groups share a row
 *      and no atomics are needed), each group adds A * w_k * g into its rows, and the band is
 *      written once, zeros included (no memset; a half type rounded once). Correct (grad_value
 *      against f64: f32 9.1e-8 vs 9.4e-8, bf16 1.7e-3 vs 5.3e-3), but ms, f32 / bf16, the
 *      v40 library alternated twice in one session (H100):
 *        dino_dec900     0.083 / 0.051 -> 0.175 / 0.166  (scan rounds of 256 points)
 *                                      -> 0.165 / 0.168  (points with a corner in the band
 *                                                         collected from 1024 a round first)
 *                                      -> 0.121 / 0.126  (and coarse levels in bands of
 *                                         R/2 .. R/16 positions, <= 2048 corners a band; the
 *                                         plan once a block; 4 grad_output loads in flight)
 *        rtdetr_dec_b8   0.105 / 0.062 -> 0.123 / 0.116 -> 0.118 / 0.116 -> 0.115 / 0.116
 *        ddetr_dec       0.044 / 0.030 -> 0.072 / 0.067 -> 0.072 / 0.070 -> 0.065 / 0.064
 *      torch.profiler, last variant: the loads-only msda_backward_fast 30.6 us (dino_dec900)
 *      / 32.4 us (rtdetr_dec_b8), the band kernel 84.0 / 77.0 us. ncu (rtdetr_dec_b8): 36 M
 *      warp instructions for 0.92 M corners (39 a corner: every band rescans its level's
 *      points, and sorts and walks in rounds), issue slots 46-50% busy, 41% of the warp
 *      cycles waiting at barriers, a third of the blocks empty (the grid is sized on the host,
 *      which does not know the level sizes). An earlier form of the last variant, launched as
 *      a programmatic dependent of msda_backward_fast (to overlap the two; the plan computed
 *      by every thread): dino_dec900 0.124 / 0.133, rtdetr_dec_b8 0.120 / 0.123 (the launch's
 *      own effect not measured apart). Not shipped. A gather can only win with the corners binned
 *      by band as msda_backward_fast computes them (its 31 us plus a band kernel of about
 *      20 us would be about 0.055 ms at dino_dec900), which needs per-band lists somewhere:
 *      the band's own grad_value rows could hold them until the band kernel overwrites them.
 *   v42 v41 with those lists: a kernel of one block per (b, h) zeroes each band's count (the
 *      first word of its first row), a kernel of one thread per point appends the point to
 *      the list of every band its corners fall in (an atomic on the count; the list in the
 *      band's own rows, nb * C - 1 entries at most, a band that overflows scans as in v41),
 *      and the band kernel reads its list instead of scanning. Correct (tests/test_cuda.py,
 *      test_cuda_paths.py and test_backward.py passed with it), but f32 ms, v40 alternated
 *      twice in one session (H100):
 *        dino_dec900 0.083 -> 0.109, rtdetr_dec_b8 0.105 -> 0.114, ddetr_dec 0.044 -> 0.066
 *      torch.profiler (dino_dec900 / rtdetr_dec_b8): count zeroing 3.1 / 2.9 us, binning
 *      16.2 / 14.6 us (a coarse band's ~1900 appends all go through one counter), the
 *      loads-only msda_backward_fast 30.6 / 32.2 us, the band kernel 50.5 / 59.5 us: each
 *      block is a chain of about eight dependent global round trips (plan, count, list,
 *      geometry, sort, grad_output, write) and 4 blocks fit a multiprocessor (48 KB of
 *      shared memory), so the 2300-odd blocks run in 4-5 waves of that latency. Not shipped.
 *      What is left of the idea: msda_backward_fast alone takes half of the 0.060 ms target
 *      and grad_value's single write another 14 us at DRAM speed, so a gather pays only if
 *      the band kernel also takes over the point gradients (the band's value rows loaded once
 *      into shared memory, 41 MB in all instead of msda_backward_fast's 118 MB of gathers,
 *      with partial point gradients combined across bands).
 *   v43 v22 again, with v39's 64-thread zero_kernel: msda_backward_fast's chunk split into its
 *      loads and point gradients, then (after griddepcontrol.wait) its scatter, launched as
 *      zero_kernel's programmatic dependent. ms, alternated twice with v40 in one session
 *      (H100), f32 / bf16:
 *        dino_dec900     0.083 / 0.052 -> 0.089 / 0.056
 *        rtdetr_dec_b8   0.105 / 0.062 -> 0.103 / 0.062
 *        ddetr_dec       0.044 / 0.029 -> 0.043 / 0.026
 *      Split everywhere but with the dependent launch only where the points are sliced
 *      (gridDim.y > 1, point_slices: ddetr_dec), cudaMemsetAsync elsewhere: dino_dec900 0.087
 *      / 0.054, rtdetr_dec_b8 0.106 / 0.063, ddetr_dec 0.043 / 0.026 (v40 0.084 / 0.052,
 *      0.105 / 0.062, 0.044 / 0.029 in the same session): the split alone costs 4% where all
 *      blocks are resident at once (dino_dec900), whose loads and atomics no longer overlap
 *      within a block. Shipped: the split kernel (SPLIT) and the dependent launch for sliced
 *      grids of plain problems only, every other kernel's machine code unchanged (compared
 *      with cuobjdump); on another machine start, alternated twice, f32 / bf16 / f16 ms:
 *        ddetr_dec       0.0438 / 0.0297 / 0.0292 -> 0.0423 / 0.0292 / 0.0292
 *        dino_dec900     0.0834 / 0.0523 / 0.0516 -> 0.0836 / 0.0524 / 0.0514 (same kernels)
 *      The half types' gain at ddetr_dec (12% in the first session) did not repeat there.
 *   v44 (decoders, f32) grad_value gathered by a single kernel that also computes the point
 *      gradients: a block owns a band of up to 256 value positions of one (b, h) and one level
 *      (sized on the device from the level table, about 128 points of the level per band, so
 *      dense coarse levels get short bands), scans that level's Q * P locations, lists the
 *      points with a corner in the band or whose clamped cell lies in it (those it computes the
 *      point gradients of, so each point is written by one block), and writes its grad_value
 *      rows once, zeros included: no memset and no global atomics; a level table that does not
 *      tile [0, S) falls back to bands of 256 positions scanning every level. Correct (tests/
 *      test_cuda_paths.py, test_cuda.py, test_backward.py, test_reliability.py passed with each
 *      form; grad_value f32 error 9.1e-8 vs 9.4e-8), but f32 ms, 4d8c5bc's library alternated
 *      twice in one session (H100), dino_dec900 / rtdetr_dec_b8 / ddetr_dec:
 *        v43                                            0.083 / 0.105 / 0.042
 *        sums in a 32 KB shared tile (float atomicAdd)  0.208 / 0.149 / 0.082
 *        scan in batches of 1024 points, a row pre-test,
 *          locations kept in the list (80 registers)    0.242 / 0.179 / 0.097
 *          the same capped at 64 registers (spills)     0.254 / 0.188 / 0.101
 *        no tile: the band's corners sorted by row (counting sort, integer shared atomics),
 *          each row summed by its G lanes and written once (64 registers, spills)
 *                                                       0.218 / 0.152 / 0.083
 *          the same with 100 registers                  0.268 / 0.192 / 0.100
 *      On sm_90 a shared-memory float atomicAdd is a compare-and-swap loop (ATOMS.CAST.SPIN),
 *      hence the row sort; but the kernel is bound by instructions, not by memory: ncu, row-sort
 *      form, dino_dec900: 264 us, 106 M warp instructions, issue slots 48% busy, L2 28%, against
 *      v43's msda_backward_fast at 62.7 us, 16.8 M instructions, L2 70%. Of the 106 M, the scan
 *      42% (every band rescans its level: each location is read and tested by 36 blocks on
 *      average), the point gradients 24% (1.7 listed entries a point, rounds over all of them
 *      with only the owners working), the row sums 13%, the band plan computed by every thread
 *      9%. Even without the scan and the plan, the gather would execute about three times the
 *      per-point kernel's instructions. Not shipped; with v41 and v42 the third gather that
 *      loses to zeroing and scattering on this GPU.
 *   v45 (decoders, f32) msda_backward_fast with 2 channels a thread (G = C / 2: 16 lanes an
 *      item at C = 32, 8-byte loads and red.global.add.v2.f32 atomics, twice the warps; ncu of
 *      v43 at dino_dec900: 42% achieved occupancy, 0.59 eligible warps a scheduler, L2 70%).
 *      f32 ms, 4d8c5bc's library alternated twice in one session (H100), dino_dec900 /
 *      rtdetr_dec_b8 / ddetr_dec:
 *        v43                                     0.0833-0.0840 / 0.1045 / 0.0423-0.0425
 *        2 channels everywhere (sliced too)      0.0834 / 0.1007-0.1008 / 0.0433-0.0436
 *        2 channels where the points are not sliced (ddetr_dec keeps v43's split kernel)
 *                                                0.0837-0.0838 / 0.1010 / 0.0423-0.0425
 *      dino_dec900 is bound by the L2 (same bytes either way); rtdetr_dec_b8 gains 3% (one v43
 *      ddetr_dec time of that run read 0.36 ms, a one-off left out above). <- shipped
 *      (plain f32 decoders with unsliced points; half types and the options keep 4 channels)
 *   v46 (decoders, f32) the coarse levels' grad_value rows summed in shared memory: the last
 *      levels whose rows of one (b, h) fit a block (<= 128 KB, R * C * 4 bytes) and are sampled
 *      densely (>= 8 corners a row and (b, h): dino_dec900's levels 2 and 3, 15 and 58 corners
 *      a row; rtdetr_dec_b8's level 2, 12) went to a kernel of one block per (b, h, level,
 *      chunk of queries) that added each corner's share into its rows in shared memory (lane g
 *      of a warp's i-th group on channel 4g + (k + i) % 4, so no bank conflicts) and the rows
 *      into grad_value once per block with 16-byte atomics; msda_backward_fast took only the
 *      points of the levels before them (the cut computed by every block from the level
 *      table). Correct (gradients against f64 within 2.3e-7 on seven decoder shapes: C = 16,
 *      32, 64, points outside, every level coarse, a 1 x 1 level). torch.profiler on an H200,
 *      us, dino_dec900 / rtdetr_dec_b8:
 *        v45                        zeroing 9.6 / 16.1, msda_backward_fast 56.3 / 60.0
 *                                   (bench 0.071 / 0.082 ms)
 *        v46, float atomicAdd into shared memory, 256 threads, 128 KB a block:
 *                                   msda_backward_fast 37.4 / 47.4, coarse 120.8 / 63.1
 *        the 16 sums of a point read, added and swapped at once (atomicCAS, atomicAdd only
 *          for a lost race), 512 threads, levels <= 32 KB in a launch of 32 KB blocks:
 *                                   37.6 / 47.9, coarse 80.5 / 51.6 (bench 0.131 / 0.123 ms)
 *        the same at 64 registers (224 bytes of spills): coarse 112.1 / 75.8
 *      On sm_90 a float atomicAdd to shared memory is a compare-and-swap loop (ATOMS.CAST.SPIN)
 *      and consecutive ones run one after another; the coarse blocks (124 registers, up to 128
 *      KB) run one a multiprocessor, each point a chain of dependent round trips. The split
 *      cannot reach the targets even with a free coarse kernel: the coarse levels are half the
 *      points but a third of msda_backward_fast's time (their rows are reused in L1 and L2), and
 *      zeroing + the fine levels + the ~6 us the bench adds would be about 53 / 70 us on the
 *      H200 (0.75x / 0.84x of v45), about 0.062 / 0.086 ms scaled to the H100's v45 (targets
 *      0.060 / 0.070). Not shipped.
 *   v47 (decoders) grad_value zeroed and scattered one slice of batches at a time (each slice's
 *      zeroing, then the backward kernels on that slice, so the zeroed lines would still sit in
 *      the L2 when the atomics reach them). ncu of v45's msda_backward_fast (H100): dino_dec900
 *      64.1 us, DRAM 52 MB read and 9.2 MB written (28.5% of its peak), L2 69% busy;
 *      rtdetr_dec_b8 66.2 us, DRAM 68 + 17 MB (38%), L2 70%: the L2, not DRAM, bounds it, and
 *      smaller slices only make smaller grids. Bench f32 ms, dino_dec900 / rtdetr_dec_b8: H200,
 *      v45 0.072 / 0.084, slices of 12 MB of value (one batch each) 0.077 / 0.158, of 24 MB
 *      (one / two batches) 0.077 / 0.101 (bf16 0.048 / 0.053 -> 0.048 / 0.071); H100, v45 0.083
 *      / 0.101, 24 MB slices 0.086 / 0.110 (alternated twice). Not shipped.
 *   v48 (decoders, f32) grad_value gathered by tiles of value rows: no memset, no global atomic
 *      (kernels/tried/backward_tiles_t2.patch, a kernel of its own). A task is (b, h, level, band
 *      of pixel rows), about two blocks a resident slot, cut into sub-tiles of <= 1536
 *      positions; a block scans the level's points (a window on y, then the candidates queued a
 *      warp and located 32 at a time), lists those with a corner in the sub-tile (the owner: the
 *      sub-tile of the first inside corner), writes the owners' point gradients, counts the
 *      corners per position (32-bit shared atomics, native), prefix-sums, files them as {A *
 *      w_k, item row}, and a group per position sums A * w_k * g and stores the row once
 *      (zeros included); a full list is flushed and the scan goes on. Correct (gradients within
 *      1e-7 of f64 at dino_dec900; tests/test_cuda_paths.py's decoder cases, lists overflowing
 *      many times included; compute-sanitizer racecheck clean) but slow. H200 (this session's
 *      device), f32 ms, v45 alternated twice in one session, dino_dec900 / rtdetr_dec_b8 /
 *      ddetr_dec:
 *        v45                                                     0.071 / 0.082 / 0.035
 *        t1, a y window then locate32 in every lane, one query a thread, grad_output staged
 *          in shared memory, 3 blocks a multiprocessor (80 registers)
 *                                                                0.185 / 0.129 / 0.068
 *          the same at 4 blocks (64 registers, 260 bytes of spills) 0.228 / 0.134 / 0.083
 *        t1 with the candidates of the window queued a warp and located 32 at a time
 *                                                                0.159 / 0.116 / 0.064
 *          at 4 blocks                                           0.200 / 0.122 / 0.076
 *        t2, 4 queries a thread, owners and others listed apart (768 slots), grad_output read
 *          through L1 by the row sums                            0.167 / 0.126 / 0.089
 *          one task a resident slot (fewer rescans)              0.177 / 0.148 / 0.082
 *          2 blocks a multiprocessor (119 registers, no spill)   0.195 / 0.151 / 0.083
 *      ncu, SASS-level counts (dino_dec900 sizes, locations uniform in [0.05, 0.95]; the bench's
 *      realistic ones ranked the last two the other way): t2 116 us, 37.1 M warp instructions at
 *      0.47 issued a scheduler and cycle: scan 12.8 M, owners' point gradients 12.8 M, row sums
 *      9.1 M (t1 with queues 146 us, 50.7 M; t1 205 us, 62.4 M). The point gradients alone cost
 *      about what msda_backward_fast executes in all (16.8 M with its atomics), so finding the
 *      points of a tile and sorting their corners by row costs more than the atomics and the
 *      memset they replace. The fourth gather that loses (v41, v42, v44). Not shipped.
 *   v49 (decoders, f32) v45 with L2 eviction hints, so that the zeroed lines of grad_value stay
 *      in the L2 for the atomics: grad_value zeroed by stores with an evict_last policy
 *      (createpolicy; instead of cudaMemsetAsync) and the 8-byte atomics with it
 *      (red.global.add.L2::cache_hint.v2.f32); also with the value gathers evict_first. H200,
 *      alternated twice in one session: dino_dec900 0.072 -> 0.074 (with evict_first gathers
 *      0.072), rtdetr_dec_b8 0.082-0.083 -> 0.087-0.088 (0.085). Not shipped.
 *   v50 (decoders, f32) v45 with the corners of an item's points that fall on one grad_value row
 *      merged before the scatter (a simulation of the realistic inputs: 17% of dino_dec900's
 *      and rtdetr_dec_b8's inside corners repeat a row of another point of their item and
 *      level): the staging thread of each point exchanged its offsets and A * w_k with the
 *      three other lanes of its quad (one level's 4 points) by shuffles, the quad's lowest lane
 *      holding a row scattered the quad's summed coefficient for it and the others skipped
 *      that atomic (merged coefficients in a fourth shared array, an owner mask in s_geo.w).
 *      Correct (test_cuda_paths, test_backward, test_reliability passed with it), but H100,
 *      alternated three times in one session, f32 ms: dino_dec900 0.084 -> 0.093, rtdetr_dec_b8
 *      0.101 -> 0.105, ddetr_dec 0.042 -> 0.042 (24 shuffles and 48 compares a staged point,
 *      8 bytes of spills). As with v36 in the aggregated kernel, finding the repeats costs
 *      more than the atomics they save. Not shipped.
 *   v51 (decoders, f32) v45 software-pipelined: point k + 1's gathers issued before point k's
 *      atomics, sums and shuffles (the loop was one dependent round trip of the gathers a
 *      point). H100, f32 ms, dino_dec900 / rtdetr_dec_b8, each form alternated twice with v45
 *      in one call (v45's times of the same call in brackets):
 *        point k + 1 wholly in registers, 48 registers (8 bytes spilled):
 *          0.0812-0.0815 / 0.1010-0.1016 [0.0834 / 0.1008-0.1010]
 *        the same, 4 blocks a multiprocessor (60 registers):
 *          0.0787-0.0798 / 0.1027-0.1031 [0.0834-0.0840 / 0.1008-0.1013]
 *        the same with v43's 4 channels a thread, 64 / 48 registers (24 / 136 bytes spilled):
 *          0.090 / 0.114, 0.153 / 0.186
 *        only point k + 1's gathered corners carried, the rest of point k read again from
 *        shared memory (48 registers, no spills), in two calls:
 *          0.0792-0.0794 / 0.0998-0.0999 [0.0840-0.0844 / 0.1013-0.1015]
 *          0.0812-0.0820 / 0.0991-0.0993 [0.0846-0.0847 / 0.1010-0.1013]
 *        that with 4 blocks (52 registers) 0.0803-0.0804 / 0.1018-0.1022; with 6 (40
 *        registers, 32 bytes spilled) 0.133 / 0.140; gathering two points ahead, 48
 *        registers (24 bytes spilled) 0.092 / 0.108, 4 blocks (60 registers) 0.081 / 0.102
 *      torch.profiler (the first form): the kernel alone, dino_dec900 66.4 -> 63.1 us,
 *      rtdetr_dec_b8 76.5 -> 76.4 us, the zeroing 12 / 21 us. A scan of dino_dec900's Q with
 *      v45 (bench times, zeroing included): 1.00 waves of blocks (Q = 660) 64.3 us, 1.36
 *      (Q = 900) 82.5, 2.00 (Q = 1320) 97.2, 3.00 (Q = 1980) 127.1, about 46 ns a query at the
 *      margin: even a grid without a partial last wave would leave dino_dec900 near 0.075 ms,
 *      not 0.060. <- shipped (the carried-corners form; plain f32 decoders with unsliced
 *      points, as v45)
 *   v52 (decoders, half types) v51's pipelining in the 4-channel per-point kernel, the next
 *      point's corners carried as their raw 8-byte words and widened only when used (widened at
 *      the gather, the loop would wait for the loads there); the f32 kernel's corners through
 *      the same code (its machine code reordered, same instruction count). H100, alternated
 *      twice in one call, ms, dino_dec900 / rtdetr_dec_b8:
 *        bf16  0.0514-0.0518 / 0.0626-0.0632 -> 0.0479-0.0483 / 0.0628-0.0630
 *        f16   0.0511-0.0516 / 0.0611-0.0612 -> 0.0610-0.0613 / 0.0719-0.0721 (24 bytes of
 *              spills; bf16 8)
 *        f32   0.0783-0.0784 / 0.0990 -> 0.0784-0.0785 / 0.0991-0.0992
 *      f16 widened a word at a time inside the sums instead (8 bytes of spills), alternated
 *      twice in another call: 0.0512-0.0514 / 0.0615-0.0616 -> 0.0479-0.0483 / 0.0628-0.0631
 *      (bf16 unchanged, the same code): mixed, not shipped.
 *      <- shipped for bf16 (f16 keeps v45's loop)
 *   v53 (decoders, f32) the aggregated kernel on decoders again, with its points sliced over
 *      gridDim.y (3 or 4 slices: 3-4x the blocks; its 64-query blocks filled a third of the
 *      resident slots; 4 slices are one level each at dino_dec900, 3 at rtdetr_dec_b8) and on
 *      queries ordered first by where they sample (the bench's inputs permuted along Q by the
 *      Z-order of each query's mean location on a 64 x 64 grid, in Python: the best a sort
 *      kernel could give, minus its time). H100, ms, one call
 *      (a library with the choice behind a variable), random / sorted queries:
 *                                dino_dec900       rtdetr_dec_b8
 *        shipped (v52), twice    0.077 / 0.076     0.099 / 0.098
 *                                0.078 / 0.078     0.099 / 0.102
 *        aggregated, unsliced    0.136 / 0.095     0.139 / 0.109
 *        aggregated, 3 slices    0.128 / 0.101     0.132 / 0.118
 *        aggregated, 4 slices    0.100 / 0.094-0.105   0.144-0.152 / 0.128
 *      (two 4-slice runs: outliers of 0.23 and 0.52 left out). Sorting alone leaves the
 *      shipped kernel where it was (as in v26); with the aggregated kernel it gains 20-30%
 *      but stays 11-22% above the per-point kernel, and slicing does not pay. Not shipped.
 *   Uniform locations (no reuse, the worst case): ddetr_enc 1.224 ms against v4's 0.835 (m2f
 *   1.123 vs 0.676): where rows do not repeat, the table is pure overhead. Trained models keep
 *   their offsets local (the realistic distribution), so encoders take v12.
 */
#include <type_traits>

#include "common.cuh"

// ---------------------------------------------------------------------------------------------
// helpers

/* Half-precision grad_value accumulated in its own type where the code is built for sm_90 or
 * newer, which has vector reductions of packed f16x2 / bf16x2 (red.global.add.noftz.v2 / .v4):
 * N f32 sums, each rounded once, go to N consecutive channels with one 8- or 16-byte
 * reduction. Older code accumulates in an f32 buffer (the workspace) that a last kernel
 * converts. The host asks which code runs on a device with sm90_code(). */
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define MSDA_NATIVE_HALF 1
#else
#define MSDA_NATIVE_HALF 0
#endif
template <typename T> struct IsHalf {
    static constexpr bool value = std::is_same<T, __half>::value ||
                                  std::is_same<T, __nv_bfloat16>::value;
};
/* DET sums in fixed point whatever the type (its convert kernel writes grad_value) */
template <typename T, bool DET> struct NativeHalf {
    static constexpr bool value = MSDA_NATIVE_HALF && !DET && IsHalf<T>::value;
};

__device__ __forceinline__ unsigned pack2(const __nv_bfloat16 *, float a, float b) {
    const __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
    return *reinterpret_cast<const unsigned *>(&h);
}
__device__ __forceinline__ unsigned pack2(const __half *, float a, float b) {
    const __half2 h = __floats2half2_rn(a, b);
    return *reinterpret_cast<const unsigned *>(&h);
}
__device__ __forceinline__ unsigned pack2(const float *, float, float) { return 0; }

template <typename T, int N> __device__ __forceinline__ void red_half(T *p, const float (&v)[N]) {
    static_assert(N == 4 || N == 8, "4 or 8 channels");
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    unsigned w[N / 2];
#pragma unroll
    for (int i = 0; i < N / 2; i++) w[i] = pack2(p, v[2 * i], v[2 * i + 1]);
/* one 16-byte (N = 8) or 8-byte (N = 4) reduction of packed pairs of type PAIR */
#define MSDA_RED_PAIRS(PAIR)                                                                     \
    do {                                                                                         \
        if constexpr (N == 8)                                                                    \
            asm volatile("red.global.add.noftz.v4." PAIR " [%0], {%1, %2, %3, %4};" ::"l"(p),    \
                         "r"(w[0]), "r"(w[1]), "r"(w[2]), "r"(w[3]) : "memory");                 \
        else                                                                                     \
            asm volatile("red.global.add.noftz.v2." PAIR " [%0], {%1, %2};" ::"l"(p), "r"(w[0]), \
                         "r"(w[1]) : "memory");                                                   \
    } while (0)
    if constexpr (std::is_same<T, __nv_bfloat16>::value) MSDA_RED_PAIRS("bf16x2");
    else if constexpr (std::is_same<T, __half>::value) MSDA_RED_PAIRS("f16x2");
#undef MSDA_RED_PAIRS
#else
    (void)p, (void)v; /* not compiled in: NativeHalf is false before sm_90 */
#endif
}

/* Programmatic dependent launch (sm_90 and newer, v39): the aggregated backward is launched as
 * a dependent of zero_kernel, which zeroes grad_value, so its blocks start their first chunk
 * (staging, filing, sort) while grad_value is being zeroed; griddepcontrol.wait, before the
 * first scatter, holds them until zero_kernel has finished and its stores are visible. In code
 * built for older architectures the wait is compiled out and the host uses cudaMemsetAsync. */
__device__ __forceinline__ void grid_dep_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

/* grad_value = 0, 16 bytes a store, by a grid resident at once whose blocks let the dependent
 * kernel launch at their start. MSDA_ZERO_THREADS threads a block, one block a multiprocessor:
 * small enough to sit beside the 5 blocks of the aggregated kernel (their registers leave
 * 4096 free), so that kernel runs at full occupancy while the zeroing goes on. */
#define MSDA_ZERO_THREADS 64
__global__ void __launch_bounds__(MSDA_ZERO_THREADS) zero_kernel(float4 *p, int64_t n16) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;");
#endif
    const float4 z = make_float4(0.f, 0.f, 0.f, 0.f);
    const int64_t stride = (int64_t)gridDim.x * MSDA_ZERO_THREADS;
    int64_t j = (int64_t)blockIdx.x * MSDA_ZERO_THREADS + threadIdx.x;
    for (; j + 3 * stride < n16; j += 4 * stride) /* four stores in flight a thread */
        p[j] = z, p[j + stride] = z, p[j + 2 * stride] = z, p[j + 3 * stride] = z;
    for (; j < n16; j += stride) p[j] = z;
}

// ---------------------------------------------------------------------------------------------
// kernel

/* DET: grad_value goes to the workspace's 64-bit fixed-point accumulator (see common.cuh).
 * Half types: grad_value is T with NativeHalf (one 2-byte atomic a channel and corner), else the
 * f32 buffer the host put in its place. */
template <typename T, bool DET>
__global__ void __launch_bounds__(256) msda_backward_kernel(msda_problem pr) {
    typedef typename AccOf<T>::type Acc;
    constexpr bool NATIVE = NativeHalf<T, DET>::value;
    const T *value = (const T *)pr.value;
    const T *loc = (const T *)pr.sampling_locations;
    const T *attn = (const T *)pr.attention_weights;
    const T *gout = (const T *)pr.grad_output;
    Acc *grad_value = (Acc *)pr.grad_value;
    T *grad_loc = (T *)pr.grad_sampling_locations;
    T *grad_attn = (T *)pr.grad_attention_weights;
    const bool point_grads = grad_loc || grad_attn;
    const bool nearest = pr.flags & MSDA_NEAREST, softmax = pr.flags & MSDA_SOFTMAX;
    const int64_t H = pr.H, C = pr.C, L = pr.L, Q = pr.Q, NP = pr.NP;
    long long *det_acc = nullptr;
    double scale = 0.0;
    if (DET && grad_value) {
        det_acc = (long long *)((char *)pr.workspace + MSDA_DET_HEADER_BYTES);
        scale = det_scale(pr, (const DetHeader *)pr.workspace);
    }
    const int lane = threadIdx.x & 31;
    const int64_t n_items = pr.B * Q * H;
    const int64_t stride = ((int64_t)gridDim.x * blockDim.x) >> 5;
    for (int64_t qh = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) >> 5; qh < n_items;
         qh += stride) {
        const int64_t b = qh / (Q * H), h = qh % H;
        Acc mx = 0, inv = 1, dot = 0; /* dot: sum over points of A * dL/dA (softmax) */
        if (softmax) softmax_stats<Acc>(attn + qh * NP, NP, lane, mx, inv);
        for (int64_t l = 0; l < L; l++) {
            const int64_t H_l = load_index(pr.spatial_shapes, pr.index_dtype, 2 * l);
            const int64_t W_l = load_index(pr.spatial_shapes, pr.index_dtype, 2 * l + 1);
            const int64_t start = load_index(pr.level_start_index, pr.index_dtype, l);
            const int64_t p_end = level_point_begin(pr, l + 1);
            for (int64_t p = level_point_begin(pr, l); p < p_end; p++) {
                const int64_t i = qh * NP + p;
                Point<Acc> pt;
                const bool hit = generic_point<Acc>(pr, loc, i, H_l, W_l, start, b, h, pt);
                Acc g_attn = 0, g_fx = 0, g_fy = 0;
                const Acc a = attention<Acc>(pr, to_acc(attn[i]), mx, inv);
                if (hit) {
                    for (int64_t c = lane; c < C; c += 32) {
                        const Acc g = to_acc(gout[qh * C + c]);
                        Acc v[4];
#pragma unroll
                        for (int k = 0; k < 4; k++) {
                            v[k] = pt.inside[k] ? to_acc(value[pt.off[k] + c]) : (Acc)0;
                            if (!grad_value || !pt.inside[k]) continue;
                            if (DET) det_add(det_acc + pt.off[k] + c, a * pt.w[k] * g, (Acc)scale);
                            else if constexpr (NATIVE)
                                atomicAdd((T *)pr.grad_value + pt.off[k] + c,
                                          from_acc<T>(a * pt.w[k] * g));
                            else atomicAdd(grad_value + pt.off[k] + c, a * pt.w[k] * g);
                        }
                        if (point_grads) {
                            g_attn += g * (pt.w[0] * v[0] + pt.w[1] * v[1] + pt.w[2] * v[2] +
                                           pt.w[3] * v[3]);
                            g_fx += g * (((Acc)1 - pt.fy) * (v[1] - v[0]) + pt.fy * (v[3] - v[2]));
                            g_fy += g * (((Acc)1 - pt.fx) * (v[2] - v[0]) + pt.fx * (v[3] - v[1]));
                        }
                    }
                }
                if (!point_grads) continue;
                g_attn = warp_sum(g_attn);
                g_fx = warp_sum(g_fx);
                g_fy = warp_sum(g_fy);
                dot += a * g_attn;
                if (lane == 0) {
                    /* with softmax, dL/dA for now; turned into dL/dlogit below */
                    if (grad_attn) grad_attn[i] = from_acc<T>(g_attn);
                    if (grad_loc) { /* a point outside keeps zero gradients whatever its A */
                        const bool moves = hit && !nearest; /* nearest: piecewise constant */
                        grad_loc[2 * i] = from_acc<T>(moves ? a * g_fx * (Acc)W_l : (Acc)0);
                        grad_loc[2 * i + 1] = from_acc<T>(moves ? a * g_fy * (Acc)H_l : (Acc)0);
                    }
                }
            }
        }
        if (softmax && grad_attn) { /* dL/dz_j = A_j * (dL/dA_j - sum_k A_k dL/dA_k) */
            __syncwarp();
            for (int64_t j = lane; j < NP; j += 32) {
                const int64_t i = qh * NP + j;
                const Acc a = attention<Acc>(pr, to_acc(attn[i]), mx, inv);
                grad_attn[i] = from_acc<T>(a * (to_acc(grad_attn[i]) - dot));
            }
            __syncwarp();
        }
    }
}

template <int V> __device__ __forceinline__ void atomic_add_vec(float *p, const float (&v)[V]) {
    if constexpr (V == 2) { /* 8 bytes (v45) */
#if __CUDA_ARCH__ >= 900
        atomicAdd(reinterpret_cast<float2 *>(p), make_float2(v[0], v[1]));
#else
        atomicAdd(p, v[0]), atomicAdd(p + 1, v[1]);
#endif
    } else {
#pragma unroll
        for (int j = 0; j < V; j += 4) {
#if __CUDA_ARCH__ >= 900
            atomicAdd(reinterpret_cast<float4 *>(p + j), make_float4(v[j], v[j + 1], v[j + 2], v[j + 3]));
#else
            atomicAdd(p + j, v[j]), atomicAdd(p + j + 1, v[j + 1]);
            atomicAdd(p + j + 2, v[j + 2]), atomicAdd(p + j + 3, v[j + 3]);
#endif
        }
    }
}

/* Sum over the G lanes of a group (aligned at multiples of G inside the warp). */
template <int G> __device__ __forceinline__ float group_sum(float v) {
#pragma unroll
    for (int o = G / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

/* 4 channels per thread for every type: one 16-byte f32 vector atomic per corner, the pieces of
 * a group contiguous (8 half channels per thread left a warp's atomics half-filling twice as many
 * sectors); plain f32 decoders with unsliced points 2 (VV = 2, G = C / 2: 8-byte loads and
 * atomics, twice the warps; v45), their point loop software-pipelined (PIPE: each point's
 * gathers issued one point ahead; v51), as is that of plain bf16 decoders (v52). 5 blocks per
 * multiprocessor: the register cap costs no spills (sm_75 holds 4). */
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
#define MSDA_BWD_MIN_BLOCKS 4
#else
#define MSDA_BWD_MIN_BLOCKS 5
#endif
/* Staged point k of item `local` (stage_chunk, backward form): its corners' offsets (-1:
 * outside), attention weight A, in-cell fraction and bilinear weights. */
struct StagedPoint {
    int o[4];
    float a, fx, fy, w[4];
};
template <typename St>
__device__ __forceinline__ StagedPoint staged_point(const int4 *s_offs, const float4 *s_geo,
                                                    int local, int k) {
    const int4 o4 = s_offs[local * St::STRIDE + k];
    const float4 geo = s_geo[local * St::STRIDE + k];
    const float fx = geo.y, fy = geo.z;
    return {{o4.x, o4.y, o4.z, o4.w},
            geo.x,
            fx,
            fy,
            {(1.f - fx) * (1.f - fy), fx * (1.f - fy), (1.f - fx) * fy, fx * fy}};
}

/* grad_value[corner] += coef * go over a thread's V channels: half-precision vector atomics
 * into grad_value itself (NATIVE) or 16-byte f32 ones. */
template <typename T, bool NATIVE, int V>
__device__ __forceinline__ void scatter_corner(float *grad_value, T *grad_value_t, unsigned off,
                                               float coef, const float (&go)[V]) {
    float contrib[V];
#pragma unroll
    for (int j = 0; j < V; j++) contrib[j] = coef * go[j];
    if constexpr (NATIVE) red_half<T, V>(grad_value_t + off, contrib);
    else atomic_add_vec<V>(grad_value + off, contrib);
}

/* The V channels of a point's 4 corners at offsets o4 (zeros for a corner outside, or all
 * zeros where !on). */
template <typename T, int V>
__device__ __forceinline__ void gather_point(const T *value, int4 o4, bool on, float (&v)[4][V]) {
    const int o[4] = {o4.x, o4.y, o4.z, o4.w};
#pragma unroll
    for (int c = 0; c < 4; c++) {
        if (on && o[c] >= 0) {
            load_vec(value + (unsigned)o[c], v[c]);
        } else {
#pragma unroll
            for (int j = 0; j < V; j++) v[c][j] = 0.f;
        }
    }
}

/* A point's sums over its group's channels (v: its corners): {dL/dA, then the x and y location
 * sums before their scaling by A and the level's size}. */
template <int G, int V>
__device__ __forceinline__ float3 point_sums(const float (&go)[V], const float (&w)[4], float fx,
                                             float fy, const float (&v)[4][V]) {
    float s_a = 0.f, s_x = 0.f, s_y = 0.f;
#pragma unroll
    for (int j = 0; j < V; j++) {
        s_a += go[j] * (w[0] * v[0][j] + w[1] * v[1][j] + w[2] * v[2][j] + w[3] * v[3][j]);
        s_x += go[j] * ((1.f - fy) * (v[1][j] - v[0][j]) + fy * (v[3][j] - v[2][j]));
        s_y += go[j] * ((1.f - fx) * (v[2][j] - v[0][j]) + fx * (v[3][j] - v[1][j]));
    }
    return make_float3(group_sum<G>(s_a), group_sum<G>(s_x), group_sum<G>(s_y));
}

/* A point's gathered corners as PIPE carries them to the next iteration: f32 as floats; bf16
 * as the raw 8-byte words, widened only when used (widening at the gather would wait for the
 * loads there, which is what the pipelining avoids; f16 is not pipelined, v52). */
template <typename T, int V> struct Carried {
    float v[4][V];
    __device__ __forceinline__ void gather(const T *value, int4 o4, bool on) {
        gather_point<T, V>(value, o4, on, v);
    }
    __device__ __forceinline__ void widen(float (&out)[4][V]) const {
#pragma unroll
        for (int c = 0; c < 4; c++)
#pragma unroll
            for (int j = 0; j < V; j++) out[c][j] = v[c][j];
    }
};
template <> struct Carried<__nv_bfloat16, 4> {
    uint2 r[4];
    __device__ __forceinline__ void gather(const __nv_bfloat16 *value, int4 o4, bool on) {
        const int o[4] = {o4.x, o4.y, o4.z, o4.w};
#pragma unroll
        for (int c = 0; c < 4; c++)
            r[c] = on && o[c] >= 0 ? __ldg(reinterpret_cast<const uint2 *>(value + (unsigned)o[c]))
                                   : make_uint2(0u, 0u);
    }
    __device__ __forceinline__ void widen(float (&out)[4][4]) const {
#pragma unroll
        for (int c = 0; c < 4; c++) {
            bf16x2_to_float(r[c].x, out[c][0], out[c][1]);
            bf16x2_to_float(r[c].y, out[c][2], out[c][3]);
        }
    }
};

/* SPLIT (v43; plain problems with the points sliced, gridDim.y > 1): a chunk's loads and point
 * gradients first, then its scatter after grid_dep_wait, so that the block's loads overlap the
 * zeroing of grad_value by zero_kernel, whose programmatic dependent this kernel is. */
template <typename T, int G, bool DET, bool OPT, bool SPLIT = false, int VV = 4, bool PIPE = false>
__global__ void __launch_bounds__(256, MSDA_BWD_MIN_BLOCKS) msda_backward_fast(msda_problem pr) {
    constexpr int V = VV;
    static_assert(!(SPLIT && (DET || OPT)), "SPLIT is for plain problems");
    static_assert(!(PIPE && (DET || OPT || SPLIT)), "PIPE is for plain problems");
    typedef Stage<G> St;
    __shared__ int4 s_lvl[MSDA_FAST_MAX_LEVELS];
    __shared__ int4 s_offs[St::IPB * St::STRIDE];
    __shared__ float4 s_geo[St::IPB * St::STRIDE];  /* {A, fx, fy, 0} */
    __shared__ float4 s_sums[St::IPB * St::STRIDE]; /* {d/dA, d/dfx, d/dfy, 0} before scaling */
    __shared__ float2 s_soft[OPT ? St::IPB : 1];    /* softmax {max, 1 / sum} per item */
    __shared__ int2 s_item[St::IPB];                /* {row, head offset} per item */
    const int g = threadIdx.x % G, local = threadIdx.x / G;
    const T *value = (const T *)pr.value + g * V;
    const T *gout = (const T *)pr.grad_output;
    constexpr bool NATIVE = NativeHalf<T, DET>::value;
    float *grad_value = pr.grad_value ? (float *)pr.grad_value + g * V : nullptr;
    T *grad_value_t = (T *)pr.grad_value + g * V; /* NATIVE */
    long long *det_acc = nullptr;
    float scale = 0.f;
    if (DET && grad_value) {
        det_acc = (long long *)((char *)pr.workspace + MSDA_DET_HEADER_BYTES) + g;
        scale = (float)det_scale(pr, (const DetHeader *)pr.workspace);
    }
    T *grad_loc = (T *)pr.grad_sampling_locations;
    T *grad_attn = (T *)pr.grad_attention_weights;
    const bool point_grads = grad_loc || grad_attn;
    const int n_items = (int)(pr.B * pr.Q * pr.H), LP = (int)pr.NP, C = (int)pr.C;
    const bool nearest = OPT && (pr.flags & MSDA_NEAREST);
    const bool softmax = OPT && (pr.flags & MSDA_SOFTMAX);
    load_levels(pr, s_lvl);
    __syncthreads();
    /* unsigned: with more than 2^30 items, base + gridDim.x * IPB passes 2^31 - 1 (int would
     * wrap negative and run again on items before the first), never 2^32 - 1 */
    for (unsigned ub = blockIdx.x * St::IPB; ub < (unsigned)n_items; ub += gridDim.x * St::IPB) {
        const int base = (int)ub;
        fill_items<T, false, St::IPB>(pr, s_lvl, base, n_items, St::IPB, s_item);
        __syncthreads();
        const int item = base + local, row = s_item[local].x;
        float go[V], go_det[V]; /* go_det: channels g, g + G, ... (DET's coalesced atomics) */
        if (item < n_items) {
            load_vec(gout + (int64_t)row * C + g * V, go);
        } else {
#pragma unroll
            for (int j = 0; j < V; j++) go[j] = 0.f;
        }
        if (DET) {
#pragma unroll
            for (int j = 0; j < V; j++)
                go_det[j] = item < n_items ? to_acc(gout[(int64_t)row * C + g + j * G]) : 0.f;
        }
        group_softmax_stats<T, G, OPT>(pr, item, row, n_items, s_soft);
        if (softmax) __syncthreads();
        float dot = 0.f; /* softmax: sum over the item's points of A * dL/dA, in point order */
        /* blockIdx.y: which of gridDim.y slices of the points (never split with softmax) */
        const int p_end = (int)((int64_t)LP * (blockIdx.y + 1) / gridDim.y);
        for (int p0 = (int)((int64_t)LP * blockIdx.y / gridDim.y); p0 < p_end; p0 += St::K) {
            const int kn = p_end - p0 < St::K ? p_end - p0 : St::K;
            stage_chunk<T, false, OPT, St>(pr, s_lvl, s_item, base, n_items, p0, kn, s_soft,
                                           s_offs, s_geo);
            __syncthreads();
            if constexpr (PIPE) {
                /* v51: point k + 1's gathers issued before point k's atomics and sums (one
                 * dependent round trip a point otherwise); only the gathered corners are
                 * carried over, the rest of point k is read again from shared memory. */
                Carried<T, V> cur;
                cur.gather(value, s_offs[local * St::STRIDE], point_grads);
                for (int k = 0; k < kn; k++) {
                    Carried<T, V> nxt;
                    nxt.gather(value, s_offs[local * St::STRIDE + (k + 1 < kn ? k + 1 : k)],
                               point_grads && k + 1 < kn);
                    float vc[4][V];
                    cur.widen(vc);
                    const StagedPoint pt = staged_point<St>(s_offs, s_geo, local, k);
                    if (grad_value) {
#pragma unroll
                        for (int c = 0; c < 4; c++)
                            if (pt.o[c] >= 0)
                                scatter_corner<T, NATIVE, V>(grad_value, grad_value_t,
                                                             (unsigned)pt.o[c], pt.a * pt.w[c], go);
                    }
                    if (point_grads) {
                        const float3 sums = point_sums<G, V>(go, pt.w, pt.fx, pt.fy, vc);
                        const bool hit = pt.o[0] >= 0 || pt.o[1] >= 0 || pt.o[2] >= 0 || pt.o[3] >= 0;
                        if (g == 0)
                            s_sums[local * St::STRIDE + k] =
                                make_float4(sums.x, sums.y, sums.z, hit ? 1.f : 0.f);
                    }
                    cur = nxt;
                }
            } else
            /* Every lane runs the same trip count (items past the end have no inside corners),
             * so the group shuffles below see all their lanes. */
            for (int k = 0; k < kn; k++) {
                const StagedPoint pt = staged_point<St>(s_offs, s_geo, local, k);
                const float a = pt.a, fx = pt.fx, fy = pt.fy;
                const float(&w)[4] = pt.w;
                const int(&o)[4] = pt.o;
                float v[4][V];
#pragma unroll
                for (int c = 0; c < 4; c++) {
                    if (o[c] >= 0) {
                        if (point_grads) load_vec(value + (unsigned)o[c], v[c]);
                        if (!SPLIT && grad_value) {
                            if (DET) { /* lanes of a group on consecutive 8-byte words */
#pragma unroll
                                for (int j = 0; j < V; j++)
                                    det_add(det_acc + (unsigned)o[c] + j * G, a * w[c] * go_det[j], scale);
                            } else {
                                scatter_corner<T, NATIVE, V>(grad_value, grad_value_t, (unsigned)o[c],
                                                             a * w[c], go);
                            }
                        }
                    } else {
#pragma unroll
                        for (int j = 0; j < V; j++) v[c][j] = 0.f;
                    }
                }
                if (!point_grads) continue;
                const float3 sums = point_sums<G, V>(go, w, fx, fy, v);
                const float s_a = sums.x, s_x = sums.y, s_y = sums.z;
                if (softmax) dot += a * s_a;
                /* .w marks a point with a corner inside: only those scale by A (a non-finite A
                 * of a point outside must leave its zero gradients zero, as on the CPU). */
                const bool hit = o[0] >= 0 || o[1] >= 0 || o[2] >= 0 || o[3] >= 0;
                if (g == 0) s_sums[local * St::STRIDE + k] = make_float4(s_a, s_x, s_y, hit ? 1.f : 0.f);
            }
            if (SPLIT && grad_value) { /* the scatter, once grad_value is zero */
                grid_dep_wait();
                for (int k = 0; k < kn; k++) {
                    const StagedPoint pt = staged_point<St>(s_offs, s_geo, local, k);
#pragma unroll
                    for (int c = 0; c < 4; c++)
                        if (pt.o[c] >= 0)
                            scatter_corner<T, NATIVE, V>(grad_value, grad_value_t, (unsigned)pt.o[c],
                                                         pt.a * pt.w[c], go);
                }
            }
            if (point_grads) {
                __syncthreads();
                for (int j = threadIdx.x; j < St::IPB * St::K; j += 256) {
                    const int il = j / St::K, k = j % St::K;
                    if (base + il >= n_items || k >= kn) continue;
                    const int pidx = p0 + k;
                    const int64_t i = (int64_t)s_item[il].x * LP + pidx;
                    const float4 sums = s_sums[il * St::STRIDE + k];
                    const float a = s_geo[il * St::STRIDE + k].x;
                    if (grad_attn) grad_attn[i] = from_acc<T>(sums.x);
                    if (grad_loc && (sums.w == 0.f || nearest)) { /* nearest: constant */
                        grad_loc[2 * i] = grad_loc[2 * i + 1] = from_acc<T>(0.f);
                    } else if (grad_loc) {
                        const int l = level_of<OPT>(pr, pidx);
                        const float W_l = (float)load_index(pr.spatial_shapes, pr.index_dtype, 2 * l + 1);
                        const float H_l = (float)load_index(pr.spatial_shapes, pr.index_dtype, 2 * l);
                        grad_loc[2 * i] = from_acc<T>(a * sums.y * W_l);
                        grad_loc[2 * i + 1] = from_acc<T>(a * sums.z * H_l);
                    }
                }
            }
            __syncthreads();
        }
        if (softmax && grad_attn && item < n_items) { /* dL/dz = A * (dL/dA - dot), see above */
            const float2 soft = s_soft[local];
            const T *z = (const T *)pr.attention_weights;
            for (int pidx = g; pidx < LP; pidx += G) {
                const int64_t i = (int64_t)row * LP + pidx;
                const float a = expf(to_acc(z[i]) - soft.x) * soft.y;
                grad_attn[i] = from_acc<T>(a * (to_acc(grad_attn[i]) - dot));
            }
        }
    }
}

/* Slot lists longer than MSDA_AGG_CAP are walked in segments by several walkers: the filer of a
 * row's n-th slot (n = MSDA_AGG_CAP, 2 * MSDA_AGG_CAP, ...) marks it, and a segment runs from
 * the list's head, or from a marked slot, to the next marked slot. */
#define MSDA_AGG_CAP 16 /* v28: 8 measured slower (more walkers and atomics) */
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
 * round is handed out in reverse (v25): the entries are sorted longest first, so warp 0 would
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
    static constexpr int NT = 256;      /* threads a block */
    static constexpr int GPB = 256 / G; /* groups per block */
    static constexpr int K0 = G < 2 ? 2 : (G > 16 ? 16 : G);
    static constexpr int MUL = K0 >= 2 ? 2 : 1; /* items per group */
    static constexpr int IPB = GPB * MUL;       /* items per block */
    static constexpr int K = K0 / MUL;          /* points per item per chunk */
    /* unpadded (v32): every access here takes (item, point) from consecutive threads, where
     * Stage's padding (for groups that each read one point) only made bank conflicts */
    static constexpr int STRIDE = K;
    static constexpr int NS = IPB * K * 4; /* corner slots per chunk (<= 1024 for G >= 2) */
    static constexpr int HS = NS;          /* hash positions */
    static constexpr int HBITS = HS >= 2048 ? 11 : (HS >= 1024 ? 10 : 9);
    static_assert((1 << HBITS) == HS, "HS is a power of two");
    static_assert(G < 2 || NS % 256 == 0, "every thread files the same number of slots");
};

/* Aggregated backward (not MSDA_DETERMINISTIC, G >= 4; chosen by aggregates()). A block holds
 * 2 * 256 / G neighbouring queries of one head (head-major items; an encoder's in a tile of
 * pixels, fill_items), whose points land on many of the same pixels: on realistic ddetr_enc
 * inputs the 64 x 4 x 4 corners of a chunk hit ~7x fewer distinct value rows. Per staged chunk:
 *   1. file: one thread per corner ("slot") files it under its row (value / grad_value offset)
 *      in a shared-memory hash table (open addressing; a linked list of slots per row and a
 *      count; new rows numbered warp by warp), with its coefficient A * w_k. The row's
 *      MSDA_AGG_CAP-th, 2 * MSDA_AGG_CAP-th, ... slot is marked: it starts a segment of the
 *      list. Walk entries: one per row (its list's head segment), one per marked slot;
 *   2. sort the entries by their segments' estimated lengths (from the counts; counting sort,
 *      longest first), so the walkers of a warp, which step together, have about the same
 *      number of slots;
 *   3. walk: one walker of G/2 lanes (8 channels a lane) per entry loads the value row once
 *      and, over the segment's slots, sums coefficient * grad_output (then one 16-byte atomic
 *      per 4 channels: global atomics drop by the duplication factor) and parks each slot's
 *      grad_output . row in s_dot;
 *   4. point gradients from the four dots of each point: with d_k = g . v_k,
 *      dL/dA = sum_k w_k d_k, dL/dfx = (1-fy)(d1-d0) + fy(d3-d2),
 *      dL/dfy = (1-fx)(d2-d0) + fx(d3-d1).
 * Softmax: the per-item sum of A * dL/dA is gathered in shared memory (float atomics, so its
 * order varies: MSDA_DETERMINISTIC with softmax takes msda_backward_fast).
 * DET (MSDA_DETERMINISTIC): each contribution is rounded to the 64-bit fixed point on its own
 * (as in msda_backward_fast, so grad_value has the same bits), the walk sums them as integers
 * and adds each row's sums with one integer atomic per channel; lanes own channels
 * part + (G/2) * q there, so a walker's atomics cover whole sectors. The point gradients come
 * from dots summed in a fixed order either way. */
#define MSDA_AGG_BUCKETS 16 /* segment lengths 1 .. 15 and 16 or more */
template <typename T, int G, bool OPT, bool DET, bool FULL>
__global__ void __launch_bounds__(256, MSDA_BWD_MIN_BLOCKS) msda_backward_agg(msda_problem pr) {
    constexpr int V = 4;
    typedef StageAgg<G> St;
    /* One shared object, so every array is one base address plus a constant: with separate
     * __shared__ arrays the compiler (48 registers) rebuilt each array's shared-window address
     * (S2UR SR_CgaCtaId, ULEA) inside the walk loop, 13 of its 59 instructions a step. */
    struct Shared {
        int4 lvl[MSDA_FAST_MAX_LEVELS];
        int4 offs[St::IPB * St::STRIDE];
        float4 geo[St::IPB * St::STRIDE]; /* {A, fx, fy, 0} */
        float4 go[St::IPB * G];           /* grad_output of the block's items */
        int2 meta[St::NS];                /* {A * w_k, link}, per slot (walk_entry) */
        alignas(16) float dot[St::NS];     /* g . corner row, per slot (read as float4s) */
        int2 item[St::IPB];               /* {row, head offset} per item */
        float2 soft[OPT ? St::IPB : 1];
        float smdot[OPT ? St::IPB : 1];   /* softmax: sum of A * dL/dA per item */
        int key[St::HS];
        int head[St::HS];
        int cnt2[St::HS / 2]; /* slots filed per row, two 16-bit counts a word */
        int bucket[MSDA_AGG_BUCKETS];
        int nent;
        short ent[St::NS];  /* walk entries (see above), filed, then longest first */
    };
    __shared__ Shared sm;
    int4(&s_lvl)[MSDA_FAST_MAX_LEVELS] = sm.lvl;
    int4(&s_offs)[St::IPB * St::STRIDE] = sm.offs;
    float4(&s_geo)[St::IPB * St::STRIDE] = sm.geo;
    float4(&s_go)[St::IPB * G] = sm.go;
    int2(&s_meta)[St::NS] = sm.meta;
    float(&s_dot)[St::NS] = sm.dot;
    int2(&s_item)[St::IPB] = sm.item;
    float2(&s_soft)[OPT ? St::IPB : 1] = sm.soft;
    float(&s_smdot)[OPT ? St::IPB : 1] = sm.smdot;
    int(&s_key)[St::HS] = sm.key;
    int(&s_head)[St::HS] = sm.head;
    int(&s_cnt2)[St::HS / 2] = sm.cnt2;
    int(&s_bucket)[MSDA_AGG_BUCKETS] = sm.bucket;
    int &s_nent = sm.nent;
    short(&s_ent)[St::NS] = sm.ent;
    const int g = threadIdx.x % G, local = threadIdx.x / G, lane = threadIdx.x & 31;
    const T *gout = (const T *)pr.grad_output;
    T *grad_loc = (T *)pr.grad_sampling_locations;
    T *grad_attn = (T *)pr.grad_attention_weights;
    /* FULL: every gradient wanted (compile-time, so the walk tests no pointer) */
    const bool point_grads = FULL || grad_loc || grad_attn;
    const int n_items = (int)(pr.B * pr.Q * pr.H), LP = (int)pr.NP, C = (int)pr.C;
    const bool nearest = OPT && (pr.flags & MSDA_NEAREST);
    const bool softmax = OPT && (pr.flags & MSDA_SOFTMAX);
    long long *det_acc = nullptr; /* DET: the fixed-point grad_value (see common.cuh) */
    float scale = 0.f;
    if (DET && pr.grad_value) {
        det_acc = (long long *)((char *)pr.workspace + MSDA_DET_HEADER_BYTES);
        scale = (float)det_scale(pr, (const DetHeader *)pr.workspace);
    }
    load_levels(pr, s_lvl);
    for (int j = threadIdx.x; j < St::HS; j += 256) s_key[j] = -1, s_head[j] = -1;
    for (int j = threadIdx.x; j < St::HS / 2; j += 256) s_cnt2[j] = 0;
    if (threadIdx.x == 0) s_nent = 0;
    if (threadIdx.x < MSDA_AGG_BUCKETS) s_bucket[threadIdx.x] = 0;
    if (OPT && threadIdx.x < St::IPB) s_smdot[threadIdx.x] = 0.f;
    __syncthreads();
    /* blocks take the tiles last first (v40): an encoder's items end with the queries of its
     * coarse levels, whose points spread over the finer levels and aggregate least (the
     * costliest blocks); started first, they no longer make the grid's tail */
    const int n_tiles = (int)(((unsigned)n_items + St::IPB - 1) / St::IPB); /* no overflow */
    for (int t = blockIdx.x; t < n_tiles; t += gridDim.x) {
        const int base = (n_tiles - 1 - t) * St::IPB;
        fill_items<T, false, St::IPB>(pr, s_lvl, base, n_items, St::IPB, s_item);
        __syncthreads();
#pragma unroll
        for (int m = 0; m < St::MUL; m++) { /* each group loads St::MUL items */
            const int il = local + m * St::GPB, item = base + il, row = s_item[il].x;
            float go[V];
            if (item < n_items) {
                load_vec(gout + (int64_t)row * C + g * V, go);
            } else {
#pragma unroll
                for (int j = 0; j < V; j++) go[j] = 0.f;
            }
            s_go[il * G + g] = make_float4(go[0], go[1], go[2], go[3]);
            group_softmax_stats<T, G, OPT>(pr, item, row, n_items, s_soft, il);
        }
        if (softmax) __syncthreads();
        const int p_end = (int)((int64_t)LP * (blockIdx.y + 1) / gridDim.y);
        for (int p0 = (int)((int64_t)LP * blockIdx.y / gridDim.y); p0 < p_end; p0 += St::K) {
            const int kn = p_end - p0 < St::K ? p_end - p0 : St::K;
            stage_chunk<T, false, OPT, St>(pr, s_lvl, s_item, base, n_items, p0, kn, s_soft,
                                           s_offs, s_geo);
            __syncthreads();
            /* file every inside corner under its row; new rows numbered warp by warp */
            for (int j = threadIdx.x; j < St::NS; j += 256) { /* same trip count in every lane */
                const int il = j / (St::K * 4), k = (j >> 2) % St::K, c = j & 3;
                const int o = reinterpret_cast<const int *>(&s_offs[il * St::STRIDE + k])[c];
                unsigned hp = ((unsigned)o * 2654435761u) >> (32 - St::HBITS);
                bool fresh = false, marked = false;
                if (o >= 0) {
                    const float4 geo = s_geo[il * St::STRIDE + k];
                    const float wx = (c & 1) ? geo.y : 1.f - geo.y;
                    const float wy = (c & 2) ? geo.z : 1.f - geo.z;
                    const float cf = geo.x * (wx * wy);
                    for (;;) {
                        const int prev = atomicCAS(&s_key[hp], -1, o);
                        if (prev == -1 || prev == o) {
                            fresh = prev == -1;
                            break;
                        }
                        hp = (hp + 1) & (St::HS - 1);
                    }
                    const int sh = 16 * (hp & 1);
                    const int n = (atomicAdd(&s_cnt2[hp >> 1], 1 << sh) >> sh) & 0xffff;
                    marked = n >= MSDA_AGG_CAP && n % MSDA_AGG_CAP == 0;
                    const int prev = atomicExch(&s_head[hp], j);
                    s_meta[j] = make_int2(__float_as_int(cf),
                                          (prev + 1) | (marked ? MSDA_AGG_MARK : 0));
                }
                /* a walk entry for every new row (its hash position) and every marked slot
                 * (HS + the slot) */
                const unsigned m = __ballot_sync(0xffffffffu, fresh || marked);
                int first = 0;
                if (lane == 0 && m) first = atomicAdd(&s_nent, __popc(m));
                first = __shfl_sync(0xffffffffu, first, 0);
                if (fresh || marked)
                    s_ent[first + __popc(m & ((1u << lane) - 1u))] =
                        (short)(fresh ? (int)hp : St::HS + j);
                if (fresh && marked) { /* the row's first filer came late: both entries */
                    const int e2 = atomicAdd(&s_nent, 1);
                    s_ent[e2] = (short)(St::HS + j);
                }
            }
            __syncthreads();
            const int nent = s_nent;
            /* order the rows by the length of their slot lists, longest first (a counting sort
             * into MSDA_AGG_BUCKETS buckets), so the walkers of a warp, which step together,
             * get lists of about the same length */
            constexpr int EPT = St::NS / 256; /* entries per thread at most */
            int bucket[EPT], rank[EPT], entry[EPT];
#pragma unroll
            for (int r = 0; r < EPT; r++) {
                const int e = threadIdx.x + r * 256;
                bucket[r] = -1, rank[r] = 0, entry[r] = 0;
                /* a warp with no entry in this round skips it whole (v37): rows are a seventh
                 * of the slots, so most warps have none past the first round */
                if ((threadIdx.x & ~31) + r * 256 >= nent) continue;
                int b = -1; /* -1: no entry */
                entry[r] = e < nent ? s_ent[e] : 0;
                if (e < nent) { /* segment length, estimated from the row's count */
                    int len = MSDA_AGG_CAP;
                    if (entry[r] < St::HS) {
                        const int hp = entry[r], c = (s_cnt2[hp >> 1] >> (16 * (hp & 1))) & 0xffff;
                        len = c <= MSDA_AGG_CAP ? c : (c - 1) % MSDA_AGG_CAP;
                    }
                    len = len < 1 ? 1 : (len > MSDA_AGG_BUCKETS ? MSDA_AGG_BUCKETS : len);
                    b = MSDA_AGG_BUCKETS - len;
                }
                /* one shared atomic per bucket and warp (v22): most rows fall into a few
                 * buckets, and lanes adding to one shared word are serialised */
                const unsigned peers = __match_any_sync(0xffffffffu, b);
                const int leader = __ffs(peers) - 1;
                int first = 0;
                if (b >= 0 && lane == leader) first = atomicAdd(&s_bucket[b], __popc(peers));
                first = __shfl_sync(0xffffffffu, first, leader);
                bucket[r] = b;
                rank[r] = first + __popc(peers & ((1u << lane) - 1u));
            }
            __syncthreads();
            if (threadIdx.x < 32) { /* exclusive prefix sum of the bucket sizes */
                const int n = threadIdx.x < MSDA_AGG_BUCKETS ? s_bucket[threadIdx.x] : 0;
                int incl = n;
#pragma unroll
                for (int o = 1; o < 32; o <<= 1) {
                    const int t = __shfl_up_sync(0xffffffffu, incl, o);
                    if (lane >= o) incl += t;
                }
                if (threadIdx.x < MSDA_AGG_BUCKETS) s_bucket[threadIdx.x] = incl - n;
            }
            __syncthreads();
#pragma unroll
            for (int r = 0; r < EPT; r++) {
                const int e = threadIdx.x + r * 256;
                if (e < nent) s_ent[s_bucket[bucket[r]] + rank[r]] = (short)entry[r];
            }
            __syncthreads();
            if constexpr (DET) { /* as below, with fixed-point sums */
                constexpr int WG = G / 2, WPB = 256 / WG;
                const int walker = threadIdx.x / WG, part = threadIdx.x % WG;
                /* lane `part` owns channels part + WG * q: each of the 8 integer atomics of a
                 * walker covers WG consecutive words (whole sectors) */
                const float *s_gof = reinterpret_cast<const float *>(s_go);
                const T *value = (const T *)pr.value;
                for (int e0 = 0; e0 < nent; e0 += WPB) {
                    int key, j;
                    int2 m;
                    round_entry<St, WPB>(e0, walker, nent, s_ent, s_key, s_head, s_meta, s_offs,
                                         key, j, m);
                    const bool active = j >= 0;
                    float v[8];
                    long long acc[8];
#pragma unroll
                    for (int q = 0; q < 8; q++) {
                        v[q] = point_grads && j >= 0 ? to_acc(value[key + part + WG * q]) : 0.f;
                        acc[q] = 0;
                    }
                    while (__any_sync(0xffffffffu, j >= 0)) {
                        float d = 0.f;
                        int next = -1;
                        if (j >= 0) {
                            const float *gi = s_gof + (j / (St::K * 4)) * C + part;
                            const float cf = __int_as_float(m.x);
#pragma unroll
                            for (int q = 0; q < 8; q++) {
                                const float gq = gi[WG * q];
                                /* each contribution rounded to the fixed point on its own, as
                                 * msda_backward_fast rounds them: the integer sum is exact */
                                if (det_acc) acc[q] += llrintf(cf * gq * scale);
                                d += gq * v[q];
                            }
                            next = next_slot_of(s_meta, m);
                        }
                        if (point_grads) {
                            d = group_sum<WG>(d);
                            if (j >= 0 && part == 0) s_dot[j] = d;
                        }
                        j = next;
                    }
                    if (det_acc && active) {
#pragma unroll
                        for (int q = 0; q < 8; q++)
                            if (acc[q] != 0)
                                atomicAdd((unsigned long long *)(det_acc + key + part + WG * q),
                                          (unsigned long long)acc[q]);
                    }
                }
            } else { /* walkers of WG lanes, 8 channels a lane: one walker per distinct row; all
               * the loops below run the same trip count in every lane of a warp (full-warp
               * votes), so the group sums shuffle with the full mask */
                constexpr int WG = G / 2, WPB = 256 / WG;
                const int walker = threadIdx.x / WG, part = threadIdx.x % WG;
                /* odd walkers take their lane's two 4-channel halves in the other order, so the
                 * two walkers of a quarter warp read s_go from different banks */
                const int h0 = part * 8 + (walker & 1) * 4, h1 = part * 8 + 4 - (walker & 1) * 4;
                const T *vrow = (const T *)pr.value + part * 8;
                float *gv_row = (float *)pr.grad_value;
                const bool want_gv = FULL || gv_row; /* compile-time true with FULL */
                /* s_go indexed as float4s of the shared array itself (a generic pointer into it
                 * had the compiler recompute shared addresses in every step of the walk) */
                const int q0 = h0 >> 2, q1 = h1 >> 2;
                if (want_gv) grid_dep_wait(); /* zero_kernel done (v39; at once after the first) */
                for (int e0 = 0; e0 < nent; e0 += WPB) {
                    int key, j;
                    int2 m;
                    round_entry<St, WPB>(e0, walker, nent, s_ent, s_key, s_head, s_meta, s_offs,
                                         key, j, m);
                    const bool active = j >= 0;
                    float v[8], a0[4], a1[4];
                    if (point_grads && j >= 0) {
                        float u[8];
                        load_vec8(vrow + (unsigned)key, u);
#pragma unroll
                        for (int q = 0; q < 4; q++) {
                            v[q] = (walker & 1) ? u[q + 4] : u[q];
                            v[q + 4] = (walker & 1) ? u[q] : u[q + 4];
                        }
                    }
#pragma unroll
                    for (int q = 0; q < 4; q++) a0[q] = a1[q] = 0.f;
                    while (__any_sync(0xffffffffu, j >= 0)) {
                        float d = 0.f;
                        int next = -1;
                        if (j >= 0) {
                            const int il = j / (St::K * 4);
                            const float4 g0 = s_go[il * G + q0];
                            const float4 g1 = s_go[il * G + q1];
                            if (want_gv) {
                                const float cf = __int_as_float(m.x);
                                a0[0] += cf * g0.x, a0[1] += cf * g0.y;
                                a0[2] += cf * g0.z, a0[3] += cf * g0.w;
                                a1[0] += cf * g1.x, a1[1] += cf * g1.y;
                                a1[2] += cf * g1.z, a1[3] += cf * g1.w;
                            }
                            /* the two 4-channel halves summed apart, then added: the same
                             * bits whichever half a walker takes first (odd and even walkers
                             * differ), so the point gradients do not depend on the order of
                             * the walk (which walker gets a row varies from run to run) */
                            if (point_grads) {
                                const float d0 = g0.x * v[0] + g0.y * v[1] + g0.z * v[2] +
                                                 g0.w * v[3];
                                const float d1 = g1.x * v[4] + g1.y * v[5] + g1.z * v[6] +
                                                 g1.w * v[7];
                                d = d0 + d1;
                            }
                            next = next_slot_of(s_meta, m);
                        }
                        if (point_grads) {
                            d = group_sum<WG>(d);
                            if (j >= 0 && part == 0) s_dot[j] = d;
                        }
                        j = next;
                    }
                    if (want_gv && active) {
                        if constexpr (NativeHalf<T, DET>::value) {
                            /* the lane's 8 channels in order: odd walkers hold them swapped */
                            float a8[8];
#pragma unroll
                            for (int q = 0; q < 4; q++) {
                                a8[q] = (walker & 1) ? a1[q] : a0[q];
                                a8[q + 4] = (walker & 1) ? a0[q] : a1[q];
                            }
                            red_half<T, 8>((T *)pr.grad_value + (unsigned)key + part * 8, a8);
                        } else {
                            atomic_add_vec<4>(gv_row + (unsigned)key + h0, a0);
                            atomic_add_vec<4>(gv_row + (unsigned)key + h1, a1);
                        }
                    }
                }
            }
            __syncthreads();
            /* empty the table (the next chunk's barrier orders this before its filing) */
            for (int e = threadIdx.x; e < nent; e += 256) {
                const int hp = s_ent[e];
                if (hp < St::HS) s_key[hp] = -1, s_head[hp] = -1, s_cnt2[hp >> 1] = 0;
            }
            if (threadIdx.x < MSDA_AGG_BUCKETS) s_bucket[threadIdx.x] = 0;
            if (point_grads) {
                for (int j = threadIdx.x; j < St::IPB * St::K; j += 256) {
                    const int il = j / St::K, k = j % St::K;
                    if (base + il >= n_items || k >= kn) continue;
                    const int4 o4 = s_offs[il * St::STRIDE + k];
                    const float4 geo = s_geo[il * St::STRIDE + k];
                    const float a = geo.x, fx = geo.y, fy = geo.z;
                    /* one 16-byte read of the point's four dots (v22; four 4-byte reads at a
                     * 16-byte stride took four wavefronts each); slots of corners outside hold
                     * stale values, masked here */
                    const float4 d4 = reinterpret_cast<const float4 *>(s_dot)[j];
                    const float d0 = o4.x >= 0 ? d4.x : 0.f;
                    const float d1 = o4.y >= 0 ? d4.y : 0.f;
                    const float d2 = o4.z >= 0 ? d4.z : 0.f;
                    const float d3 = o4.w >= 0 ? d4.w : 0.f;
                    const float s_a = (1.f - fx) * (1.f - fy) * d0 + fx * (1.f - fy) * d1 +
                                      (1.f - fx) * fy * d2 + fx * fy * d3;
                    const bool hit = o4.x >= 0 || o4.y >= 0 || o4.z >= 0 || o4.w >= 0;
                    const int pidx = p0 + k;
                    const int64_t i = (int64_t)s_item[il].x * LP + pidx;
                    if (softmax && grad_attn) atomicAdd(&s_smdot[il], a * s_a);
                    if (grad_attn) grad_attn[i] = from_acc<T>(s_a);
                    if (grad_loc && (!hit || nearest)) {
                        grad_loc[2 * i] = grad_loc[2 * i + 1] = from_acc<T>(0.f);
                    } else if (grad_loc) {
                        const float s_x = (1.f - fy) * (d1 - d0) + fy * (d3 - d2);
                        const float s_y = (1.f - fx) * (d2 - d0) + fx * (d3 - d1);
                        const int l = level_of<OPT>(pr, pidx);
                        const float W_l = (float)s_lvl[l].y, H_l = (float)s_lvl[l].x;
                        grad_loc[2 * i] = from_acc<T>(a * s_x * W_l);
                        grad_loc[2 * i + 1] = from_acc<T>(a * s_y * H_l);
                    }
                }
            }
            if (threadIdx.x == 0) s_nent = 0;
            __syncthreads();
        }
        if (softmax && grad_attn) { /* dL/dz = A * (dL/dA - dot), see msda_backward_fast */
            for (int m = 0; m < St::MUL; m++) {
                const int il = local + m * St::GPB;
                if (base + il >= n_items) continue;
                const float2 soft = s_soft[il];
                const float dot = s_smdot[il];
                const int64_t row = s_item[il].x;
                const T *z = (const T *)pr.attention_weights;
                for (int pidx = g; pidx < LP; pidx += G) {
                    const int64_t i = row * LP + pidx;
                    const float a = expf(to_acc(z[i]) - soft.x) * soft.y;
                    grad_attn[i] = from_acc<T>(a * (to_acc(grad_attn[i]) - dot));
                }
            }
            __syncthreads();
            if (threadIdx.x < St::IPB) s_smdot[threadIdx.x] = 0.f;
        }
    }
}

/* MSDA_DETERMINISTIC, step 1: header maxima of |grad_output| and |A| (see common.cuh), as
 * doubles compared by their bits (monotone for values >= 0; a NaN compares above +Inf). */
template <typename T>
__global__ void __launch_bounds__(256) det_scan_kernel(msda_problem pr) {
    const T *gout = (const T *)pr.grad_output;
    const T *attn = (const T *)pr.attention_weights;
    DetHeader *hd = (DetHeader *)pr.workspace;
    const int64_t n_g = pr.B * pr.Q * pr.H * pr.C, n_a = pr.B * pr.Q * pr.H * pr.NP;
    const bool softmax = pr.flags & MSDA_SOFTMAX; /* probabilities are <= 1 */
    double mg = 0.0, ma = softmax ? 1.0 : 0.0;
    const int64_t stride = (int64_t)gridDim.x * blockDim.x;
    for (int64_t j = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; j < n_g; j += stride) {
        const double v = fabs((double)to_acc(gout[j]));
        mg = (v > mg || v != v) ? v : mg;
    }
    if (!softmax)
        for (int64_t j = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; j < n_a; j += stride) {
            const double v = fabs((double)to_acc(attn[j]));
            ma = (v > ma || v != v) ? v : ma;
        }
    unsigned long long bg = (unsigned long long)__double_as_longlong(mg);
    unsigned long long ba = (unsigned long long)__double_as_longlong(ma);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const unsigned long long og = __shfl_xor_sync(0xffffffffu, bg, o);
        const unsigned long long oa = __shfl_xor_sync(0xffffffffu, ba, o);
        bg = og > bg ? og : bg;
        ba = oa > ba ? oa : ba;
    }
    if ((threadIdx.x & 31) == 0) {
        atomicMax(&hd->max_g, bg);
        atomicMax(&hd->max_a, ba);
    }
}

/* MSDA_DETERMINISTIC, last step: grad_value = accumulator / scale (NaN if the scale is 0), in
 * T (half types: through f32, the accumulation type). */
template <typename T>
__global__ void __launch_bounds__(256) det_convert_kernel(msda_problem pr) {
    typedef typename AccOf<T>::type Acc;
    const long long *det_acc = (const long long *)((const char *)pr.workspace + MSDA_DET_HEADER_BYTES);
    T *grad_value = (T *)pr.grad_value;
    const double scale = det_scale(pr, (const DetHeader *)pr.workspace);
    const double inv = scale > 0.0 ? 1.0 / scale : __longlong_as_double(0x7ff8000000000000LL);
    const int64_t n = pr.B * pr.S * pr.H * pr.C;
    const int64_t stride = (int64_t)gridDim.x * blockDim.x;
    for (int64_t j = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; j < n; j += stride)
        grad_value[j] = from_acc<T>((Acc)((double)det_acc[j] * inv)); /* scale: a power of two */
}

/* Half types without NativeHalf, last step: grad_value (T) = the f32 buffer in the workspace. */
template <typename T>
__global__ void __launch_bounds__(256) half_convert_kernel(msda_problem pr) {
    const float *acc = (const float *)pr.workspace;
    T *grad_value = (T *)pr.grad_value;
    const int64_t n = pr.B * pr.S * pr.H * pr.C;
    const int64_t stride = (int64_t)gridDim.x * blockDim.x;
    for (int64_t j = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; j < n; j += stride)
        grad_value[j] = from_acc<T>(acc[j]);
}

// ---------------------------------------------------------------------------------------------
// launcher

static inline unsigned int flat_blocks(int64_t n) {
    int64_t blocks = (n + 255) / 256;
    if (blocks > 65536) blocks = 65536;
    return (unsigned int)(blocks < 1 ? 1 : blocks);
}

/* Multiprocessors of a device, asked once; 0 where the question fails. */
static int sm_count(int device) {
    static int known[64];
    if (device < 0 || device >= 64) return 0;
    if (known[device] == 0) {
        int sms = 0;
        if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess) {
            cudaGetLastError();
            return 0;
        }
        known[device] = sms;
    }
    return known[device];
}

/* Whether the kernels that run on `device` are code for sm_90 or newer (half-precision vector
 * reductions, programmatic dependent launch). The code a device runs is the build's machine
 * code for its architecture or, failing that, PTX of an older one compiled for it: the kernels'
 * PTX version says which, so a build without sm_90 code run on an H100 takes the older paths.
 * Asked once per device; false where the question fails. */
static bool sm90_code(int device) {
    static signed char known[64]; /* 0 unknown, 1 no, 2 yes */
    if (device < 0 || device >= 64) return false;
    if (known[device] == 0) {
        DeviceGuard guard; /* the workspace query comes without one */
        cudaFuncAttributes attr;
        if (guard.select(device) != cudaSuccess ||
            cudaFuncGetAttributes(&attr, half_convert_kernel<__half>) != cudaSuccess) {
            cudaGetLastError();
            return false;
        }
        known[device] = attr.ptxVersion >= 90 ? 2 : 1;
    }
    return known[device] == 2;
}

static inline bool aligned16(const void *p) { return ((uintptr_t)p & 15) == 0; }

/* The route of this call (c/routes.c chooses; msda_backward_route reports the same plan). */
static msda_backward_plan plan_of(const msda_problem *pr) {
    const bool sm90 = sm90_code(pr->device);
    /* with MSDA_ROUTE_F32_WORKSPACE the kernels write the workspace instead of grad_value */
    const void *written = msda_backward_f32_workspace(pr, sm90) ? pr->workspace : pr->grad_value;
    msda_backward_plan plan;
    msda_plan_backward(pr, aligned16(pr->value) && aligned16(pr->grad_output) && aligned16(written),
                       sm_count(pr->device), sm90, &plan);
    return plan;
}

/* The first `bytes` of grad_value = 0 on the stream (nothing to do for 0 bytes or without
 * grad_value). In the launchers below `bytes` is what is still to be zeroed: 0 when the caller
 * zeroed it already or needs no zeroing. */
static cudaError_t memset_grad_value(const msda_problem *pr, int64_t bytes, cudaStream_t stream) {
    if (bytes <= 0 || !pr->grad_value) return cudaSuccess;
    return cudaMemsetAsync(pr->grad_value, 0, (size_t)bytes, stream);
}

/* grad_value (`bytes` of it) = 0 before `kernel`, then `kernel`: with sm_90 code, 16-byte
 * multiples and alignment, by zero_kernel and a programmatic dependent launch of `kernel`
 * (which must call grid_dep_wait before its first scatter); otherwise by memset_grad_value
 * first. */
static cudaError_t zero_then_launch(void (*kernel)(msda_problem), dim3 grid, int64_t bytes,
                                    const msda_problem *pr, cudaStream_t stream) {
    bool pdl = false;
    if (bytes > 0 && pr->grad_value) {
        const int sms = sm_count(pr->device);
        if (bytes % 16 == 0 && aligned16(pr->grad_value) && sms > 0 && sm90_code(pr->device)) {
            const int64_t n16 = bytes / 16, want = (n16 + MSDA_ZERO_THREADS - 1) / MSDA_ZERO_THREADS;
            zero_kernel<<<(unsigned int)(want < sms ? want : sms), MSDA_ZERO_THREADS, 0,
                          stream>>>((float4 *)pr->grad_value, n16);
            pdl = true;
        } else {
            const cudaError_t e = memset_grad_value(pr, bytes, stream);
            if (e != cudaSuccess) return e;
        }
    }
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = grid;
    cfg.blockDim = dim3(256);
    cfg.stream = stream;
    cfg.attrs = attr;
    cfg.numAttrs = pdl ? 1 : 0;
    return cudaLaunchKernelEx(&cfg, kernel, *pr);
}

/* The fast kernels of a plan (G = plan.group): one case per route. A route this instantiation
 * does not build (the plan and the if constexpr below disagree) is a library bug. */
template <typename T, int G, bool DET>
static cudaError_t launch_fast(const msda_problem *pr, const msda_backward_plan &plan,
                               cudaStream_t stream, int64_t bytes) {
    const dim3 grid(plan.blocks, plan.slices);
    const bool opt = msda_needs_general(pr);
    switch (plan.kernel) {
    case MSDA_ROUTE_AGGREGATED:
        if constexpr (G >= 4) {
            const bool full = pr->grad_value && pr->grad_sampling_locations &&
                              pr->grad_attention_weights;
            if (opt)
                return zero_then_launch(msda_backward_agg<T, G, true, DET, false>, grid, bytes,
                                        pr, stream);
            if constexpr (!DET) {
                if (full)
                    return zero_then_launch(msda_backward_agg<T, G, false, false, true>, grid,
                                            bytes, pr, stream);
            }
            return zero_then_launch(msda_backward_agg<T, G, false, DET, false>, grid, bytes, pr,
                                    stream);
        }
        break;
    case MSDA_ROUTE_POINT_SLICED: /* loads overlap the zeroing (SPLIT) */
        if constexpr (!DET)
            return zero_then_launch(msda_backward_fast<T, G, false, false, true>, grid, bytes,
                                    pr, stream);
        break;
    case MSDA_ROUTE_POINT_PIPELINED:
        if constexpr (!DET && std::is_same<T, float>::value && G <= 16) {
            /* f32: 2 channels a thread (G = 2 * C / 4 threads an item) */
            const cudaError_t e = memset_grad_value(pr, bytes, stream);
            if (e != cudaSuccess) return e;
            msda_backward_fast<T, 2 * G, false, false, false, 2, true><<<grid, 256, 0, stream>>>(*pr);
            return cudaSuccess;
        } else if constexpr (!DET && std::is_same<T, __nv_bfloat16>::value) {
            const cudaError_t e = memset_grad_value(pr, bytes, stream);
            if (e != cudaSuccess) return e;
            msda_backward_fast<T, G, false, false, false, 4, true><<<grid, 256, 0, stream>>>(*pr);
            return cudaSuccess;
        }
        break;
    case MSDA_ROUTE_POINT: {
        const cudaError_t e = memset_grad_value(pr, bytes, stream);
        if (e != cudaSuccess) return e;
        if (opt) msda_backward_fast<T, G, DET, true><<<grid, 256, 0, stream>>>(*pr);
        else msda_backward_fast<T, G, DET, false><<<grid, 256, 0, stream>>>(*pr);
        return cudaSuccess;
    }
    default: break;
    }
    return cudaErrorNotSupported;
}

template <typename T, bool DET>
static cudaError_t launch_kernels(const msda_problem *pr, const msda_backward_plan &plan,
                                  cudaStream_t stream, int64_t bytes) {
    if constexpr (HasFast<T>::value) {
        switch (plan.group) {
        case 1: return launch_fast<T, 1, DET>(pr, plan, stream, bytes);
        case 2: return launch_fast<T, 2, DET>(pr, plan, stream, bytes);
        case 4: return launch_fast<T, 4, DET>(pr, plan, stream, bytes);
        case 8: return launch_fast<T, 8, DET>(pr, plan, stream, bytes);
        case 16: return launch_fast<T, 16, DET>(pr, plan, stream, bytes);
        case 32: return launch_fast<T, 32, DET>(pr, plan, stream, bytes);
        default: break;
        }
    }
    if (plan.kernel != MSDA_ROUTE_GENERIC) return cudaErrorNotSupported;
    const cudaError_t e = memset_grad_value(pr, bytes, stream);
    if (e != cudaSuccess) return e;
    msda_backward_kernel<T, DET><<<warp_blocks(pr->B * pr->Q * pr->H), 256, 0, stream>>>(*pr);
    return cudaSuccess;
}

template <typename T> static cudaError_t launch(const msda_problem *pr, cudaStream_t stream) {
    const int64_t n_value = pr->B * pr->S * pr->H * pr->C;
    const msda_backward_plan plan = plan_of(pr);
    if (plan.modifiers & MSDA_ROUTE_F32_WORKSPACE) {
        if constexpr (IsHalf<T>::value) {
            /* the kernels scatter into the f32 buffer, then it is converted */
            msda_problem buffered = *pr;
            buffered.grad_value = pr->workspace;
            cudaError_t e = cudaMemsetAsync(pr->workspace, 0, (size_t)n_value * 4, stream);
            if (e == cudaSuccess && plan.kernel != MSDA_ROUTE_NONE)
                e = launch_kernels<T, false>(&buffered, plan, stream, 0);
            if (e != cudaSuccess) return e;
            half_convert_kernel<T><<<flat_blocks(n_value), 256, 0, stream>>>(*pr);
            return cudaSuccess;
        }
        return cudaErrorNotSupported;
    }
    if (plan.kernel == MSDA_ROUTE_NONE)
        return memset_grad_value(pr, n_value * (int64_t)sizeof(T), stream);
    if (!(plan.modifiers & MSDA_ROUTE_DETERMINISTIC))
        return launch_kernels<T, false>(pr, plan, stream, n_value * (int64_t)sizeof(T));
    cudaError_t e = cudaMemsetAsync(pr->workspace, 0, MSDA_DET_HEADER_BYTES + (size_t)n_value * 8, stream);
    if (e != cudaSuccess) return e;
    det_scan_kernel<T><<<flat_blocks(pr->B * pr->Q * pr->H * pr->C), 256, 0, stream>>>(*pr);
    e = launch_kernels<T, true>(pr, plan, stream, 0);
    if (e != cudaSuccess) return e;
    det_convert_kernel<T><<<flat_blocks(n_value), 256, 0, stream>>>(*pr);
    return cudaSuccess;
}

// ---------------------------------------------------------------------------------------------
// entry point

extern "C" int msda_cuda_backward(const msda_problem *pr) {
    static const char fn[] = "msda_backward";
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

extern "C" int64_t msda_cuda_workspace_size(const msda_problem *pr) {
    /* MSDA_DETERMINISTIC: the header, then one 64-bit fixed-point accumulator per grad_value
     * element; MSDA_ROUTE_F32_WORKSPACE: the f32 accumulation buffer (asked with a stand-in for
     * grad_value: the callers size the workspace of a call that wants it) */
    const int64_t n_value = pr->B * pr->S * pr->H * pr->C;
    if (pr->flags & MSDA_DETERMINISTIC) return MSDA_DET_HEADER_BYTES + n_value * 8;
    msda_problem wanted = *pr;
    static char stand_in;
    wanted.grad_value = &stand_in;
    return msda_backward_f32_workspace(&wanted, sm90_code(pr->device)) ? n_value * 4 : 0;
}

extern "C" int msda_cuda_device_facts(int device, int *multiprocessors, int *sm90) {
    static const char fn[] = "msda_backward_route";
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess || device < 0 || device >= count) {
        cudaGetLastError();
        return msda_set_error(MSDA_ERR_INVALID_ARGUMENT, "%s: no CUDA device %d (%d visible)", fn,
                              device, count);
    }
    *multiprocessors = sm_count(device);
    *sm90 = sm90_code(device);
    return MSDA_OK;
}
