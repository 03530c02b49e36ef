/* c/msda.h: the whole C contract of libpymsda (Multi-Scale Deformable Attention).
 *
 * This is the only header the Python side mirrors (pymsda/_clib.py). It includes no CUDA and no
 * torch header: streams are `void *`, tensors are raw pointers to contiguous row-major memory.
 * A call's arguments travel in one msda_args (below), whose fields say what each one is.
 *
 * Math (the one statement of it: every kernel, CPU and CUDA, computes exactly this). Per
 * (b, q, h), points i = 0 .. NP-1 (NP = L * P, or P with level_points); point i belongs to
 * level l (the P points of level 0 first, then level 1's, ...):
 *   A_i = attention_weights[b,q,h,i]
 *   x = loc_x * W_l - 0.5,  y = loc_y * H_l - 0.5,  fx = x - floor(x),  fy = y - floor(y)
 *   corner k = 2*dy + dx (dx, dy in {0, 1}) is pixel (floor(x) + dx, floor(y) + dy), weight
 *   w_k = (dx ? fx : 1 - fx) * (dy ? fy : 1 - fy);  v_k = value[b, start_l + y_k*W_l + x_k, h, :]
 *   sample_i = sum_k w_k * v_k,     out[b,q,h,:] = sum_i A_i * sample_i
 * This equals grid_sample(bilinear, zeros padding, align_corners=False) with grid = 2*loc - 1.
 * Gradients, with g = grad_output[b,q,h,:] and d_i = g . sample_i:
 *   grad_value[b, corner k of i, h, :] += A_i * w_k * g
 *   grad_attention_weights_i = d_i
 *   grad_sampling_locations_i = A_i * (W_l * g . ((1-fy)(v1 - v0) + fy (v3 - v2)),
 *                                      H_l * g . ((1-fx)(v2 - v0) + fx (v3 - v1)))
 * Out-of-range rule: a corner outside its level, or whose flat index start_l + y*W_l + x falls
 *   outside [0, S), reads 0 and receives nothing. A point with no corner inside (outside
 *   (-1, W_l) x (-1, H_l)) or a non-finite location adds nothing and gets zero location and
 *   weight gradients, whatever its A. Shape tables that disagree with value give wrong
 *   numbers at worst, never an access outside the tensors.
 * Numerics: f32 accumulation for f32/f16/bf16, f64 for f64.
 * Flags (a bitwise OR of msda_flags, 0 for the plain op above):
 *   MSDA_NEAREST: instead of bilinear(), read the single pixel
 *     (clamp(floor(loc_x*W_l + 0.5), 0, W_l-1), clamp(floor(loc_y*H_l + 0.5), 0, H_l-1)),
 *     RT-DETRv2's "discrete" sampling (which clamps both coordinates to H_l-1; here each axis is
 *     clamped to its own size). A non-finite location contributes nothing. The location
 *     gradient is 0 (the sample is piecewise constant in the location).
 *   Bit 2 (MSDA_REMOVED_SOFTMAX) was a fused softmax of the weights until ABI 8; no call took
 *     it (softmax composed with the plain op was faster), so it is refused: softmax first. The
 *     name stays until the next ABI bump, because removing it breaks the build of C callers
 *     that name it, which is the kind of change a bump announces; at that bump it goes (c/msda.c
 *     fails to compile until it does). The bit itself stays refused for good, never reused.
 *   MSDA_DETERMINISTIC (backward): grad_value is accumulated in a fixed order-independent way
 *     (64-bit fixed point in `workspace`, whose integer sums are associative), so that repeated
 *     runs give bitwise identical gradients. On CUDA it needs a workspace of
 *     msda_backward_workspace_size() bytes; the CPU backward is deterministic whatever the flag.
 *   MSDA_POINTS_F32 (with dtype MSDA_F16 or MSDA_BF16 only): sampling_locations,
 *     attention_weights and their gradients are float32, read and written as such (what
 *     torch.autocast hands a half-precision model: value from a half linear layer, locations
 *     and softmaxed weights in float32). Coordinates and weights are then computed from the
 *     float32 numbers, so no location is rounded to the value's 8 or 11 bits. value, output,
 *     grad_output and grad_value keep `dtype`; grad_value is summed as the all-half call sums
 *     it on that device (see Rules below), by the same route.
 *
 * Rules: the library never allocates device memory, never synchronises, never aborts. Every entry
 * point returns an msda_status; on failure msda_last_error() holds this thread's error text.
 * Backward writes every gradient it is given in full (grad_value is zeroed first, on the stream).
 * Half-precision grad_value on CUDA: where the kernels are built for the device's architecture
 * and it is sm_90 or newer, the kernels add f32 partial sums into grad_value itself with
 * half-precision vector atomics (each sum rounded once as it is added: in the encoders' kernel
 * the sum of all of a block's corners on one value row, elsewhere one corner's); otherwise they
 * accumulate in an f32 buffer in `workspace` that is then converted (B*S*H*C*4 bytes, which
 * msda_backward_workspace_size() reports).
 * Refused with MSDA_ERR_INVALID_ARGUMENT: a NULL msda_args, a nonzero `reserved`, a size below
 * its minimum, byte counts past INT64_MAX, a NULL tensor pointer the call needs, a pointer not
 * aligned to its element type, num_threads > 1024 on the CPU, an unknown flag, a level_points
 * table that is negative or does not sum to P, a CUDA backward whose workspace is NULL or
 * smaller than it needs, and on the CPU a value tensor of 2^50 elements or more.
 */
#ifndef MSDA_H
#define MSDA_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(_WIN32)
#define MSDA_API __declspec(dllexport)
#else
#define MSDA_API __attribute__((visibility("default")))
#endif

/* Bumped whenever a signature or a layout above changes; Python refuses a mismatched library. */
#define MSDA_ABI_VERSION 9

/* Most levels a level_points table may name (its prefix sums travel in the kernel arguments). */
#define MSDA_MAX_POINT_LEVELS 64

typedef enum {
    MSDA_OK = 0,
    MSDA_ERR_INVALID_ARGUMENT = 1, /* a size, pointer or code is out of range; text names it */
    MSDA_ERR_UNSUPPORTED = 2,      /* valid request this build cannot serve (e.g. no CUDA)   */
    MSDA_ERR_CUDA = 3,             /* the CUDA runtime reported an error; text carries it    */
    MSDA_ERR_INTERNAL = 4,         /* a bug in the library                                    */
} msda_status;

typedef enum {
    MSDA_F32 = 0,
    MSDA_F64 = 1,
    MSDA_F16 = 2,
    MSDA_BF16 = 3,
} msda_dtype;

typedef enum {
    MSDA_I64 = 0,
    MSDA_I32 = 1,
} msda_index_dtype;

typedef enum {
    MSDA_NEAREST = 1,       /* nearest-pixel sampling instead of bilinear                   */
    MSDA_REMOVED_SOFTMAX = 2, /* refused (the fused softmax of ABI <= 8, see Flags above)    */
    MSDA_DETERMINISTIC = 4, /* backward: bitwise reproducible grad_value (needs a workspace)  */
    MSDA_POINTS_F32 = 8,    /* float32 locations and weights with a half-precision dtype      */
} msda_flags;

/* ---- capabilities ------------------------------------------------------------------------- */

MSDA_API int msda_abi_version(void);
/* 1 when this build contains CUDA kernels, 0 otherwise. */
MSDA_API int msda_has_cuda(void);
/* Number of CUDA devices the library can see (0 without CUDA kernels or without a driver). */
MSDA_API int msda_cuda_device_count(void);
/* 1 when this build's CUDA kernels can run on CUDA device `device`: it embeds machine code for
 * the device's architecture, or PTX that the installed driver compiles for it. 0 otherwise, with
 * msda_last_error saying why (no CUDA kernels in this build, no such device, no code for its
 * architecture, a driver older than the PTX). Asks the driver (a context on that device). */
MSDA_API int msda_cuda_runs_on(int device);
/* Space-separated list of embedded GPU architectures, e.g. "sm_75 sm_80 ... compute_120";
 * "" in a CPU-only build. */
MSDA_API const char *msda_cuda_archs(void);
/* The CUDA toolkit version the kernels were built with as 1000*major + 10*minor, 0 if none. */
MSDA_API int msda_cuda_version(void);
/* The OpenMP runtime the CPU kernels run their threads on: the file of the one already in the
 * process (torch's), else of the system's libgomp.so.1; "" when none could be found, and the
 * kernels then run on the calling thread. Chosen once, at the first call that needs threads
 * (this query makes that choice if no call has). */
MSDA_API const char *msda_openmp_runtime(void);

/* ---- errors ------------------------------------------------------------------------------- */

MSDA_API const char *msda_status_string(int status);
/* This thread's text for the most recent failure ("" when none). */
MSDA_API const char *msda_last_error(void);

/* ---- the arguments of a call ------------------------------------------------------------------
 * msda_forward (F), msda_backward (B), msda_backward_workspace_size (W) and the two route
 * queries msda_forward_route and msda_backward_route (R) each take one msda_args; each field says
 * here, once, which of them read it. A call ignores
 * the fields it does not read, so a caller may zero the struct and set only those.
 * Tensors: contiguous row-major memory of element type `dtype` unless said otherwise; host
 * memory on the CPU, device memory on CUDA (spatial_shapes and level_start_index included). A
 * tensor pointer may be NULL only where the call reads or writes nothing through it: value when
 * S = 0; all of a forward's when B * Q = 0; all of a backward's when it wants no gradient, B = 0
 * or Q = S = 0, and with Q = 0 all but the two tables. A gradient is NULL when it is not wanted.
 * Layout: fixed-width fields in this order with no padding (`reserved` fills the one gap): 192
 * bytes, for targets with 64-bit pointers, the only ones the library is built for (c/msda.c
 * asserts it). pymsda/_clib.py mirrors it as one struct format. */
typedef struct {
    /* F B W R. B batch, S value length (sum over levels of H_l*W_l), H heads, C channels per
     * head, L levels, Q queries, P points per level (with level_points: points in all).
     * B, S, Q >= 0; H, C, L, P >= 1. */
    int64_t B, S, H, C, L, Q, P;
    /* F B W R: msda_dtype of every tensor but the two tables (and, with MSDA_POINTS_F32, the
     * locations, the weights and their gradients, which are then float32) */
    int32_t dtype;
    int32_t index_dtype; /* F B: msda_index_dtype of spatial_shapes and level_start_index */
    /* F B W R: -1 runs on the CPU; >= 0 on that CUDA device (the library selects it for the
     * launch and restores the caller's). msda_backward_route reads it only when it is not told
     * the device; msda_forward_route never (its choice depends on no device). */
    int32_t device;
    int32_t num_threads; /* F B, on the CPU: OpenMP threads, <= 0 the OpenMP default, <= 1024 */
    int32_t flags;       /* F B W R: a bitwise OR of msda_flags, 0 for the plain op */
    int32_t reserved;    /* F B W R: 0 (the layout's one gap, made explicit) */
    /* F B R. Per-level point counts (RT-DETRv2's num_points_list): NULL means every level has P
     * points. Otherwise a host array of L counts (each >= 0, L <= MSDA_MAX_POINT_LEVELS) whose
     * sum is P; sampling_locations is then (B, Q, H, P, 2) and attention_weights (B, Q, H, P),
     * the points of level 0 first, then those of level 1, and so on. With every count equal to
     * P / L the memory layout is the NULL case's. */
    const int64_t *level_points;
    const void *value;              /* F B: (B, S, H, C) */
    const void *spatial_shapes;     /* F B: (L, 2) rows (H_l, W_l), of index_dtype */
    const void *level_start_index;  /* F B: (L,) offset of level l in S, of index_dtype */
    const void *sampling_locations; /* F B: (B, Q, H, L, P, 2), last dim (x, y) normalised to
                                       [0, 1] */
    const void *attention_weights;  /* F B: (B, Q, H, L, P) */
    const void *grad_output;        /* B: (B, Q, H, C) */
    void *output;                   /* F: (B, Q, H, C) (the caller views it as (B, Q, H*C)) */
    /* B: (B, S, H, C) of dtype; on the CPU float32 for MSDA_F16 / MSDA_BF16 (the f32
     * accumulation buffer; the caller casts) */
    void *grad_value;
    void *grad_sampling_locations;  /* B: like sampling_locations */
    void *grad_attention_weights;   /* B: like attention_weights */
    /* B: scratch device memory the caller allocates, workspace_bytes of it, at least what
     * msda_backward_workspace_size() says (NULL with 0 bytes when that is 0) */
    void *workspace;
    int64_t workspace_bytes;
    void *stream; /* F B, on CUDA: a cudaStream_t (NULL = the legacy default stream) */
} msda_args;

/* ---- compute ------------------------------------------------------------------------------
 * A NULL args is refused (MSDA_ERR_INVALID_ARGUMENT; -1 from the queries). */

/* Writes output. */
MSDA_API int msda_forward(const msda_args *args);
/* Writes the gradients it is given (see Rules above). */
MSDA_API int msda_backward(const msda_args *args);

/* Bytes of device workspace msda_backward needs for these sizes, dtype, device and flags (0 when
 * it needs none: on the CPU, and on CUDA without MSDA_DETERMINISTIC unless a half-precision
 * grad_value is accumulated in f32 there, see above); -1 (with msda_last_error set) for
 * sizes msda_backward would refuse. */
MSDA_API int64_t msda_backward_workspace_size(const msda_args *args);

/* ---- which CUDA forward kernel serves a problem --------------------------------------------
 * The CUDA forward chooses one kernel per call (c/routes.c) and launches it; this query says
 * which. The choice depends on the sizes, dtype, per-level points, flags and alignment alone,
 * so any build can be asked. */
typedef enum {
    MSDA_FWD_ROUTE_NONE = 0,    /* B*Q = 0: nothing to write                                    */
    MSDA_FWD_ROUTE_GENERIC = 1, /* one warp per (b,q,h), 64-bit offsets: f64, C not 4 * 2^k up
                                   to 128, over 2^31 elements, misaligned tensors               */
    MSDA_FWD_ROUTE_FAST = 2,    /* geometry staged in shared memory, C / 4 threads an item, 4
                                   channels a thread                                            */
    MSDA_FWD_ROUTE_WIDE = 3,    /* the fast kernel with 8 channels a thread (one 16-byte load a
                                   corner): f16 / bf16, C >= 8, B*Q*H >= 65536 (encoders)        */
    MSDA_FWD_ROUTE_DIRECT = 4,  /* no staging: each lane places its own points, an item's points
                                   split over up to 4 lane groups (few points or few items)      */
} msda_fwd_route;

/* The route msda_forward takes on CUDA for these sizes, dtype, per-level points and flags.
 * aligned16: 1 when value and output are 16-byte aligned (torch's allocations are). Returns the
 * route (>= 0), or -1 with msda_last_error set for arguments msda_forward would refuse. */
MSDA_API int msda_forward_route(const msda_args *args, int aligned16);

/* ---- which CUDA backward kernel serves a problem -------------------------------------------
 * The CUDA backward chooses one route per call (c/routes.c) and launches it; this query says
 * which, for tests and for users comparing timings. A route is one kernel value OR'ed with
 * modifier bits. */
typedef enum {
    MSDA_ROUTE_NONE = 0,            /* B*Q = 0: grad_value is only zeroed                       */
    MSDA_ROUTE_GENERIC = 1,         /* one warp per (b,q,h), 64-bit offsets: f64, C not 4 * 2^k
                                       up to 128, over 2^31 elements, misaligned tensors         */
    MSDA_ROUTE_POINT = 2,           /* fast per-point kernel (geometry staged in shared memory) */
    MSDA_ROUTE_POINT_SLICED = 3,    /* per-point, each item's points split over blocks, loads
                                       overlapping the zeroing of grad_value (few items)       */
    MSDA_ROUTE_POINT_PIPELINED = 4, /* per-point, the next point's gathers issued ahead (plain
                                       f32 and bf16 decoders)                                   */
    MSDA_ROUTE_AGGREGATED = 5,      /* corners merged per value row in shared memory (encoders:
                                       Q * L * P >= 2 * S)                                      */
    MSDA_ROUTE_DIRECT = 6,          /* per-point without staging, an item's points split over up
                                       to 4 lane groups, loads overlapping the zeroing (few
                                       points an item)                                          */
    MSDA_ROUTE_KERNEL_MASK = 0xff,
    MSDA_ROUTE_DETERMINISTIC = 0x100,  /* grad_value summed in fixed point in the workspace     */
    MSDA_ROUTE_F32_WORKSPACE = 0x200,  /* half grad_value summed in f32 in the workspace        */
} msda_route;

/* The route msda_backward takes for these sizes, dtype, per-level points and flags. grads: which
 * gradients are wanted (1 grad_value, 2 grad_sampling_locations, 4 grad_attention_weights);
 * aligned16: 1 when value, grad_output and grad_value are 16-byte aligned (torch's allocations
 * are). The device: `multiprocessors` > 0 and `sm90_code` >= 0 state it (its multiprocessor
 * count; 1 when the kernels it runs are code for sm_90 or newer), so the choice can be asked
 * in any build; otherwise CUDA device args->device is asked. Returns the route (>= 0), or -1
 * with msda_last_error set for arguments msda_backward would refuse. */
MSDA_API int msda_backward_route(const msda_args *args, int grads, int aligned16,
                                 int multiprocessors, int sm90_code);

/* level_start_index (L entries of index_dtype) derived from spatial_shapes where both tables
 * live: start_l = sum over j < l of H_j * W_j, for callers that have the shapes only on a GPU
 * (reading them on the host would synchronise). From the first level whose size is < 1 or
 * overruns S on, the starts are S (such levels read nothing); an int32 start is capped at
 * 2^31 - 1. On CUDA one single-thread kernel writes them on `stream`; device -1: at once, on
 * host memory. */
MSDA_API int msda_level_starts(int64_t L, int64_t S, int index_dtype, int device,
                               const void *spatial_shapes, void *level_start_index,
                               void *stream);

#ifdef __cplusplus
}
#endif

#endif /* MSDA_H */
