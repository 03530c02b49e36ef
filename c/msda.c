/* c/msda.c: the public entry points of libpymsda.
 * Each one checks its arguments (a bad one gives MSDA_ERR_INVALID_ARGUMENT and a text naming it),
 * returns early on empty problems, and dispatches to the CPU kernels or the CUDA launchers. */
#include <limits.h>
#include <stdarg.h>
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
const char *msda_cuda_archs(void) { return msda_cuda_arch_list(); }
int msda_cuda_version(void) { return msda_cuda_toolkit_version(); }

int64_t msda_dtype_size(int dtype) {
    switch (dtype) {
    case MSDA_F32: return 4;
    case MSDA_F64: return 8;
    case MSDA_F16: return 2;
    case MSDA_BF16: return 2;
    default: return 0;
    }
}

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
    if (pr->flags & ~(MSDA_NEAREST | MSDA_SOFTMAX | MSDA_DETERMINISTIC))
        return msda_set_error(MSDA_ERR_INVALID_ARGUMENT,
                              "%s: flags = %d has bits outside MSDA_NEAREST | MSDA_SOFTMAX | "
                              "MSDA_DETERMINISTIC",
                              fn, pr->flags);
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
                              "%s: dtype code %d is not one of MSDA_F32/F64/F16/BF16", fn,
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
    const int64_t elem = msda_dtype_size(pr->dtype);
    const int64_t index = pr->index_dtype == MSDA_I64 ? 8 : 4;
    /* grad_value: f32 for half types on the CPU, the element type on CUDA */
    const int64_t acc = pr->device >= 0 ? elem : pr->dtype == MSDA_F64 ? 8 : 4;
    const struct { const char *name; const void *p; int64_t align; } ptrs[] = {
        {"value", pr->value, elem},
        {"spatial_shapes", pr->spatial_shapes, index},
        {"level_start_index", pr->level_start_index, index},
        {"sampling_locations", pr->sampling_locations, elem},
        {"attention_weights", pr->attention_weights, elem},
        {"grad_output", pr->grad_output, elem},
        {"output", pr->output, elem},
        {"grad_value", pr->grad_value, acc},
        {"grad_sampling_locations", pr->grad_sampling_locations, elem},
        {"grad_attention_weights", pr->grad_attention_weights, elem},
        {"workspace", pr->workspace, 16},
    };
    for (size_t i = 0; i < sizeof ptrs / sizeof ptrs[0]; i++)
        if ((uintptr_t)ptrs[i].p % (uintptr_t)ptrs[i].align != 0)
            return msda_set_error(MSDA_ERR_INVALID_ARGUMENT,
                                  "%s: %s (%p) is not aligned to its %lld-byte elements", fn,
                                  ptrs[i].name, ptrs[i].p, (long long)ptrs[i].align);
    return MSDA_OK;
}

#define REQUIRE_POINTER(fn, p)                                                                    \
    do {                                                                                          \
        if ((p) == NULL)                                                                          \
            return msda_set_error(MSDA_ERR_INVALID_ARGUMENT, "%s: %s is NULL", fn, #p);          \
    } while (0)

// ---------------------------------------------------------------------------------------------
// entry points

int msda_forward(int64_t B, int64_t S, int64_t H, int64_t C, int64_t L, int64_t Q, int64_t P,
                 int dtype, int index_dtype, int device, int num_threads,
                 const int64_t *level_points, int flags, const void *value,
                 const void *spatial_shapes, const void *level_start_index,
                 const void *sampling_locations, const void *attention_weights, void *output,
                 void *stream) {
    static const char fn[] = "msda_forward";
    last_error[0] = '\0';
    msda_problem pr = {.B = B, .S = S, .H = H, .C = C, .L = L, .Q = Q, .P = P,
                       .flags = flags, .dtype = dtype, .index_dtype = index_dtype,
                       .device = device, .num_threads = num_threads, .value = value,
                       .spatial_shapes = spatial_shapes, .level_start_index = level_start_index,
                       .sampling_locations = sampling_locations,
                       .attention_weights = attention_weights, .output = output,
                       .stream = stream};
    int st = check_problem(fn, &pr, level_points);
    if (st == MSDA_OK) st = check_alignment(fn, &pr);
    if (st != MSDA_OK) return st;
    if (B == 0 || Q == 0) return MSDA_OK; /* nothing to write */
    REQUIRE_POINTER(fn, output);
    REQUIRE_POINTER(fn, spatial_shapes);
    REQUIRE_POINTER(fn, level_start_index);
    REQUIRE_POINTER(fn, sampling_locations);
    REQUIRE_POINTER(fn, attention_weights);
    if (S > 0) REQUIRE_POINTER(fn, value);
    if (device >= 0) return msda_cuda_forward(&pr);
    return msda_needs_general(&pr) ? msda_cpu_forward_general(&pr) : msda_cpu_forward(&pr);
}

int64_t msda_backward_workspace_size(int64_t B, int64_t S, int64_t H, int64_t C, int64_t L,
                                     int64_t Q, int64_t P, int dtype, int device, int flags) {
    static const char fn[] = "msda_backward_workspace_size";
    last_error[0] = '\0';
    msda_problem pr = {.B = B, .S = S, .H = H, .C = C, .L = L, .Q = Q, .P = P,
                       .flags = flags, .dtype = dtype, .device = device};
    if (check_problem(fn, &pr, NULL) != MSDA_OK) return -1;
    if (device < 0) return 0;
    return msda_cuda_workspace_size(&pr);
}

int msda_backward(int64_t B, int64_t S, int64_t H, int64_t C, int64_t L, int64_t Q, int64_t P,
                  int dtype, int index_dtype, int device, int num_threads,
                  const int64_t *level_points, int flags, const void *value,
                  const void *spatial_shapes, const void *level_start_index,
                  const void *sampling_locations, const void *attention_weights,
                  const void *grad_output, void *grad_value, void *grad_sampling_locations,
                  void *grad_attention_weights, void *workspace, int64_t workspace_bytes,
                  void *stream) {
    static const char fn[] = "msda_backward";
    last_error[0] = '\0';
    msda_problem pr = {.B = B, .S = S, .H = H, .C = C, .L = L, .Q = Q, .P = P,
                       .flags = flags, .dtype = dtype, .index_dtype = index_dtype,
                       .device = device, .num_threads = num_threads, .value = value,
                       .spatial_shapes = spatial_shapes, .level_start_index = level_start_index,
                       .sampling_locations = sampling_locations,
                       .attention_weights = attention_weights, .grad_output = grad_output,
                       .grad_value = grad_value, .grad_sampling_locations = grad_sampling_locations,
                       .grad_attention_weights = grad_attention_weights, .workspace = workspace,
                       .workspace_bytes = workspace_bytes, .stream = stream};
    int st = check_problem(fn, &pr, level_points);
    if (st == MSDA_OK) st = check_alignment(fn, &pr);
    if (st != MSDA_OK) return st;
    if (!grad_value && !grad_sampling_locations && !grad_attention_weights) return MSDA_OK;
    if (B == 0 || (Q == 0 && S == 0)) return MSDA_OK; /* every gradient is empty */
    /* Q == 0 with S > 0 still needs grad_value zeroed, which the kernels do. */
    REQUIRE_POINTER(fn, spatial_shapes);
    REQUIRE_POINTER(fn, level_start_index);
    if (Q > 0) {
        REQUIRE_POINTER(fn, grad_output);
        REQUIRE_POINTER(fn, sampling_locations);
        REQUIRE_POINTER(fn, attention_weights);
        if (S > 0) REQUIRE_POINTER(fn, value);
    }
    if (device >= 0 && grad_value) {
        const int64_t need = msda_cuda_workspace_size(&pr);
        if (need > 0 && (workspace == NULL || workspace_bytes < need))
            return msda_set_error(MSDA_ERR_INVALID_ARGUMENT,
                                  "%s: this CUDA backward (%s) needs a workspace of %lld bytes "
                                  "(msda_backward_workspace_size), got %s of %lld bytes",
                                  fn, flags & MSDA_DETERMINISTIC
                                          ? "deterministic"
                                          : "f32 accumulation of a half-precision grad_value",
                                  (long long)need, workspace ? "one" : "NULL",
                                  (long long)workspace_bytes);
    }
    if (device >= 0) return msda_cuda_backward(&pr);
    return msda_needs_general(&pr) ? msda_cpu_backward_general(&pr) : msda_cpu_backward(&pr);
}

int msda_backward_route(int64_t B, int64_t S, int64_t H, int64_t C, int64_t L, int64_t Q,
                        int64_t P, int dtype, const int64_t *level_points, int flags, int grads,
                        int aligned16, int device, int multiprocessors, int sm90_code) {
    static const char fn[] = "msda_backward_route";
    last_error[0] = '\0';
    /* the gradients wanted stand for themselves as non-NULL pointers: only their presence and
     * (aligned16) their alignment matter to the choice */
    static char wanted;
    msda_problem pr = {.B = B, .S = S, .H = H, .C = C, .L = L, .Q = Q, .P = P,
                       .flags = flags, .dtype = dtype, .device = device,
                       .grad_value = grads & 1 ? &wanted : NULL,
                       .grad_sampling_locations = grads & 2 ? &wanted : NULL,
                       .grad_attention_weights = grads & 4 ? &wanted : NULL};
    if (grads & ~7)
        return msda_set_error(MSDA_ERR_INVALID_ARGUMENT, "%s: grads = %d has bits outside 1 | 2 "
                              "| 4", fn, grads), -1;
    const int explicit_device = multiprocessors > 0 && sm90_code >= 0;
    if (explicit_device) pr.device = -1; /* the facts are given: no device is asked */
    if (check_problem(fn, &pr, level_points) != MSDA_OK) return -1;
    if (!explicit_device) {
        if (device < 0)
            return msda_set_error(MSDA_ERR_INVALID_ARGUMENT, "%s: device %d: give a CUDA device "
                                  "or its multiprocessors and sm90_code", fn, device), -1;
        if (msda_cuda_device_facts(device, &multiprocessors, &sm90_code) != MSDA_OK) return -1;
    }
    msda_backward_plan plan;
    msda_plan_backward(&pr, aligned16 != 0, multiprocessors, sm90_code != 0, &plan);
    return plan.kernel | plan.modifiers;
}

/* The packed entry points (msda.h): unpack and call. */
#define PACKED_PTR(a) ((void *)(intptr_t)(a))

/* NULL, or an int entry (dtype, index_dtype, device, num_threads, flags: entries 7, 8, 9, 10
 * and 12 of both layouts) outside the range of int, is refused. */
static int packed_check(const char *fn, const int64_t *args) {
    static const int ints[] = {7, 8, 9, 10, 12};
    if (!args) return msda_set_error(MSDA_ERR_INVALID_ARGUMENT, "%s: args is NULL", fn);
    for (int i = 0; i < 5; i++)
        if (args[ints[i]] < INT_MIN || args[ints[i]] > INT_MAX)
            return msda_set_error(MSDA_ERR_INVALID_ARGUMENT,
                                  "%s: entry %d = %lld does not fit an int", fn, ints[i],
                                  (long long)args[ints[i]]);
    return MSDA_OK;
}

int msda_forward_packed(const int64_t *a) {
    const int st = packed_check("msda_forward_packed", a);
    if (st != MSDA_OK) return st;
    return msda_forward(a[0], a[1], a[2], a[3], a[4], a[5], a[6], (int)a[7], (int)a[8],
                        (int)a[9], (int)a[10], (const int64_t *)PACKED_PTR(a[11]), (int)a[12],
                        PACKED_PTR(a[13]), PACKED_PTR(a[14]), PACKED_PTR(a[15]),
                        PACKED_PTR(a[16]), PACKED_PTR(a[17]), PACKED_PTR(a[18]),
                        PACKED_PTR(a[19]));
}

int msda_backward_packed(const int64_t *a) {
    const int st = packed_check("msda_backward_packed", a);
    if (st != MSDA_OK) return st;
    return msda_backward(a[0], a[1], a[2], a[3], a[4], a[5], a[6], (int)a[7], (int)a[8],
                         (int)a[9], (int)a[10], (const int64_t *)PACKED_PTR(a[11]), (int)a[12],
                         PACKED_PTR(a[13]), PACKED_PTR(a[14]), PACKED_PTR(a[15]),
                         PACKED_PTR(a[16]), PACKED_PTR(a[17]), PACKED_PTR(a[18]),
                         PACKED_PTR(a[19]), PACKED_PTR(a[20]), PACKED_PTR(a[21]),
                         PACKED_PTR(a[22]), a[23], PACKED_PTR(a[24]));
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
