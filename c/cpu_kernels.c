/* c/cpu_kernels.c: MSDA forward and backward on the CPU, threaded with OpenMP.
 *
 * out[b,q,h,c] = sum_{l,p} A[b,q,h,l,p] * bilinear(V_l[b,:,:,h,c], x = loc_x*W_l - 0.5,
 *                                                                  y = loc_y*H_l - 0.5)
 * Layouts as in msda.h; a "row" is the C channels of value[b, s, h, :] (H*C elements apart from
 * the next position). The per-dtype kernels are cpu_kernels.inc, included once per element type.
 *
 * Geometry (GEOMETRY in the .inc): the points of one (b, q, h) are located GROUP = 16 at a time
 *   in one loop that runs lane-wise over the points and vectorises: x, y, the cell, the fraction
 *   and the four corners' element offsets in double, where they are exact, so fx = x - floor(x)
 *   is rounded once and no 64-bit integer multiply (which AVX2 lacks) is needed; each point's
 *   level W, H and start come from a per-call table of L*P entries (level_table; one entry per
 *   level past 65536 points, ~8% slower, which keeps the table under 1.5 MB). The corners
 *   are stored corner-major ([k][j]), whole vectors at a time. A point or corner outside its
 *   level (or outside [0, S), for lying shape tables) reads a zero row with weight 0.
 * Query order (QUERY_ORDER in the .inc): a decoder's queries (Q != S, Q <= 4096) come in
 *   arbitrary order, so consecutive queries sample far apart in a map of several MB (a cache and
 *   TLB miss per row). Both passes walk each batch's queries in Z-order of where they sample (the
 *   mean of each head's first point, 256 x 256 grid, a stable radix sort: a few microseconds),
 *   so that neighbouring queries share lines and pages; the rows of sampling_locations,
 *   attention_weights and output, now read out of order, are prefetched two queries ahead. The
 *   order depends on the inputs only: the forward's results are unchanged, grad_value's rows sum
 *   their contributions in this order (whatever the threads).
 * Forward: tasks of (b, q) rows (in query order), all heads of a query together (its heads read
 *   neighbouring value rows). Per (b, q, h): the group's 4 x 16 corner rows are summed into CHUNK
 *   accumulators that stay in vector registers (GATHER_FULL: 4 FMAs a corner for C = 32 with
 *   AVX2), while the next group is located and its rows prefetched.
 * Backward: a task owns grad_value[b, :, h_begin:h_end, :] and writes the location and weight
 *   gradients of those heads' points: no two threads write the same element, no lock or atomic.
 *   It walks its points query-major (all its heads of query q, then q + 1), like the forward:
 *   the heads of a query sample around one reference point, so consecutive groups share pages
 *   and lines (slice-major, one head at a time, was 1.3x slower). Tasks own whole batches (all
 *   heads: a contiguous grad_value block the task zeroes itself just before scattering into it,
 *   no barrier) when the batches divide evenly among the threads or number 4 a thread or more;
 *   else blocks of heads, two tasks a thread at least, after all threads have zeroed grad_value
 *   together in 2 MB pieces (a block of heads is strided: zeroing it in its task was slower).
 *   Per point (POINT_BWD): with 32-byte vectors (GCC / clang vector extensions) the four dot
 *   products go . corner row as lane-wise partial sums, combined lane-wise into the three sums
 *   the point gradients need and reduced together by a fixed tree of shuffles, and the four
 *   grad_value rows updated. Groups are located one ahead and, for a map over 4 MB, their value
 *   and grad_value rows prefetched; the rows of grad_output, sampling_locations and
 *   attention_weights are prefetched 4 queries ahead. With fewer (b, h) slices than 4 per thread
 *   (B = H = 1, many threads) the work splits instead into point-gradient tasks over
 *   (b, h, query block) and grad_value tasks over (b, h, channel block).
 * Numerics: f32 accumulation for f32/f16/bf16, f64 for f64. f16/bf16 values are converted as they
 *   are loaded (once per use; half.h's conversions are branch-free so those loops vectorise) and
 *   a grad_output row once per (b, q, h). Results do not depend on the thread count or the work
 *   split: every grad_value row gets its contributions in query order whoever owns it, and the
 *   point gradients always come from the one compiled variant of the backward loop (two variants
 *   could contract the same sums into FMAs differently). The reduction trees are the same in
 *   every clone; only FMA contraction (the x86-64-v3 and v4 clones, which measured bitwise equal
 *   to each other) changes the last bits between machines.
 * Vector width: the kernels (FORWARD_ROWS, BACKWARD_TASK) are built three times with
 *   target_clones, x86-64-v4 (AVX-512; still 32-byte vectors in the channel loops, but 32
 *   registers and 8-lane double geometry), x86-64-v3 (AVX2 + FMA) and the baseline; an ifunc
 *   picks one at load time. No -march=native. Elsewhere (aarch64, clang) the baseline build only.
 * Threads: the caller's count (pymsda passes torch.get_num_threads()), tasks handed out through
 *   an atomic counter, so a thread that starts late or is preempted leaves its share to the
 *   others. libpymsda links libgomp.so.1 and torch's pip wheels ship a libgomp.so.1 too: the
 *   loader resolves both to the one already loaded (torch's, as pymsda imports torch first), so
 *   torch and pymsda share one OpenMP runtime and one thread pool (tests/test_cpu_threads.py
 *   checks it) and no second runtime spins against torch's; hence OpenMP rather than a pool of
 *   our own. One thread (a DataLoader worker: torch sets 1 there) calls no OpenMP function at
 *   all, which keeps a forked worker clear of the parent's pool (libgomp is not fork-safe, for
 *   torch's own ops either); inside an OpenMP parallel region the op runs on one thread.
 * Memory: per-thread scratch of a few C-element rows and one level table (at most 1.5 MB);
 *   outputs of 32 MB or more, which glibc maps afresh on every call, are madvise'd to transparent
 *   huge pages before their first write (fresh 40 MB grad_value: 11-21 ms of 4 KB page faults,
 *   ~3-4 ms with huge pages). Smaller ones come from glibc's reused heap, where huge pages
 *   made the occasional regrown heap cost more than it saved (v13).
 *
 * Tried (times: kernel only, 3 input sets in rotation, this 2-core AMD EPYC VM; ratios from
 * interleaved single-thread A/B runs, which the machine's noise (often +-25%) allows):
 *   v0 (the first version): per-(b,q) forward with a C-loop per corner into an accumulator in
 *      memory; per-(b,h) backward with runtime-C loops. 2 threads: small_enc f32 fwd 3.0 /
 *      bwd 12.0 ms, dec300 3.3 / 8.8, ddetr_dec 5.5 / 15.0.
 *   v1 CHUNK accumulators in registers: 1.4x SLOWER at first: GCC's unroll-and-jam (-O3) paired
 *      corners and left the channel loop scalar; -fno-loop-unroll-and-jam: forward 2x faster.
 *   v2 backward per-corner loops with `omp simd reduction`: GCC sums the lanes one by one from
 *      the stack; the fixed LANES partial sums and tree instead: backward -15..-20%.
 *   v3 LANES 16 for f16/bf16 (a 16-bit load fills a 256-bit vector only at 16 lanes; at 8 the
 *      sums went through the stack with failed store forwarding): bf16 backward -10..-15%;
 *      LANES 4 for f64: -7%. (v2, v3: replaced by v9's explicit vectors.)
 *   v4 backward prefetch of the rows a group will touch: decoders -20..-25%, small_enc +8%
 *      (1.4 MB map, in cache) -> only for maps over 4 MB; strided loc/attn/go rows prefetched
 *      4 queries ahead: -5..-20%; prefetch into L2 (locality 1) rather than L1: -10..-30%.
 *   v5 forward: next group located and prefetched while the current one is summed: f32 decoders
 *      -10%, bf16 -30..-40%.
 *   v6 vectorised geometry (it was 78-85% of the forward): forward -20..-27% (f32, bf16);
 *      needs -fno-trapping-math, else GCC will not if-convert the floating-point compares.
 *      2 threads: small_enc f32 fwd 2.5 / bwd 5.2 ms, dec300 1.0 / 2.9, ddetr_dec 1.2 / 5.8.
 *      Still short of issue 7 (dec300 f32 fwd+bwd 7.3x). From here on: 1 thread, CPU time of the
 *      calling thread (immune to the other tenants' preemption), min of 45-60 calls, A/B
 *      libraries interleaved in one process; dec300 f32 fwd 1.72 / bwd 4.4 ms at this point.
 *      Where the time went: callgrind, 217 instructions a point forward, 468 backward, the
 *      geometry ~105 of them in each; a backward that only locates points took 0.75 ms, one
 *      whose rows all lay in 16 positions (cached) 3.45 ms: part compute, part memory.
 *   v7 geometry in one loop, corner-major stores, offsets in double, the per-point level table:
 *      geometry 105 -> 55 instructions a point; fwd 1.72 -> 1.25 ms, bwd unchanged (4.37: the
 *      backward was waiting on memory, not instructions).
 *   v8 backward query-major (tasks own batches or head blocks, see above): dec300 f32 bwd
 *      4.3 -> 3.3 ms with whole batches (head blocks of 2: 3.7, of 4: 3.56); whole-batch tasks
 *      zeroing their own block, no barrier: 3.27 (the same as the shared memset on one thread,
 *      and no wait on a preempted thread); head-block tasks zeroing their strided block: 4.0-4.5
 *      against 3.45, so those keep the shared memset.
 *   v9 POINT_BWD in vector extensions (lanes combined, one shuffle tree for the three sums,
 *      replacing GCC's stack round trips): bwd f32 3.2 -> 2.97 ms, f64 5.86 -> 5.42, bf16
 *      3.87 -> 3.39.
 *   v10 prefetch of a row of <= 128 bytes as its first and last byte, no loop: f32 fwd -5%,
 *      bwd -8%; bf16 fwd -18%, bwd -14%; f64 (256-byte rows, the loop) +-3%.
 *      1 thread, dec300: f32 fwd 1.25 / bwd 2.65 ms, f64 2.2 / 5.4, bf16 1.02 / 2.9; small_enc
 *      f32 2.76 / 4.15 (was 3.55 / 6.9); ddetr_dec f32 1.54 / 4.57 (was 1.93 / 6.0). 2 threads
 *      (min, busy machine): small_enc 1.32 / 2.2, dec300 0.63 / 1.54, ddetr_dec 0.78 / 3.26.
 *      callgrind: 108 instructions a point forward, 323 backward.
 *   v11 (issue 7: dec300 f32 fwd+bwd at 8.0-9.3x the reference on 2 threads, 10x wanted).
 *      Where a python -m pymsda bench fwd+bwd call (2.6-2.8 ms) goes, 2 threads, idle machine:
 *      C forward 0.53-0.72 ms, C backward 1.4-1.6 ms (each thread zeroes its 5.5 MB batch of
 *      grad_value for 0.28 ms, then scatters for 1.27 ms; the two batches' threads end within
 *      0.02 ms of each other), the rest 0.34-0.5 ms in Python and torch (of it 0.1-0.15 ms
 *      Python's cyclic GC: with gc.freeze() the call took 2.60-2.64 ms against 2.74-2.79).
 *      1 thread, dec300 bwd 2.99 ms: without the zeroing 2.80, without the per-point work
 *      (geometry, prefetch, zeroing only) 1.15, without it and the prefetch 0.60, without the
 *      prefetch alone 4.74: the per-point work waits on memory (value and grad_value rows from
 *      L3/DRAM, 4 KB pages: 22 MB of them per call) more than on its 329 instructions.
 *      Shipped: QUERY_ORDER (above) and PREFETCH_ROWS unrolled over a full group's 64 corners
 *      (3 instructions a corner and array instead of 5: callgrind backward 329 -> 305 a point,
 *      forward 109 -> 100). 1 thread, thread CPU time, 4 libraries interleaved in one process
 *      (min / median of 126 calls): dec300 fwd 1.264 / 1.386 -> 1.163 / 1.251 ms, bwd 2.991 /
 *      3.285 -> 2.818 / 2.992; ddetr_dec fwd 1.682 / 1.835 -> 1.488 / 1.708, bwd 8.09 / 8.76 ->
 *      8.17 / 8.80 (unchanged); small_enc (Q = S: no order) fwd 2.03 / 2.11 -> 2.08 / 2.17
 *      (unroll alone, noise level), bwd 4.57 / 5.14 -> 4.44 / 5.10. Each alone gained little
 *      (order: dec300 fwd -2..-5%, bwd -2..-4%; unroll: fwd +6%, bwd -5%). Inputs permuted in
 *      Z-order beforehand (sequential rows, the same value accesses) gained more: dec300 fwd
 *      -9..-14%, bwd -8..-10% (1 and 2 threads): part of the gain is lost to the out-of-order
 *      rows.
 *      Again later (8 rounds): dec300 f32 fwd min / median 1.159 / 1.301 -> 1.097 / 1.205, bwd
 *      3.155 / 3.325 -> 3.003 / 3.204; f64 fwd 2.06 / 2.27 -> 2.14 / 2.36 (+4%: 256-byte rows,
 *      the unroll does not apply), bwd -1..-4%; bf16 fwd +2%, bwd -1..-2%.
 *      On 2 threads the whole bench call varies 2.3-3.5 ms from one process to the next, more
 *      than any change here: in some processes glibc trims and regrows the heap on every call
 *      and the grad_value zeroing takes ~85 page faults a call (3.0 against 2.4-2.6 ms a call);
 *      others have none.
 *   v12 (issue 7 again; 1 thread: thread CPU time, min / median of 60-90 calls, libraries
 *      interleaved in one process). Where v11's backward goes now, dec300 f32, 1 thread: 2.29 ms
 *      (v12 code); without the zeroing 2.14; without it and with every corner row in 8 positions
 *      (all in L1) 1.62: ~70% instructions, ~23% memory, ~7% zeroing (2 threads, v11: zeroing
 *      0.07-0.1 ms of 1.34-1.51). Instructions matter most, so:
 *      an x86-64-v4 (AVX-512) clone beside v3 and the baseline (GCC keeps the channel loops'
 *      32-byte vectors, but has 32 registers instead of 16, mask compares and 8-lane double
 *      geometry), bitwise equal to the v3 clone on the bench inputs: dec300 f32 fwd 1.178 /
 *      1.218 -> 1.092 / 1.123 ms, bwd 2.552 / 2.739 -> 2.310 / 2.517; bf16 fwd 1.093 / 1.109 ->
 *      0.987 / 1.034, bwd 2.849 / 2.975 -> 2.698 / 2.833; f16 fwd 3.11 / 3.20 -> 2.26 / 2.34, bwd
 *      4.88 / 4.97 -> 3.75 / 3.87; f64 fwd 2.25 / 2.47 -> 2.30 / 2.51 (noise), bwd 5.31 / 5.58 ->
 *      5.04 / 5.36; small_enc f32 fwd 1.93 / 1.98 -> 1.64 / 1.71, bwd 3.73 / 3.98 -> 3.10 / 3.29;
 *      ddetr_dec f32 fwd 1.60 / 1.71 -> 1.49 / 1.59, bwd 4.55 / 4.68 -> 4.23 / 4.40 (the AVX-512
 *      clone tried before v7 lost on bf16; the vectorised geometry and explicit vectors since
 *      changed that). VSPLAT as x - 0 instead of 0 + x (GCC may drop the first, not the second:
 *      4-8 adds a point fewer): bwd -1..-3%, fwd unchanged. Both together, dec300 f32: 1 thread
 *      fwd 1.208 / 1.330 -> 1.115 / 1.221 ms, bwd 2.720 / 2.863 -> 2.536 / 2.644; 2 threads
 *      (wall, 120 calls) fwd 0.639 / 0.699 -> 0.576 / 0.646, bwd 1.317 / 1.435 -> 1.193 / 1.316.
 *      <- shipped.
 *   v13 (issue 7: a python fwd + autograd.grad call on dec300 f32 took page faults that direct C
 *      calls did not). Cause, traced (strace of brk / madvise, a malloc log, malloc_info): glibc
 *      serves an eager call's four buffers (the forward's 0.6 MB output, then grad_value 11 MB,
 *      grad_loc 0.6 MB, grad_attn 0.3 MB, each posix_memalign'd by torch) from its main heap,
 *      where the first call's freed 11 MB mapping set the mmap threshold to 11 MB and the trim
 *      threshold to 22 MB. The holes they leave are split by the next call's smaller buffers and
 *      by torch's small objects that outlive a call, so now and then no hole fits grad_value: the
 *      heap grows by 10.6 MB, and a later free trims 22 MB off its top again. Each regrowth
 *      faults grad_value in during the backward's zeroing (2720 faults of 4 KB, or 676 with the
 *      huge-page advice), in 1-32 of 160 calls a process (the count varies from one process to
 *      the next and has no trend). Measured per call (fwd + autograd.grad, 160 calls a process,
 *      2 threads, 10 processes each, interleaved): the C backward 1.16-1.47 ms without a
 *      regrowth; with one 6.5-11 ms when its 2 MB pages were advised (~1.5 ms a 2 MB page: this
 *      VM's balloon reports free 2 MB blocks to the host, a likely cause) against 4.1-4.2 ms with
 *      4 KB pages. Shipped: huge-page advice only from 32 MB (glibc's largest mmap threshold: only
 *      buffers that large are mapped afresh every call): mean call 2.81 -> 2.28 ms (per process
 *      1.94-3.97 -> 1.90-2.70), median 2.13 -> 2.10 (unchanged: regrowths are rarer than half
 *      the calls); small_enc (1.4 MB) and ddetr_dec (40 MB) run the same code as before.
 *      The rest of the gap (no faults at all, MALLOC_TRIM_THRESHOLD_ / MALLOC_MMAP_THRESHOLD_
 *      set: fb 1.79-2.07 ms, C calls alone 1.59-1.70) is Python and autograd, not memory.
 *      Not shipped (regrowths per 160 calls, 4-5 processes each; v12 code 1-32): _backward
 *      allocating grad_loc, grad_attn, grad_value (0-38), grad_attn, grad_loc, grad_value (7-11)
 *      or grad_value, grad_attn, grad_loc (0-18); grad_value as the head of a buffer 16 KB,
 *      1 MB or grad_loc + grad_attn larger (0-22); the level table, query order and scratch
 *      taken from a per-thread buffer instead of malloc (2-27); the three gradients as views of
 *      one buffer: 0 in 9 processes of 10 (1 in the tenth), but the outputs would then share
 *      one storage (a grad_loc kept alive would keep grad_value's 11 MB, and torch's custom-op
 *      check rejects outputs that alias each other).
 *   Not shipped (v12 round, 1 thread, dec300 f32 bwd): the grad_output row held in 4 vector
 *   registers across the group's points with a constant 4-vector channel loop for C = 4 VL
 *   (v3 +8%: GCC spilled them and the temporaries with 16 registers; v4 +1%); the constant
 *   4-vector loop alone, grad_output from memory (v3 +5%, v4 +6..+9%); one prefetch per row of
 *   <= 128 bytes, its first line only, in the hope that the adjacent-line prefetcher brings the
 *   second (bwd 1.75x, fwd 1.9x slower: it does not); the three point sums of 8 points reduced
 *   together by REDUCE3's tree (3 shuffle-add levels for 8 sums, bitwise equal), the point
 *   gradients then stored by a loop over the group: bwd 2.382 / 2.556 -> 2.488 / 2.717 (+5%:
 *   the vectors' round trip through the stack costs more than the shuffles it saves).
 *   Not shipped before: a 4-line unrolled prefetch for rows up to 256 bytes (forward 1.8x slower:
 *   it changed how GCC compiled the forward loop); skipping the backward-only geometry fields in
 *   the forward (no gain); head blocks of 4 instead of 2 for small_enc on 2 threads (-4%, in the
 *   noise; the finer tasks kept for a preempted thread's sake); head blocks of 4 (or 2) instead of
 *   whole batches for dec300 on 2 threads (bwd min 1.55 (1.59) against 1.38 ms); locating 2 or 3
 *   groups ahead instead of 1 (no change: the backward is bound by memory throughput, not latency);
 *   prefetching the next group point by point inside the current one instead of all at once (+8%).
 *   Before v7: an AVX-512 clone (f32/f64 -3..-7%, bf16 backward +18..+27%; shipped in v12); zeroing
 *   each (b, h) slice in its own task instead of the shared memset (+0..+15%); a two-phase
 *   backward, point gradients over (b, q) rows like the forward and grad_value over (b, h)
 *   (small_enc +12..+21%, decoders +-3%); grad_value contributions counting-sorted by row and
 *   applied in one sweep that writes each row once, no memset (1.15-2.7x slower: strided stores
 *   read each line first); the split mode for every shape (dec300 backward +15%). For v11: no
 *   zeroing pass, a bit per grad_value row of the task instead (set when a row is first scattered
 *   to, whose stale contents a mask then ignores; unreached rows zeroed after the task): dec300 bwd
 *   1 thread 3.08 -> 3.90 ms (+90 instructions a point: the bit test-and-set per corner is a chain
 *   through memory, and the zeroing it saves cost only 0.1-0.19 ms); zeroing the batch with
 *   non-temporal stores (2 threads bwd +10%: the scatter then reads every row from DRAM). The
 *   forward walking its task's rows head by head (each head's rays of ~18 neighbouring queries
 *   overlap) instead of query by query: dec300 fwd 1.143 -> 1.316 ms; the forward locating 2 groups
 *   ahead instead of 1: 1.695 -> 1.720 (median, busy machine), no gain.
 *   After v11, for decoders: a gather backward (8-byte records per inside corner: f32
 *   coefficient and packed query and row; a stable counting sort by row per task; one pass over
 *   the task's rows in memory order writing each once, zeros or the sum of coefficient times
 *   grad_output row, non-temporal stores), bitwise equal to v11: C backward alone, 2 threads,
 *   min / median: dec300 f32 1.45-1.64 / 1.66-1.84 ms -> 1.91-2.34 / 2.12-2.54; ddetr_dec 2.53 /
 *   2.69 -> 3.44 / 3.59; 1 thread dec300 3.07-3.37 -> 4.0-4.7 (median). The per-point work alone
 *   (geometry, value rows, point gradients) takes 0.94 ms a batch a thread and writing the zero
 *   rows 0.2 ms; the records, the sort and the row pass add 1.15 ms (branchy per-row record
 *   counts, a grad_output row loaded per record) where v11's zeroing and scatter cost 0.6 ms.
 */
#if !defined(_DEFAULT_SOURCE)
#define _DEFAULT_SOURCE /* madvise under -std=c11 */
#endif
#include <stdlib.h>
#include <string.h>

#if defined(__linux__)
#include <sys/mman.h>
#endif

#include "half.h"
#include "msda_internal.h"

#ifdef _OPENMP
#include <omp.h>
#endif

// ---------------------------------------------------------------------------------------------
// helpers

/* Kernels whose inner loops pay off with wider vectors get AVX-512 (x86-64-v4) and AVX2+FMA
 * (x86-64-v3) clones beside the baseline one; the loader picks one per process through an ifunc.
 * The v4 clone keeps the backward's 32-byte vectors (GCC's generic tuning prefers 256-bit ones)
 * but has 32 vector registers (no spills around the channel loops), mask compares and 8-lane
 * double geometry: fewer instructions a point, the same operations and results as v3 (v12 in
 * the header). Elsewhere (aarch64, compilers without target_clones) the attribute is empty and
 * the baseline build is used. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && defined(__linux__) && \
    !defined(MSDA_NO_CLONES)
#define MSDA_CLONES \
    __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define MSDA_CLONES
#endif

/* The level of every point (l, p) of a (b, q, h), read from the caller's int32/int64 shape
 * tensors: its W, H and start offset as doubles (the sampling geometry's type), one entry per
 * point so the geometry loop loads them as vectors. One allocation of 3 * L * P doubles, or, past
 * LEVEL_TABLE_MAX_POINTS points, of 3 * L (one entry per level, looked up point by point). */
#ifndef LEVEL_TABLE_MAX_POINTS
#define LEVEL_TABLE_MAX_POINTS ((int64_t)1 << 16)
#endif
typedef struct {
    int per_point; /* 1: entry p for point p of L * P; 0: entry l for level l */
    int64_t P;
    double *w, *h, *start;
} level_table;

static int read_levels(const msda_problem *pr, const char *fn, level_table **out) {
    const int64_t LP = pr->L * pr->P;
    const int per_point = LP <= LEVEL_TABLE_MAX_POINTS;
    const int64_t entries = per_point ? LP : pr->L, copies = per_point ? pr->P : 1;
    /* Offsets are computed in double (exact below 2^52 elements); a tensor that large cannot
     * exist in a 48-bit address space, so this only refuses lying sizes. */
    if (pr->B * pr->S * pr->H * pr->C >= ((int64_t)1 << 50))
        return msda_set_error(MSDA_ERR_INVALID_ARGUMENT, "%s: value has %lld elements, more "
                              "than the CPU kernels support (2^50)", fn,
                              (long long)(pr->B * pr->S * pr->H * pr->C));
    level_table *t =
        (level_table *)malloc(sizeof(level_table) + 3 * (size_t)entries * sizeof(double));
    if (!t)
        return msda_set_error(MSDA_ERR_INTERNAL, "%s: host malloc of %lld level entries failed",
                              fn, (long long)entries);
    t->per_point = per_point;
    t->P = pr->P;
    t->w = (double *)(t + 1);
    t->h = t->w + entries;
    t->start = t->h + entries;
    for (int64_t l = 0; l < pr->L; l++) {
        int64_t h, w, start;
        if (pr->index_dtype == MSDA_I64) {
            const int64_t *ss = (const int64_t *)pr->spatial_shapes;
            h = ss[2 * l];
            w = ss[2 * l + 1];
            start = ((const int64_t *)pr->level_start_index)[l];
        } else {
            const int32_t *ss = (const int32_t *)pr->spatial_shapes;
            h = ss[2 * l];
            w = ss[2 * l + 1];
            start = ((const int32_t *)pr->level_start_index)[l];
        }
        /* A level no point can land in (empty, or too large for exact double geometry). */
        if (h <= 0 || w <= 0 || h > ((int64_t)1 << 40) || w > ((int64_t)1 << 40)) h = w = 0;
        for (int64_t p = l * copies; p < (l + 1) * copies; p++) {
            t->w[p] = (double)w;
            t->h[p] = (double)h;
            t->start[p] = (double)start;
        }
    }
    *out = t;
    return MSDA_OK;
}

/* Threads for a call with `work` sampling points: the caller's count (torch.get_num_threads()),
 * the OpenMP default when it passed <= 0, and 1 for tiny calls (a team costs more than it saves)
 * or when called from inside an OpenMP parallel region (a nested team would oversubscribe).
 * With 1 thread no OpenMP function is called at all, which keeps a forked DataLoader worker
 * (torch sets 1 thread there) clear of the parent's thread pool, which fork does not copy. */
static int thread_count(const msda_problem *pr, int64_t work) {
#ifdef _OPENMP
    if (pr->num_threads == 1 || work < 2048) return 1;
    if (omp_in_parallel()) return 1;
    const int n = pr->num_threads > 0 ? pr->num_threads : omp_get_max_threads();
    return n > 1 ? n : 1;
#else
    (void)pr, (void)work;
    return 1;
#endif
}

static inline int msda_thread_num(void) {
#ifdef _OPENMP
    return omp_get_thread_num();
#else
    return 0;
#endif
}

static inline int msda_num_threads(void) {
#ifdef _OPENMP
    return omp_get_num_threads();
#else
    return 1;
#endif
}

/* Asks Linux to back a large output buffer, which the kernel is about to write in full, with
 * transparent huge pages. Python allocates outputs fresh on every call and glibc maps buffers
 * above 32 MB (its largest dynamic mmap threshold) afresh each time, so their first touch is one
 * page fault per 4 KB (ddetr_dec grad_value, 40 MB: 11-21 ms of faults here, against ~3 ms with
 * huge pages). A smaller buffer is mapped afresh only on the first call, then served from the
 * heap, whose pages are mapped already unless glibc trimmed the heap and grows it again; on
 * those regrowths (1-32 calls in 160, dec300's 11 MB) the huge pages cost 5-10 ms a call against
 * ~3 ms of 4 KB faults on this VM (v13), so it is left alone. Only whole 2 MB pages
 * inside the buffer are advised, so no other memory is affected; failure is harmless. */
static void advise_huge_pages(void *ptr, int64_t bytes) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    const uintptr_t huge = (uintptr_t)2 << 20;
    if (!ptr || bytes < ((int64_t)32 << 20)) return;
    uintptr_t begin = ((uintptr_t)ptr + huge - 1) & ~(huge - 1);
    uintptr_t end = ((uintptr_t)ptr + (uintptr_t)bytes) & ~(huge - 1);
    if (end > begin) (void)madvise((void *)begin, end - begin, MADV_HUGEPAGE);
#else
    (void)ptr, (void)bytes;
#endif
}

/* Prefetches the cache lines of a row about to be read / written (the first 256 bytes: wider
 * rows are streams the hardware prefetcher follows). Locality 1 (prefetcht2 / prefetchw on x86):
 * into the outer caches, which measured 10-30% faster on the decoder shapes than into L1
 * (locality 3) and much faster than non-temporal (0). */
static inline void msda_prefetch_read(const void *row, int64_t bytes) {
    const uintptr_t first = (uintptr_t)row & ~(uintptr_t)63;
    const uintptr_t end = (uintptr_t)row + (uintptr_t)(bytes < 256 ? bytes : 256);
    for (uintptr_t a = first; a < end; a += 64) __builtin_prefetch((const void *)a, 0, 1);
}

static inline void msda_prefetch_write(void *row, int64_t bytes) {
    const uintptr_t first = (uintptr_t)row & ~(uintptr_t)63;
    const uintptr_t end = (uintptr_t)row + (uintptr_t)(bytes < 256 ? bytes : 256);
    for (uintptr_t a = first; a < end; a += 64) __builtin_prefetch((const void *)a, 1, 1);
}

/* Prefetches every line of [p, p + bytes), for reading (write 0) or writing (1). */
static inline void prefetch_span(const void *p, int64_t bytes, int write) {
    const uintptr_t end = (uintptr_t)p + (uintptr_t)bytes;
    for (uintptr_t a = (uintptr_t)p & ~(uintptr_t)63; a < end; a += 64) {
        if (write)
            __builtin_prefetch((const void *)a, 1, 1);
        else
            __builtin_prefetch((const void *)a, 0, 1);
    }
}

/* Part `part` of `parts` of [0, n). */
static void split_range(int64_t n, int part, int parts, int64_t *begin, int64_t *end) {
    *begin = n * part / parts;
    *end = n * (part + 1) / parts;
}

/* Element loads and stores (load_f32 ... store_bf16): c/half.h. */

/* 32-byte vectors (GCC / clang vector extensions) for the backward's channel loops: VL lanes of
 * the accumulation type; LOADV converts VL stored elements; VSPLAT broadcasts a scalar, as
 * x - 0 (exact, so GCC drops the subtraction; 0 + x, which is not exact for x = -0, cost an
 * add per broadcast). A target without 256-bit registers splits each operation in two, with
 * the same results. */
typedef float msda_v8f __attribute__((vector_size(32)));
typedef double msda_v4d __attribute__((vector_size(32)));
typedef uint16_t msda_v8h __attribute__((vector_size(16)));
typedef uint32_t msda_v8u __attribute__((vector_size(32)));

/* (Vectors travel through pointers: a vector argument or return value would change the ABI
 * between the clones, which GCC warns about.) */
static inline void loadv_f32(msda_v8f *v, const float *p) { memcpy(v, p, sizeof *v); }
static inline void loadv_f64(msda_v4d *v, const double *p) { memcpy(v, p, sizeof *v); }
static inline void loadv_bf16(msda_v8f *v, const uint16_t *p) {
    msda_v8h h;
    memcpy(&h, p, sizeof h);
    const msda_v8u u = __builtin_convertvector(h, msda_v8u) << 16;
    memcpy(v, &u, sizeof *v);
}
static inline void loadv_f16(msda_v8f *v, const uint16_t *p) {
    for (int i = 0; i < 8; i++) (*v)[i] = msda_half_to_float(p[i]);
}

/* The lane sums of three vectors a, b, c, each by a fixed tree: lanes i and i + VL/2 first. */
static inline void reduce3_v8f(const msda_v8f *a, const msda_v8f *b, const msda_v8f *c,
                               float *sums) {
    const msda_v8f z = {0, 0, 0, 0, 0, 0, 0, 0};
    const msda_v8f x = __builtin_shufflevector(*a, *b, 0, 1, 2, 3, 8, 9, 10, 11) +
                       __builtin_shufflevector(*a, *b, 4, 5, 6, 7, 12, 13, 14, 15);
    const msda_v8f y = __builtin_shufflevector(*c, z, 0, 1, 2, 3, 8, 9, 10, 11) +
                       __builtin_shufflevector(*c, z, 4, 5, 6, 7, 12, 13, 14, 15);
    /* lanes 0, 1: a; 2, 3: c; 4, 5: b; 6, 7: zero */
    const msda_v8f t = __builtin_shufflevector(x, y, 0, 1, 8, 9, 4, 5, 12, 13) +
                       __builtin_shufflevector(x, y, 2, 3, 10, 11, 6, 7, 14, 15);
    sums[0] = t[0] + t[1];
    sums[1] = t[4] + t[5];
    sums[2] = t[2] + t[3];
}

static inline void reduce3_v4d(const msda_v4d *a, const msda_v4d *b, const msda_v4d *c,
                               double *sums) {
    const msda_v4d z = {0, 0, 0, 0};
    const msda_v4d x = __builtin_shufflevector(*a, *b, 0, 1, 4, 5) +
                       __builtin_shufflevector(*a, *b, 2, 3, 6, 7);
    const msda_v4d y = __builtin_shufflevector(*c, z, 0, 1, 4, 5) +
                       __builtin_shufflevector(*c, z, 2, 3, 6, 7);
    sums[0] = x[0] + x[1];
    sums[1] = x[2] + x[3];
    sums[2] = y[0] + y[1];
}

/* x and y (8 bits each) interleaved, x in the even bits: the Z-curve index of cell (x, y). */
static inline uint32_t morton16(uint32_t x, uint32_t y) {
    x &= 255, y &= 255;
    x = (x | x << 4) & 0x0f0f, y = (y | y << 4) & 0x0f0f;
    x = (x | x << 2) & 0x3333, y = (y | y << 2) & 0x3333;
    x = (x | x << 1) & 0x5555, y = (y | y << 1) & 0x5555;
    return x | y << 1;
}

// ---------------------------------------------------------------------------------------------
// kernels, one set per element type (CHUNK: channels one register-resident accumulator holds in
// the forward; VEC / VL: the backward's 32-byte vector type and its lanes)

/* Points located together (lane-wise) before their channel loops run. */
#define GROUP 16
/* Most queries (per batch) that QUERY_ORDER sorts (a decoder has 100-900; its keys hold q in 16
 * bits, and the sort is a scratch of Q entries). */
#define ORDER_MAX_QUERIES 4096
/* value tensors above this size get the rows the backward gathers prefetched */
#define PREFETCH_MIN_BYTES ((int64_t)4 << 20)

#define SCALAR float
#define ACC float
#define SUFFIX f32
#define VEC msda_v8f
#define VL 8
#define VSPLAT(x) ((x) - (msda_v8f){0})
#define REDUCE3 reduce3_v8f
#define CHUNK 32
#define HALF_STORAGE 0
#include "cpu_kernels.inc"

#define SCALAR double
#define ACC double
#define SUFFIX f64
#define VEC msda_v4d
#define VL 4
#define VSPLAT(x) ((x) - (msda_v4d){0})
#define REDUCE3 reduce3_v4d
#define CHUNK 16
#define HALF_STORAGE 0
#include "cpu_kernels.inc"

#define SCALAR uint16_t
#define ACC float
#define SUFFIX f16
#define VEC msda_v8f
#define VL 8
#define VSPLAT(x) ((x) - (msda_v8f){0})
#define REDUCE3 reduce3_v8f
#define CHUNK 32
#define HALF_STORAGE 1
#include "cpu_kernels.inc"

#define SCALAR uint16_t
#define ACC float
#define SUFFIX bf16
#define VEC msda_v8f
#define VL 8
#define VSPLAT(x) ((x) - (msda_v8f){0})
#define REDUCE3 reduce3_v8f
#define CHUNK 32
#define HALF_STORAGE 1
#include "cpu_kernels.inc"

// ---------------------------------------------------------------------------------------------
// entry points

int msda_cpu_forward(const msda_problem *pr) {
    level_table *lv = NULL;
    int st = read_levels(pr, "msda_forward", &lv);
    if (st != MSDA_OK) return st;
    switch (pr->dtype) {
    case MSDA_F32: st = forward_f32(pr, lv); break;
    case MSDA_F64: st = forward_f64(pr, lv); break;
    case MSDA_F16: st = forward_f16(pr, lv); break;
    case MSDA_BF16: st = forward_bf16(pr, lv); break;
    default: st = msda_set_error(MSDA_ERR_INTERNAL, "msda_forward: dtype %d", pr->dtype);
    }
    free(lv);
    return st;
}

int msda_cpu_backward(const msda_problem *pr) {
    level_table *lv = NULL;
    int st = read_levels(pr, "msda_backward", &lv);
    if (st != MSDA_OK) return st;
    switch (pr->dtype) {
    case MSDA_F32: st = backward_f32(pr, lv); break;
    case MSDA_F64: st = backward_f64(pr, lv); break;
    case MSDA_F16: st = backward_f16(pr, lv); break;
    case MSDA_BF16: st = backward_bf16(pr, lv); break;
    default: st = msda_set_error(MSDA_ERR_INTERNAL, "msda_backward: dtype %d", pr->dtype);
    }
    free(lv);
    return st;
}
