/* c/routes.c: which kernel serves a CUDA forward or backward (the routes of c/msda.h), chosen
 * here and only here. Plain C, in every build: the CUDA launchers turn the plan into a kernel
 * instance (kernels/forward.cuh with_forward_kernel, kernels/backward.cuh with_backward_kernel),
 * msda_forward_route and msda_backward_route report it, and a CPU-only build can still be asked
 * what a GPU would run. Each grid is sized with the block sizes of c/launch.h. The numbers
 * behind each rule are in kernels/TUNING.md. */
#include "msda_internal.h"

static int is_half(int dtype) { return msda_dtype_half(dtype); }

int msda_fast_group(const msda_problem *pr) {
    if (!msda_dtype_acc_f32(pr->dtype) || pr->C % 4 != 0) return 0;
    const int64_t G = pr->C / 4;
    if (G > 32 || (G & (G - 1)) != 0) return 0;
    /* the fast kernels' offsets and items are int32, and an item index is a block's first
     * item plus a thread's (< 1024): both stay below 2^31 */
    const int64_t limit = (int64_t)1 << 31;
    if (pr->B * pr->S * pr->H * pr->C >= limit || pr->B * pr->Q * pr->H > limit - 1024 ||
        pr->L > MSDA_FAST_MAX_LEVELS || pr->NP >= limit)
        return 0;
    return (int)G;
}

/* Lane groups an item's points are split over in the direct forward: about
 * MSDA_FWD_DIRECT_LANE_POINTS points a lane (at most 4 groups, one warp an item), doubled once
 * more while the grid has fewer than MSDA_FWD_DIRECT_MIN_LANES lanes. */
static int direct_split(const msda_problem *pr, int64_t items, int G) {
    int split = 1;
    while (split < 4 && G * 2 * split <= 32 && split * MSDA_FWD_DIRECT_LANE_POINTS < pr->NP)
        split *= 2;
    while (split < 4 && G * 2 * split <= 32 && 2 * split <= pr->NP &&
           items * G * split < MSDA_FWD_DIRECT_MIN_LANES)
        split *= 2;
    return split;
}

void msda_plan_forward(const msda_problem *pr, int aligned16, msda_forward_plan *plan) {
    const int64_t items = pr->B * pr->Q * pr->H;
    const int G = aligned16 ? msda_fast_group(pr) : 0;
    const int direct = !msda_uses_options(pr) && G > 0 && pr->S >= 1 &&
                       (pr->NP <= MSDA_FWD_DIRECT_MAX_POINTS || items * G < MSDA_FWD_DIRECT_LANES);
    /* half types in encoders, and in the direct kernel: 8 channels a thread, half the threads
     * an item */
    const int wide = is_half(pr->dtype) && G >= 2 && (direct || items >= MSDA_FWD_WIDE_MIN_ITEMS);
    plan->options = msda_uses_options(pr);
    plan->vec = wide ? 8 : 4;
    plan->group = wide ? G / 2 : G;
    plan->split = 1;
    if (pr->B * pr->Q == 0) {
        plan->kernel = MSDA_FWD_ROUTE_NONE;
        plan->group = 0;
        plan->blocks = 1;
    } else if (G == 0) {
        plan->kernel = MSDA_FWD_ROUTE_GENERIC;
        plan->blocks = msda_grid_blocks(items, MSDA_GENERIC_BLOCK_ITEMS, MSDA_MAX_GRID_BLOCKS);
    } else if (direct) {
        plan->kernel = MSDA_FWD_ROUTE_DIRECT;
        plan->split = direct_split(pr, items, plan->group);
        plan->blocks = msda_grid_blocks(items, MSDA_DIRECT_BLOCK_ITEMS(plan->group * plan->split),
                                        MSDA_MAX_GRID_BLOCKS);
    } else {
        plan->kernel = wide ? MSDA_FWD_ROUTE_WIDE : MSDA_FWD_ROUTE_FAST;
        const int threads = wide ? MSDA_FWD_WIDE_THREADS : MSDA_BLOCK_THREADS;
        plan->blocks = msda_grid_blocks(items, MSDA_STAGED_BLOCK_ITEMS(threads, plan->group),
                                        MSDA_MAX_GRID_BLOCKS);
    }
}

/* A half grad_value is summed in an f32 buffer only by code older than sm_90 (no half vector
 * atomics). Calls with float32 points (MSDA_POINTS_F32: autocast's inputs) sum it as the
 * all-half call does on the same code: the points are read as float32 whatever the route. */
int msda_backward_f32_workspace(const msda_problem *pr, int sm90_code) {
    return is_half(pr->dtype) && pr->grad_value && !(pr->flags & MSDA_DETERMINISTIC) &&
           !sm90_code;
}

/* Slices of each item's points: a grid too small to fill the GPU twice over (decoders of a few
 * hundred queries) splits every item's points over up to MSDA_BWD_MAX_SLICES blocks, at least 4
 * points a slice, so more blocks run; point gradients are per point and grad_value is atomic,
 * so slices need no reduction. */
static int point_slices(const msda_problem *pr, unsigned int blocks, int multiprocessors) {
    if (multiprocessors <= 0) return 1;
    if ((int64_t)blocks >= 2LL * multiprocessors) return 1;
    const int64_t want = (int64_t)multiprocessors * MSDA_BWD_RESIDENT_BLOCKS;
    int64_t slices = (want + blocks - 1) / blocks;
    if (slices > pr->NP / 4) slices = pr->NP / 4;
    if (slices > MSDA_BWD_MAX_SLICES) slices = MSDA_BWD_MAX_SLICES;
    return slices < 1 ? 1 : (int)slices;
}

/* The lane groups of the direct backward for a plain decoder, or 0 where it does not serve:
 * items of at most MSDA_BWD_DIRECT_FEW_POINTS points, and f32 or f16 problems of fewer than
 * MSDA_BWD_DIRECT_LANES lanes (bf16 decoders keep their pipelined kernel, which is faster
 * there: kernels/TUNING.md, backward d4); at most MSDA_BWD_DIRECT_MAX_POINTS points a lane. */
static int direct_backward_split(const msda_problem *pr, int64_t items, int G) {
    const int few = pr->NP <= MSDA_BWD_DIRECT_FEW_POINTS;
    if (pr->S < 1 || !(few || (pr->dtype != MSDA_BF16 && items * G < MSDA_BWD_DIRECT_LANES)))
        return 0;
    int split = 1;
    while (split < 4 && (pr->NP + split - 1) / split > MSDA_BWD_DIRECT_MAX_POINTS) split *= 2;
    if ((pr->NP + split - 1) / split > MSDA_BWD_DIRECT_MAX_POINTS || G * split > 32) return 0;
    while (split < 4 && 2 * split <= pr->NP && G * 2 * split <= 32 &&
           items * G * split < MSDA_FWD_DIRECT_LANES)
        split *= 2;
    return split;
}

void msda_plan_backward(const msda_problem *pr, int aligned16, int multiprocessors,
                        int sm90_code, msda_backward_plan *plan) {
    const int det = (pr->flags & MSDA_DETERMINISTIC) && pr->grad_value && pr->B * pr->Q > 0;
    const int64_t items = pr->B * pr->Q * pr->H;
    plan->modifiers = (det ? MSDA_ROUTE_DETERMINISTIC : 0) |
                      (msda_backward_f32_workspace(pr, sm90_code) ? MSDA_ROUTE_F32_WORKSPACE : 0);
    plan->group = 0;
    plan->options = msda_uses_options(pr);
    plan->slices = 1;
    plan->split = 1;
    plan->blocks = 1;
    if (pr->B * pr->Q == 0) {
        plan->kernel = MSDA_ROUTE_NONE;
        return;
    }
    const int G = aligned16 ? msda_fast_group(pr) : 0;
    if (G == 0) {
        plan->kernel = MSDA_ROUTE_GENERIC;
        plan->blocks = msda_grid_blocks(items, MSDA_GENERIC_BLOCK_ITEMS, MSDA_MAX_GRID_BLOCKS);
        return;
    }
    /* encoders: each pixel's query samples around its own pixel, so a block's corners repeat
     * value rows; decoders, whose queries scatter, are slower there, even with many queries a
     * position (kernels/TUNING.md, backward v53; bev_sca) */
    const int aggregates = pr->Q == pr->S && pr->Q * pr->NP >= 2 * pr->S;
    plan->group = G;
    plan->blocks = msda_grid_blocks(items, MSDA_STAGED_BLOCK_ITEMS(MSDA_BLOCK_THREADS, G),
                                    MSDA_MAX_GRID_BLOCKS);
    plan->slices = point_slices(pr, plan->blocks, multiprocessors);
    const int split = direct_backward_split(pr, items, G);
    if (!det && !plan->options && !aggregates && split > 0) {
        plan->kernel = MSDA_ROUTE_DIRECT;
        plan->split = split;
        plan->slices = 1;
        plan->blocks = msda_grid_blocks(items, MSDA_DIRECT_BLOCK_ITEMS(G * split),
                                        MSDA_MAX_GRID_BLOCKS);
    } else if (G >= 4 && aggregates) {
        plan->kernel = MSDA_ROUTE_AGGREGATED;
        plan->blocks = msda_grid_blocks(items, MSDA_AGG_BLOCK_ITEMS(G), MSDA_MAX_GRID_BLOCKS);
        plan->slices = point_slices(pr, plan->blocks, multiprocessors);
    } else if (!det && !plan->options && plan->slices > 1 && pr->dtype != MSDA_F16) {
        /* sliced points scattered after the zeroing: faster than the per-point kernel with
         * sliced points in f32 and bf16; f16 is not and takes that kernel (kernels/TUNING.md,
         * "Re-measured in the redesign": POINT_SLICED) */
        plan->kernel = MSDA_ROUTE_POINT_SLICED;
    } else if (!det && !plan->options && !aggregates && pr->dtype == MSDA_F32 && G <= 16) {
        /* 2 channels a thread: groups of 2 * G threads, twice the 4-channel form's */
        plan->kernel = MSDA_ROUTE_POINT_PIPELINED;
        plan->blocks = msda_grid_blocks(items, MSDA_STAGED_BLOCK_ITEMS(MSDA_BLOCK_THREADS, 2 * G),
                                        MSDA_MAX_GRID_BLOCKS);
        plan->slices = point_slices(pr, plan->blocks, multiprocessors);
    } else if (!det && !plan->options && !aggregates && pr->dtype == MSDA_BF16) {
        plan->kernel = MSDA_ROUTE_POINT_PIPELINED;
    } else {
        plan->kernel = MSDA_ROUTE_POINT;
    }
}
