/* c/launch.h: the CUDA kernels' block sizes, named once. c/routes.c sizes each route's grid with
 * them, and kernels/ build each kernel (its launch bound, block-stride loops and staging) and
 * launch it with them. A route becomes a kernel instance in one function per pass (kernels/:
 * with_forward_kernel, with_backward_kernel), whose kernel types carry the block they are
 * launched with and the items a block takes; tests/c/test_launch_shapes.cu asks it, for every
 * route c/routes.c chooses, whether an instance exists and whether the grid fits that block.
 * Plain C, includable from CUDA C++. */
#ifndef MSDA_LAUNCH_H
#define MSDA_LAUNCH_H

/* Threads a block of every kernel but the wide forward and zero_kernel
 * (kernels/backward_aux.cuh, MSDA_ZERO_THREADS). */
#define MSDA_BLOCK_THREADS 256
/* Threads a block of the wide forward (8 channels a thread): the fastest of 64, 128 and 256
 * (kernels/TUNING.md, forward v20; the 4-channel kernels take 256). */
#define MSDA_FWD_WIDE_THREADS 128

/* Items (b, q, h) a block takes. The generic kernels: one warp an item. */
#define MSDA_GENERIC_BLOCK_ITEMS (MSDA_BLOCK_THREADS / 32)
/* The staged (fast) kernels, `threads` a block: a group of G threads an item. */
#define MSDA_STAGED_BLOCK_ITEMS(threads, G) ((threads) / (G))
/* The aggregated backward: two items a group of G threads. */
#define MSDA_AGG_BLOCK_ITEMS(G) (2 * MSDA_BLOCK_THREADS / (G))
/* The direct kernels: `lanes` (G * SPLIT) lanes an item. */
#define MSDA_DIRECT_BLOCK_ITEMS(lanes) (MSDA_BLOCK_THREADS / (lanes))

#endif /* MSDA_LAUNCH_H */
