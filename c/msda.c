/* c/msda.c: the public entry points of libpymsda.
 * Each one checks its arguments (a bad one gives MSDA_ERR_INVALID_ARGUMENT and a text naming it),
 * returns early on empty problems, and dispatches to the CPU kernels or the CUDA launchers. */
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "msda_internal.h"

/* More CPU threads than this is a caller's mistake, not a request OpenMP can be trusted with. */
#define MSDA_MAX_THREADS 1024

// ---------------------------------------------------------------------------------------------
// errors

static _Thread_local char last_error[1024];

int msda_set_error(int status, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(last_error, sizeof last_error, fmt, ap);
    va_end(ap);
    return status;
}

const char *msda_last_error(void) { return last_error; }

const char *msda_status_string(int status) {
    switch (status) {
    case MSDA_OK: return "ok";
    case MSDA_ERR_INVALID_ARGUMENT: return "invalid argument";
    case MSDA_ERR_UNSUPPORTED: return "unsupported";
    case MSDA_ERR_CUDA: return "CUDA error";
    case MSDA_ERR_INTERNAL: return "internal error";
    default: return "unknown status";
    }
}

// ---------------------------------------------------------------------------------------------
// capabilities

int msda_abi_version(void) { return MSDA_ABI_VERSION; }
int msda_has_cuda(void) { return msda_cuda_built(); }
int msda_cuda_device_count(void) { return msda_cuda_devices(); }
int msda_cuda_runs_on(int device) { return msda_cuda_kernels_run_on(device); }
const char *msda_cuda_archs(void) { return msda_cuda_arch_list(); }
int msda_cuda_version(void) { return msda_cuda_toolkit_version(); }


// ---------------------------------------------------------------------------------------------
// argument checks

/* a*b into *out unless it passes INT64_MAX (sizes are checked >= 0 first). */
static int mul_ok(int64_t a, int64_t b, int64_t *out) {
    if (a != 0 && b > INT64_MAX / a) return 0;
    *out = a * b;
    return 1;
}

/* Fills NP, uniform_points and point_start from level_points (NULL: P points a level). A table
 * whose counts are all equal becomes the uniform form, so the fast kernels serve it. */
static int set_points(const char *fn, msda_problem *pr, const int64_t *level_points) {
    pr->uniform_points = 1;
    if (level_points == NULL || pr->L < 1) {
        if (!mul_ok(pr->L < 1 ? 0 : pr->L, pr->P, &pr->NP))
            return msda_set_error(MSDA_ERR_INVALID_ARGUMENT, "%s: L * P = %lld * %lld overflows",
                                  fn, (long long)pr->L, (long long)pr->P);
        return MSDA_OK;
    }
    if (pr->L > MSDA_MAX_POINT_LEVELS)
        return msda_set_error(MSDA_ERR_INVALID_ARGUMENT,
                              "%s: level_points names L = %lld levels, at most %d are supported",
                              fn, (long long)pr->L, MSDA_MAX_POINT_LEVELS);
    if (pr->P > INT32_MAX)
        return msda_set_error(MSDA_ERR_INVALID_ARGUMENT,
                              "%s: P = %lld points in all must be < 2^31 with level_points", fn,
                              (long long)pr->P);
    int64_t total = 0, equal = 1;
    for (int64_t l = 0; l < pr->L; l++) {
        if (level_points[l] < 0 || level_points[l] > INT32_MAX)
            return msda_set_error(MSDA_ERR_INVALID_ARGUMENT,
                                  "%s: level_points[%lld] = %lld must be >= 0", fn,
                                  (long long)l, (long long)level_points[l]);
        pr->point_start[l] = (int32_t)total;
        total += level_points[l];
        if (total > pr->P) break;
        equal &= level_points[l] == level_points[0];
    }
    if (total != pr->P)
        return msda_set_error(MSDA_ERR_INVALID_ARGUMENT,
                              "%s: level_points must sum to P = %lld (the points per query and "
                              "head), its sum is %s%lld",
                              fn, (long long)pr->P, total > pr->P ? "more than " : "",
                              (long long)total);
    pr->point_start[pr->L] = (int32_t)total;
    pr->NP = pr->P;
    if (equal && level_points[0] > 0) { /* the plain layout */
        pr->P = level_points[0];
        return MSDA_OK;
    }
    pr->uniform_points = 0;
    return MSDA_OK;
}

/* " MSDA_F32" ..., the dtype codes the table has, for the error text */
#define DTYPE_NAME(code, ...) " " #code

static int check_problem(const char *fn, msda_problem *pr, const int64_t *level_points) {
    const struct { const char *name; int64_t v; int64_t min; } sizes[] = {
        {"B", pr->B, 0}, {"S", pr->S, 0}, {"H", pr->H, 1}, {"C", pr->C, 1},
        {"L", pr->L, 1}, {"Q", pr->Q, 0}, {"P", pr->P, 1},
    };
    for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++)
        if (sizes[i].v < sizes[i].min)
            return msda_set_error(MSDA_ERR_INVALID_ARGUMENT, "%s: size %s = %lld must be >= %lld",
                                  fn, sizes[i].name, (long long)sizes[i].v,
                                  (long long)sizes[i].min);
    /* c/msda.h, Flags: the name MSDA_REMOVED_SOFTMAX goes at the next ABI bump; bit 2 is then
     * still refused here (as the literal 2), with this text. */
    _Static_assert(MSDA_ABI_VERSION == 9, "ABI bump: retire the name MSDA_REMOVED_SOFTMAX");
    if (pr->flags & MSDA_REMOVED_SOFTMAX)
        return msda_set_error(MSDA_ERR_INVALID_ARGUMENT,
                              "%s: flags = %d has bit 2, the fused softmax, which the library no "
                              "longer has (ABI 9): apply the softmax to attention_weights first "
                              "(pymsda's softmax=True does)",
                              fn, pr->flags);
    if (pr->flags & ~(MSDA_NEAREST | MSDA_DETERMINISTIC | MSDA_POINTS_F32))
        return msda_set_error(MSDA_ERR_INVALID_ARGUMENT,
                              "%s: flags = %d has bits outside MSDA_NEAREST | "
                              "MSDA_DETERMINISTIC | MSDA_POINTS_F32",
                              fn, pr->flags);
    if ((pr->flags & MSDA_POINTS_F32) && !msda_dtype_half(pr->dtype))
        return msda_set_error(MSDA_ERR_INVALID_ARGUMENT,
                              "%s: MSDA_POINTS_F32 needs a half-precision dtype such as MSDA_F16 "
                              "or MSDA_BF16 (got dtype code %d)",
                              fn, pr->dtype);
    int st = set_points(fn, pr, level_points);
    if (st != MSDA_OK) return st;
    /* Every element count (and the byte count of the largest) must fit an int64. */
    int64_t n_value, n_loc, n_out, t;
    if (!mul_ok(pr->B, pr->S, &t) || !mul_ok(t, pr->H, &t) || !mul_ok(t, pr->C, &n_value) ||
        !mul_ok(n_value, 8, &t) || !mul_ok(pr->B, pr->Q, &t) || !mul_ok(t, pr->H, &t) ||
        !mul_ok(t, pr->C, &n_out) || !mul_ok(n_out, 8, &n_out) || !mul_ok(t, pr->NP, &t) ||
        !mul_ok(t, 2, &n_loc) || !mul_ok(n_loc, 8, &n_loc))
        return msda_set_error(MSDA_ERR_INVALID_ARGUMENT,
                              "%s: sizes B=%lld S=%lld H=%lld C=%lld L=%lld Q=%lld P=%lld "
                              "overflow a 64-bit element count",
                              fn, (long long)pr->B, (long long)pr->S, (long long)pr->H,
                              (long long)pr->C, (long long)pr->L, (long long)pr->Q,
                              (long long)pr->P);
    if (msda_dtype_size(pr->dtype) == 0)
        return msda_set_error(MSDA_ERR_INVALID_ARGUMENT,
                              "%s: dtype code %d is not one of" MSDA_DTYPES(DTYPE_NAME), fn,
                              pr->dtype);
    if (pr->index_dtype != MSDA_I64 && pr->index_dtype != MSDA_I32)
        return msda_set_error(MSDA_ERR_INVALID_ARGUMENT,
                              "%s: index_dtype code %d is not MSDA_I64 or MSDA_I32", fn,
                              pr->index_dtype);
    if (pr->device < -1)
        return msda_set_error(MSDA_ERR_INVALID_ARGUMENT,
                              "%s: device %d must be -1 (CPU) or a CUDA ordinal", fn, pr->device);
    if (pr->device >= 0 && !msda_cuda_built())
        return msda_set_error(MSDA_ERR_UNSUPPORTED,
                              "%s: device %d requested but this build of libpymsda has no CUDA "
                              "kernels (rebuild with nvcc on the PATH)",
                              fn, pr->device);
    /* The shape tables hold 3*L integers and the CPU kernels copy them into 3*L int64s: with
     * Q = 0 nothing above bounds L. */
    if (!mul_ok(pr->L, 3 * 8, &t))
        return msda_set_error(MSDA_ERR_INVALID_ARGUMENT,
                              "%s: L = %lld levels overflow the level tables", fn,
                              (long long)pr->L);
    /* OpenMP creates the threads it is asked for and aborts the process when it cannot. */
    if (pr->device < 0 && pr->num_threads > MSDA_MAX_THREADS)
        return msda_set_error(MSDA_ERR_INVALID_ARGUMENT,
                              "%s: num_threads = %d exceeds %d (pass <= 0 for the OpenMP "
                              "default)",
                              fn, pr->num_threads, MSDA_MAX_THREADS);
    return MSDA_OK;
}

/* Every pointer must be aligned to its element type: the kernels load whole elements, and a
 * misaligned one is undefined behaviour in C and a sticky fault on a GPU. */
static int check_alignment(const char *fn, const msda_problem *pr) {
    const int64_t elem = msda_dtype_size(pr->dtype), point = msda_point_size(pr);
    const int64_t index = pr->index_dtype == MSDA_I64 ? 8 : 4;
    /* grad_value: the accumulation type on the CPU (f32 for half types), the element type on
     * CUDA */
    const int64_t acc = pr->device >= 0 ? elem : msda_dtype_acc_size(pr->dtype);
    const struct { const char *name; const void *p; int64_t align; } ptrs[] = {
        {"value", pr->value, elem},
        {"spatial_shapes", pr->spatial_shapes, index},
        {"level_start_index", pr->level_start_index, index},
        {"sampling_locations", pr->sampling_locations, point},
        {"attention_weights", pr->attention_weights, point},
        {"grad_output", pr->grad_output, elem},
        {"output", pr->output, elem},
        {"grad_value", pr->grad_value, acc},
        {"grad_sampling_locations", pr->grad_sampling_locations, point},
        {"grad_attention_weights", pr->grad_attention_weights, point},
        {"workspace", pr->workspace, 16},
    };
    for (size_t i = 0; i < sizeof ptrs / sizeof ptrs[0]; i++)
        if ((uintptr_t)ptrs[i].p % (uintptr_t)ptrs[i].align != 0)
            return msda_set_error(MSDA_ERR_INVALID_ARGUMENT,
                                  "%s: %s (%p) is not aligned to its %lld-byte elements", fn,
                                  ptrs[i].name, ptrs[i].p, (long long)ptrs[i].align);
    return MSDA_OK;
}

/* The layout c/msda.h promises and pymsda/_clib.py mirrors. */
_Static_assert(sizeof(void *) == 8, "msda_args is laid out for 64-bit pointers");
_Static_assert(offsetof(msda_args, reserved) == 76 && offsetof(msda_args, level_points) == 80 &&
                   offsetof(msda_args, workspace_bytes) == 176 && sizeof(msda_args) == 192,
               "msda_args has padding");

/* The problem *args describes, before its checks (level_points is read by check_problem). With
 * whole = 0, for the queries, only the sizes, dtype, device and flags: the other fields are
 * left as in a zeroed struct, whatever args holds. */
static int read_args(const char *fn, const msda_args *args, int whole, msda_problem *pr) {
    if (args == NULL) return msda_set_error(MSDA_ERR_INVALID_ARGUMENT, "%s: args is NULL", fn);
    if (args->reserved != 0)
        return msda_set_error(MSDA_ERR_INVALID_ARGUMENT, "%s: reserved = %d must be 0", fn,
                              (int)args->reserved);
    *pr = (msda_problem){.B = args->B, .S = args->S, .H = args->H, .C = args->C, .L = args->L,
                         .Q = args->Q, .P = args->P, .flags = args->flags, .dtype = args->dtype,
                         .device = args->device};
    if (!whole) return MSDA_OK;
    pr->index_dtype = args->index_dtype;
    pr->num_threads = args->num_threads;
    pr->value = args->value;
    pr->spatial_shapes = args->spatial_shapes;
    pr->level_start_index = args->level_start_index;
    pr->sampling_locations = args->sampling_locations;
    pr->attention_weights = args->attention_weights;
    pr->grad_output = args->grad_output;
    pr->output = args->output;
    pr->grad_value = args->grad_value;
    pr->grad_sampling_locations = args->grad_sampling_locations;
    pr->grad_attention_weights = args->grad_attention_weights;
    pr->workspace = args->workspace;
    pr->workspace_bytes = args->workspace_bytes;
    pr->stream = args->stream;
    return MSDA_OK;
}

/* A NULL pointer the call needs is refused, naming it: a local (REQUIRE_POINTER) or a field of
 * the problem (REQUIRE_FIELD). */
#define REQUIRE_NAMED(fn, p, name)                                                                \
    do {                                                                                          \
        if ((p) == NULL)                                                                          \
            return msda_set_error(MSDA_ERR_INVALID_ARGUMENT, "%s: %s is NULL", fn, name);        \
    } while (0)
#define REQUIRE_POINTER(fn, p) REQUIRE_NAMED(fn, p, #p)
#define REQUIRE_FIELD(fn, pr, field) REQUIRE_NAMED(fn, (pr).field, #field)

// ---------------------------------------------------------------------------------------------
// entry points

/* A compute call's problem from its arguments, every check done (the error text names the
 * argument that failed). */
static int read_checked(const char *fn, const msda_args *args, msda_problem *pr) {
    last_error[0] = '\0';
    int st = read_args(fn, args, 1, pr);
    if (st == MSDA_OK) st = check_problem(fn, pr, args->level_points);
    if (st == MSDA_OK) st = check_alignment(fn, pr);
    return st;
}

int msda_forward_pooled(const msda_args *args, const msda_thread_pool *pool) {
    static const char fn[] = "msda_forward";
    msda_problem pr;
    const int st = read_checked(fn, args, &pr);
    if (st != MSDA_OK) return st;
    if (pr.device < 0) pr.pool = pool;
    if (pr.B == 0 || pr.Q == 0) return MSDA_OK; /* nothing to write */
    REQUIRE_FIELD(fn, pr, output);
    REQUIRE_FIELD(fn, pr, spatial_shapes);
    REQUIRE_FIELD(fn, pr, level_start_index);
    REQUIRE_FIELD(fn, pr, sampling_locations);
    REQUIRE_FIELD(fn, pr, attention_weights);
    if (pr.S > 0) REQUIRE_FIELD(fn, pr, value);
    if (pr.device >= 0) return msda_cuda_forward(&pr);
    return msda_uses_options(&pr) ? msda_cpu_options_forward(&pr) : msda_cpu_plain_forward(&pr);
}

int msda_forward(const msda_args *args) { return msda_forward_pooled(args, NULL); }

int64_t msda_backward_workspace_size(const msda_args *args) {
    static const char fn[] = "msda_backward_workspace_size";
    last_error[0] = '\0';
    msda_problem pr;
    if (read_args(fn, args, 0, &pr) != MSDA_OK || check_problem(fn, &pr, NULL) != MSDA_OK)
        return -1;
    if (pr.device < 0) return 0;
    return msda_cuda_workspace_size(&pr);
}

int msda_backward(const msda_args *args) {
    static const char fn[] = "msda_backward";
    msda_problem pr;
    const int st = read_checked(fn, args, &pr);
    if (st != MSDA_OK) return st;
    if (!pr.grad_value && !pr.grad_sampling_locations && !pr.grad_attention_weights)
        return MSDA_OK;
    if (pr.B == 0 || (pr.Q == 0 && pr.S == 0)) return MSDA_OK; /* every gradient is empty */
    /* Q == 0 with S > 0 still needs grad_value zeroed, which the kernels do. */
    REQUIRE_FIELD(fn, pr, spatial_shapes);
    REQUIRE_FIELD(fn, pr, level_start_index);
    if (pr.Q > 0) {
        REQUIRE_FIELD(fn, pr, grad_output);
        REQUIRE_FIELD(fn, pr, sampling_locations);
        REQUIRE_FIELD(fn, pr, attention_weights);
        if (pr.S > 0) REQUIRE_FIELD(fn, pr, value);
    }
    if (pr.device >= 0 && pr.grad_value) {
        const int64_t need = msda_cuda_workspace_size(&pr);
        if (need > 0 && (pr.workspace == NULL || pr.workspace_bytes < need))
            return msda_set_error(MSDA_ERR_INVALID_ARGUMENT,
                                  "%s: this CUDA backward (%s) needs a workspace of %lld bytes "
                                  "(msda_backward_workspace_size), got %s of %lld bytes",
                                  fn, pr.flags & MSDA_DETERMINISTIC
                                          ? "deterministic"
                                          : "f32 accumulation of a half-precision grad_value",
                                  (long long)need, pr.workspace ? "one" : "NULL",
                                  (long long)pr.workspace_bytes);
    }
    if (pr.device >= 0) return msda_cuda_backward(&pr);
    return msda_uses_options(&pr) ? msda_cpu_options_backward(&pr) : msda_cpu_plain_backward(&pr);
}

int msda_forward_route(const msda_args *args, int aligned16) {
    static const char fn[] = "msda_forward_route";
    last_error[0] = '\0';
    msda_problem pr;
    if (read_args(fn, args, 0, &pr) != MSDA_OK) return -1;
    pr.device = -1; /* the choice asks no device */
    if (check_problem(fn, &pr, args->level_points) != MSDA_OK) return -1;
    msda_forward_plan plan;
    msda_plan_forward(&pr, aligned16 != 0, &plan);
    return plan.kernel;
}

int msda_backward_route(const msda_args *args, int grads, int aligned16, int multiprocessors,
                        int sm90_code) {
    static const char fn[] = "msda_backward_route";
    last_error[0] = '\0';
    msda_problem pr;
    if (read_args(fn, args, 0, &pr) != MSDA_OK) return -1;
    /* the gradients wanted stand for themselves as non-NULL pointers: only their presence and
     * (aligned16) their alignment matter to the choice */
    static char wanted;
    pr.grad_value = grads & 1 ? &wanted : NULL;
    pr.grad_sampling_locations = grads & 2 ? &wanted : NULL;
    pr.grad_attention_weights = grads & 4 ? &wanted : NULL;
    if (grads & ~7)
        return msda_set_error(MSDA_ERR_INVALID_ARGUMENT, "%s: grads = %d has bits outside 1 | 2 "
                              "| 4", fn, grads), -1;
    const int explicit_device = multiprocessors > 0 && sm90_code >= 0;
    if (explicit_device) pr.device = -1; /* the facts are given: no device is asked */
    if (check_problem(fn, &pr, args->level_points) != MSDA_OK) return -1;
    if (!explicit_device) {
        if (args->device < 0)
            return msda_set_error(MSDA_ERR_INVALID_ARGUMENT, "%s: device %d: give a CUDA device "
                                  "or its multiprocessors and sm90_code", fn, args->device), -1;
        if (msda_cuda_device_facts(args->device, &multiprocessors, &sm90_code) != MSDA_OK)
            return -1;
    }
    msda_backward_plan plan;
    msda_plan_backward(&pr, aligned16 != 0, multiprocessors, sm90_code != 0, &plan);
    return plan.kernel | plan.modifiers;
}

int msda_level_starts(int64_t L, int64_t S, int index_dtype, int device,
                      const void *spatial_shapes, void *level_start_index, void *stream) {
    static const char fn[] = "msda_level_starts";
    last_error[0] = '\0';
    const int64_t index = index_dtype == MSDA_I64 ? 8 : 4;
    if (index_dtype != MSDA_I64 && index_dtype != MSDA_I32)
        return msda_set_error(MSDA_ERR_INVALID_ARGUMENT, "%s: unknown index_dtype %d", fn,
                              index_dtype);
    if (L < 1 || L > ((int64_t)1 << 40) || S < 0)
        return msda_set_error(MSDA_ERR_INVALID_ARGUMENT, "%s: L = %lld (needs >= 1), S = %lld",
                              fn, (long long)L, (long long)S);
    REQUIRE_POINTER(fn, spatial_shapes);
    REQUIRE_POINTER(fn, level_start_index);
    if ((uintptr_t)spatial_shapes % index || (uintptr_t)level_start_index % index)
        return msda_set_error(MSDA_ERR_INVALID_ARGUMENT, "%s: a table is not aligned to its "
                              "%lld-byte elements", fn, (long long)index);
    if (device >= 0)
        return msda_cuda_level_starts(L, S, index_dtype, device, spatial_shapes,
                                      level_start_index, stream);
    msda_derive_level_starts(L, S, index_dtype, spatial_shapes, level_start_index);
    return MSDA_OK;
}
