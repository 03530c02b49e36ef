/* c/ort_op.c: pymsda as ONNX Runtime's MSDA kernel: the op MSDeformAttn, domain "pymsda",
 * version 1, registered by RegisterCustomOps (the entry ONNX Runtime looks up in a custom-op
 * library; SessionOptions.register_custom_ops_library(path) in Python).
 * Inputs (TensorRT's plugin order): value (N, S, M, D) float32 or float16; spatial_shapes (L, 2)
 * and level_start_index (L,), both int64 or both int32; sampling_locations (N, Lq, M, L, P, 2)
 * and attention_weights (N, Lq, M, L, P), value's type (or float32 with a float16 value: what
 * autocast exports). Attributes: sampling ("bilinear" default, "nearest"); num_points_list
 * (ints, per-level point counts: the points become (N, Lq, M, sum, 2) and (N, Lq, M, sum)).
 * Output (N, Lq, M*D), value's type; float16 accumulates in float32 (the kernels' rule).
 * Shapes are read at every run. Every input is checked (types, ranks, sizes against each other;
 * on the CPU the tables' contents and NaN locations, which the kernels would turn into points that
 * add nothing); a failure is the runtime's error status with a message naming the input and the
 * layout expected, which session.run raises.
 * Threads: the CPU kernel runs on ONNX Runtime's intra-op pool (KernelContext_ParallelFor), so
 * its thread count is the session's intra_op_num_threads and no OpenMP team competes with the
 * runtime's own threads (docs/export.md: measured).
 * The ABI: c/ort_abi.h. The CUDA execution provider's kernel: c/ort_cuda.c. */
#if !defined(_GNU_SOURCE)
#define _GNU_SOURCE /* sched_getaffinity */
#endif
#include <sched.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ort_op.h"

static const char *const input_names[5] = {"value", "spatial_shapes", "level_start_index",
                                           "sampling_locations", "attention_weights"};

// ---------------------------------------------------------------------------------------------
// helpers

OrtStatus *msda_ort_error(const OrtApi *api, int code, const char *fmt, ...) {
    char text[1024];
    int n = snprintf(text, sizeof text, "pymsda %s: ", MSDA_ORT_OP_NAME);
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(text + n, sizeof text - (size_t)n, fmt, ap);
    va_end(ap);
    return ORT(api, CreateStatus)(code, text);
}

/* One input as the runtime describes it. */
typedef struct {
    int type;
    size_t rank;
    int64_t dims[8];
    void *data;
} tensor_view;

static OrtStatus *read_input(const OrtApi *api, OrtKernelContext *context, size_t i,
                             tensor_view *t) {
    const OrtValue *value = NULL;
    OrtTensorTypeAndShapeInfo *info = NULL;
    OrtStatus *st = ORT(api, KernelContext_GetInput)(context, i, &value);
    if (!st && !value)
        return msda_ort_error(api, MSDA_ORT_INVALID_ARGUMENT, "input %zu (%s) is missing", i,
                              input_names[i]);
    if (!st) st = ORT(api, GetTensorTypeAndShape)(value, &info);
    if (!st) st = ORT(api, GetTensorElementType)(info, &t->type);
    if (!st) st = ORT(api, GetDimensionsCount)(info, &t->rank);
    if (!st && t->rank > 8)
        st = msda_ort_error(api, MSDA_ORT_INVALID_ARGUMENT, "input %zu (%s) has %zu dimensions; "
                            "no input of the op has more than 6", i, input_names[i], t->rank);
    if (!st) st = ORT(api, GetDimensions)(info, t->dims, t->rank);
    if (info) ORT(api, ReleaseTensorTypeAndShapeInfo)(info);
    if (!st) st = ORT(api, GetTensorMutableData)((OrtValue *)value, &t->data);
    return st;
}

/* "(2, 300, 8)" */
static const char *dims_text(const int64_t *dims, size_t rank, char *buf, size_t size) {
    size_t n = (size_t)snprintf(buf, size, "(");
    for (size_t i = 0; i < rank && n < size; i++)
        n += (size_t)snprintf(buf + n, size - n, i ? ", %lld" : "%lld", (long long)dims[i]);
    if (n < size) snprintf(buf + n, size - n, rank == 1 ? ",)" : ")");
    return buf;
}

static const char *type_name(int type) {
    switch (type) {
    case MSDA_ORT_FLOAT: return "float32";
    case MSDA_ORT_FLOAT16: return "float16";
    case MSDA_ORT_DOUBLE: return "float64";
    case MSDA_ORT_BFLOAT16: return "bfloat16";
    case MSDA_ORT_INT32: return "int32";
    case MSDA_ORT_INT64: return "int64";
    default: return "another type";
    }
}

/* Input i must have shape `want` (entries < 0: any size); `layout` names the dimensions. */
static OrtStatus *expect_shape(const OrtApi *api, const tensor_view *t, size_t i,
                               const int64_t *want, size_t rank, const char *layout) {
    int ok = t->rank == rank;
    for (size_t d = 0; ok && d < rank; d++) ok = want[d] < 0 || t->dims[d] == want[d];
    if (ok) return NULL;
    char got[160], expected[160];
    int64_t shown[8];
    for (size_t d = 0; d < rank; d++) shown[d] = want[d];
    dims_text(shown, rank, expected, sizeof expected);
    for (char *c = expected; (c = strstr(c, "-1")) != NULL;) memcpy(c, " *", 2);
    return msda_ort_error(api, MSDA_ORT_INVALID_ARGUMENT,
                          "input %zu (%s) must be %s = %s (* any size), got %s", i,
                          input_names[i], layout, expected,
                          dims_text(t->dims, t->rank, got, sizeof got));
}

// ---------------------------------------------------------------------------------------------
// the checks every provider makes (shapes and types, read from the runtime's descriptions)

OrtStatus *msda_ort_prepare(const msda_ort_kernel *k, OrtKernelContext *context, msda_args *args) {
    const OrtApi *api = k->api;
    tensor_view in[5];
    OrtStatus *st = NULL;
    for (size_t i = 0; i < 5 && !st; i++) st = read_input(api, context, i, &in[i]);
    if (st) return st;
    if (in[0].type != k->value_type)
        return msda_ort_error(api, MSDA_ORT_INVALID_ARGUMENT, "input 0 (value) is %s, this kernel "
                              "serves %s", type_name(in[0].type), type_name(k->value_type));
    const int64_t any4[4] = {-1, -1, -1, -1};
    if ((st = expect_shape(api, &in[0], 0, any4, 4, "(N, S, M, D)"))) return st;
    const int64_t N = in[0].dims[0], S = in[0].dims[1], M = in[0].dims[2], D = in[0].dims[3];
    if (M < 1 || D < 1)
        return msda_ort_error(api, MSDA_ORT_INVALID_ARGUMENT, "input 0 (value) (N, S, M, D) needs "
                              "M >= 1 heads and D >= 1 channels, got M = %lld, D = %lld",
                              (long long)M, (long long)D);
    /* the level tables */
    const int index_type = in[1].type;
    if (index_type != MSDA_ORT_INT64 && index_type != MSDA_ORT_INT32)
        return msda_ort_error(api, MSDA_ORT_INVALID_ARGUMENT, "input 1 (spatial_shapes) must be "
                              "int64 or int32 rows (H_l, W_l), got %s", type_name(index_type));
    const int64_t shapes_dims[2] = {-1, 2};
    if ((st = expect_shape(api, &in[1], 1, shapes_dims, 2, "(L, 2)"))) return st;
    const int64_t L = in[1].dims[0];
    if (L < 1)
        return msda_ort_error(api, MSDA_ORT_INVALID_ARGUMENT, "input 1 (spatial_shapes) has no "
                              "level: (L, 2) needs L >= 1");
    if (in[2].type != index_type)
        return msda_ort_error(api, MSDA_ORT_INVALID_ARGUMENT, "input 2 (level_start_index) is %s "
                              "but input 1 (spatial_shapes) is %s: both tables must be int64, or "
                              "both int32", type_name(in[2].type), type_name(index_type));
    if ((st = expect_shape(api, &in[2], 2, &L, 1, "(L,)"))) return st;
    /* the points: (N, Lq, M, L, P, 2) and (N, Lq, M, L, P), or with num_points_list
     * (N, Lq, M, sum, 2) and (N, Lq, M, sum) */
    const int point_type = in[3].type;
    const int points_f32 = k->value_type == MSDA_ORT_FLOAT16 && point_type == MSDA_ORT_FLOAT;
    if (point_type != k->value_type && !points_f32)
        return msda_ort_error(api, MSDA_ORT_INVALID_ARGUMENT, "input 3 (sampling_locations) is "
                              "%s, value is %s: the points must have value's type (or float32 "
                              "with a float16 value)", type_name(point_type),
                              type_name(k->value_type));
    if (in[4].type != point_type)
        return msda_ort_error(api, MSDA_ORT_INVALID_ARGUMENT, "input 4 (attention_weights) is %s, "
                              "input 3 (sampling_locations) %s: both must have one type",
                              type_name(in[4].type), type_name(point_type));
    int64_t P;
    const int64_t Lq = in[3].rank >= 2 ? in[3].dims[1] : -1;
    if (k->n_points >= 0) {
        if (k->n_points != L)
            return msda_ort_error(api, MSDA_ORT_INVALID_ARGUMENT, "attribute num_points_list has "
                                  "%d counts, input 1 (spatial_shapes) %lld levels: one count "
                                  "a level", k->n_points, (long long)L);
        P = 0;
        for (int l = 0; l < k->n_points; l++) P += k->points[l];
        const int64_t loc[5] = {N, -1, M, P, 2}, attn[4] = {N, Lq, M, P};
        if ((st = expect_shape(api, &in[3], 3, loc, 5, "(N, Lq, M, sum(num_points_list), 2)")) ||
            (st = expect_shape(api, &in[4], 4, attn, 4, "(N, Lq, M, sum(num_points_list))")))
            return st;
    } else {
        P = in[3].rank == 6 ? in[3].dims[4] : -1;
        const int64_t loc[6] = {N, -1, M, L, -1, 2}, attn[5] = {N, Lq, M, L, P};
        if ((st = expect_shape(api, &in[3], 3, loc, 6, "(N, Lq, M, L, P, 2)")) ||
            (st = expect_shape(api, &in[4], 4, attn, 5, "(N, Lq, M, L, P)")))
            return st;
        if (P < 1)
            return msda_ort_error(api, MSDA_ORT_INVALID_ARGUMENT, "input 3 (sampling_locations) "
                                  "(N, Lq, M, L, P, 2) needs P >= 1 points");
    }
    const int64_t out_dims[3] = {N, Lq, M * D};
    OrtValue *out = NULL;
    void *out_data = NULL;
    if ((st = ORT(api, KernelContext_GetOutput)(context, 0, out_dims, 3, &out)) ||
        (st = ORT(api, GetTensorMutableData)(out, &out_data)))
        return st;
    *args = (msda_args){.B = N, .S = S, .H = M, .C = D, .L = L, .Q = Lq, .P = P,
                        .dtype = k->value_type == MSDA_ORT_FLOAT ? MSDA_F32 : MSDA_F16,
                        .index_dtype = index_type == MSDA_ORT_INT64 ? MSDA_I64 : MSDA_I32,
                        .device = -1, .flags = k->flags | (points_f32 ? MSDA_POINTS_F32 : 0),
                        .level_points = k->n_points >= 0 ? k->points : NULL,
                        .value = in[0].data, .spatial_shapes = in[1].data,
                        .level_start_index = in[2].data, .sampling_locations = in[3].data,
                        .attention_weights = in[4].data, .output = out_data};
    return NULL;
}

// ---------------------------------------------------------------------------------------------
// the CPU provider's kernel

/* The index of the first NaN among n elements, or -1: each block of NAN_BLOCK is scanned
 * without a branch (a loop the compiler vectorises), the index sought only in a block that holds
 * one. At dec300's 153,600 float32 locations: 18-24 us on the 2-vCPU machine, where the
 * early-exit loop took 60-90 us, a tenth of the node's call. A float16 is NaN when its exponent
 * is all ones and its mantissa is not zero: (x & 0x7fff) > 0x7c00. */
#define NAN_BLOCK 4096
static int64_t first_nan_f32(const float *x, int64_t n) {
    for (int64_t b = 0; b < n; b += NAN_BLOCK) {
        const int64_t e = n - b < NAN_BLOCK ? n : b + NAN_BLOCK;
        int any = 0;
        for (int64_t i = b; i < e; i++) any |= x[i] != x[i];
        if (any)
            for (int64_t i = b; i < e; i++)
                if (x[i] != x[i]) return i;
    }
    return -1;
}
static int64_t first_nan_f16(const uint16_t *x, int64_t n) {
    for (int64_t b = 0; b < n; b += NAN_BLOCK) {
        const int64_t e = n - b < NAN_BLOCK ? n : b + NAN_BLOCK;
        int any = 0;
        for (int64_t i = b; i < e; i++) any |= (x[i] & 0x7fff) > 0x7c00;
        if (any)
            for (int64_t i = b; i < e; i++)
                if ((x[i] & 0x7fff) > 0x7c00) return i;
    }
    return -1;
}

/* The contents the CPU can read for free: level sizes >= 0 whose starts are the running sums and
 * add up to S; no NaN location (the kernels would make it a point that adds nothing, hiding a
 * model that went wrong upstream; an infinite location is a point far outside and adds nothing,
 * as in eager pymsda). */
static OrtStatus *check_contents(const OrtApi *api, const msda_args *a) {
    int64_t start = 0;
    for (int64_t l = 0; l < a->L; l++) {
        const int64_t h = msda_index_at(a->spatial_shapes, a->index_dtype, 2 * l);
        const int64_t w = msda_index_at(a->spatial_shapes, a->index_dtype, 2 * l + 1);
        const int64_t s = msda_index_at(a->level_start_index, a->index_dtype, l);
        if (h < 0 || w < 0 || (w > 0 && h > (INT64_MAX - start) / w))
            return msda_ort_error(api, MSDA_ORT_INVALID_ARGUMENT, "input 1 (spatial_shapes) row "
                                  "%lld is (H, W) = (%lld, %lld): sizes must be >= 0",
                                  (long long)l, (long long)h, (long long)w);
        if (s != start)
            return msda_ort_error(api, MSDA_ORT_INVALID_ARGUMENT, "input 2 (level_start_index) "
                                  "[%lld] = %lld, but the levels before it hold %lld pixels "
                                  "(input 1, spatial_shapes): start_l = sum over j < l of H_j * "
                                  "W_j", (long long)l, (long long)s, (long long)start);
        start += h * w;
    }
    if (start != a->S)
        return msda_ort_error(api, MSDA_ORT_INVALID_ARGUMENT, "input 1 (spatial_shapes) holds "
                              "%lld pixels in all, input 0 (value) (N, S, M, D) has S = %lld: S "
                              "must be sum of H_l * W_l", (long long)start, (long long)a->S);
    const int64_t n = a->B * a->Q * a->H * (a->level_points ? a->P : a->L * a->P) * 2;
    const int half = a->dtype == MSDA_F16 && !(a->flags & MSDA_POINTS_F32);
    const int64_t nan_at = half ? first_nan_f16((const uint16_t *)a->sampling_locations, n)
                                : first_nan_f32((const float *)a->sampling_locations, n);
    if (nan_at >= 0)
        return msda_ort_error(api, MSDA_ORT_INVALID_ARGUMENT, "input 3 (sampling_locations) "
                              "holds NaN (flat element %lld of (N, Lq, M, L, P, 2)): a location "
                              "must be a number", (long long)nan_at);
    return NULL;
}

/* The workers of a CPU call on ONNX Runtime's intra-op pool. */
typedef struct {
    const OrtApi *api;
    const OrtKernelContext *context;
} ort_pool;

static int run_on_pool(void *pool, void (*fn)(void *, size_t), void *arg, size_t n) {
    const ort_pool *p = (const ort_pool *)pool;
    OrtStatus *st = ORT(p->api, KernelContext_ParallelFor)(p->context, fn, n, 0, arg);
    if (!st) return MSDA_OK;
    msda_set_error(MSDA_ERR_INTERNAL, "msda_forward: ONNX Runtime's KernelContext_ParallelFor "
                   "failed: %s", ORT(p->api, GetErrorMessage)(st));
    ORT(p->api, ReleaseStatus)(st);
    return MSDA_ERR_INTERNAL;
}

/* Workers a call is split into: one per CPU this process may run on. The pool runs as many at
 * once as it has threads; the workers take tasks from a shared counter, so the surplus finds
 * none left. (The custom-op API does not tell a kernel its pool's size.) */
static int cpu_workers(void) {
    cpu_set_t set;
    int n = sched_getaffinity(0, sizeof set, &set) == 0 ? CPU_COUNT(&set) : 1;
    return n < 1 ? 1 : n > 256 ? 256 : n;
}

static OrtStatus *compute_cpu(const msda_ort_kernel *k, OrtKernelContext *context) {
    msda_args args;
    OrtStatus *st = msda_ort_prepare(k, context, &args);
    if (!st) st = check_contents(k->api, &args);
    if (st) return st;
    const ort_pool pool = {k->api, context};
    const msda_thread_pool threads = {run_on_pool, (void *)&pool, cpu_workers()};
    if (msda_forward_pooled(&args, &threads) != MSDA_OK)
        return msda_ort_error(k->api, MSDA_ORT_FAIL, "%s", msda_last_error());
    return NULL;
}

// ---------------------------------------------------------------------------------------------
// the op's description

static OrtStatus *create_kernel(const OrtCustomOp *op, const OrtApi *api,
                                const OrtKernelInfo *info, void **out) {
    const msda_ort_op *variant = (const msda_ort_op *)op;
    msda_ort_kernel *k = (msda_ort_kernel *)calloc(1, sizeof *k);
    if (!k) return msda_ort_error(api, MSDA_ORT_FAIL, "out of host memory");
    *k = (msda_ort_kernel){api, variant->value_type, variant->cuda, 0, -1, {0}};
    char sampling[32] = "bilinear";
    size_t size = sizeof sampling;
    OrtStatus *st = ORT(api, KernelInfoGetAttribute_string)(info, "sampling", sampling, &size);
    if (st) { /* absent (or too long: refused below) */
        ORT(api, ReleaseStatus)(st);
        snprintf(sampling, sizeof sampling, size > sizeof sampling ? "?" : "bilinear");
    }
    if (strcmp(sampling, "nearest") == 0) k->flags = MSDA_NEAREST;
    st = strcmp(sampling, "nearest") && strcmp(sampling, "bilinear")
             ? msda_ort_error(api, MSDA_ORT_INVALID_ARGUMENT, "attribute sampling must be "
                              "\"bilinear\" or \"nearest\", got \"%s\"", sampling)
             : NULL;
    size = 0;
    OrtStatus *absent = st ? NULL : ORT(api, KernelInfoGetAttributeArray_int64)(
                                        info, "num_points_list", NULL, &size);
    if (absent) {
        ORT(api, ReleaseStatus)(absent);
    } else if (!st) {
        if (size < 1 || size > MSDA_MAX_POINT_LEVELS)
            st = msda_ort_error(api, MSDA_ORT_INVALID_ARGUMENT, "attribute num_points_list has "
                                "%zu counts: 1 to %d levels", size, MSDA_MAX_POINT_LEVELS);
        else
            st = ORT(api, KernelInfoGetAttributeArray_int64)(info, "num_points_list", k->points,
                                                              &size);
        int64_t sum = 0;
        for (size_t l = 0; !st && l < size; l++) {
            if (k->points[l] < 0 || k->points[l] > INT32_MAX)
                st = msda_ort_error(api, MSDA_ORT_INVALID_ARGUMENT, "attribute num_points_list"
                                    "[%zu] = %lld: counts must be >= 0", l,
                                    (long long)k->points[l]);
            sum += k->points[l];
        }
        if (!st && sum < 1)
            st = msda_ort_error(api, MSDA_ORT_INVALID_ARGUMENT, "attribute num_points_list "
                                "sums to %lld: at least one point is needed", (long long)sum);
        k->n_points = (int)size;
    }
    if (st) {
        free(k);
        return st;
    }
    *out = k;
    return NULL;
}

static OrtStatus *compute(void *kernel, OrtKernelContext *context) {
    const msda_ort_kernel *k = (const msda_ort_kernel *)kernel;
#if MSDA_ORT_CUDA_EP
    if (k->cuda) return msda_ort_compute_cuda(k, context);
#endif
    return compute_cpu(k, context);
}

static void destroy_kernel(void *kernel) { free(kernel); }
static const char *op_name(const OrtCustomOp *op) { return (void)op, MSDA_ORT_OP_NAME; }
static const char *provider(const OrtCustomOp *op) {
    return ((const msda_ort_op *)op)->cuda ? "CUDAExecutionProvider" : "CPUExecutionProvider";
}
/* Input 0 (value) and the output have the variant's type; the others any type, checked at run
 * time (so a wrong one gets this library's message, not a failed kernel match). */
static int input_type(const OrtCustomOp *op, size_t i) {
    return i == 0 ? ((const msda_ort_op *)op)->value_type : MSDA_ORT_UNDEFINED;
}
static size_t five(const OrtCustomOp *op) { return (void)op, 5; }
static int output_type(const OrtCustomOp *op, size_t i) {
    return (void)i, ((const msda_ort_op *)op)->value_type;
}
static size_t one(const OrtCustomOp *op) { return (void)op, 1; }
static int required(const OrtCustomOp *op, size_t i) { return (void)op, (void)i, 0; }
/* Every input in the provider's own memory: the CUDA kernels read the level tables on the GPU
 * (a host copy would need device memory this library never allocates, and ONNX Runtime copies a
 * table a CPU node made to the GPU itself, on its stream). */
static int memory_type(const OrtCustomOp *op, size_t i) {
    return (void)op, (void)i, MSDA_ORT_MEM_DEFAULT;
}

#define VARIANT(type, on_cuda)                                                                 \
    {{.version = MSDA_ORT_API_VERSION, .GetName = op_name, .GetExecutionProviderType = provider, \
      .GetInputType = input_type, .GetInputTypeCount = five, .GetOutputType = output_type,     \
      .GetOutputTypeCount = one, .KernelDestroy = destroy_kernel,                              \
      .GetInputCharacteristic = required, .GetOutputCharacteristic = required,                 \
      .GetInputMemoryType = memory_type, .CreateKernelV2 = create_kernel,                      \
      .KernelComputeV2 = compute},                                                             \
     type, on_cuda}

static const msda_ort_op variants[4] = {
    VARIANT(MSDA_ORT_FLOAT, 0), VARIANT(MSDA_ORT_FLOAT16, 0),
    VARIANT(MSDA_ORT_FLOAT, 1), VARIANT(MSDA_ORT_FLOAT16, 1),
};

// ---------------------------------------------------------------------------------------------
// registration

/* One domain for the process, made at the first registration and kept (sessions may outlive
 * the options that made them). */
static _Atomic(OrtCustomOpDomain *) the_domain;

MSDA_API OrtStatus *RegisterCustomOps(OrtSessionOptions *options, const OrtApiBase *base) {
    const OrtApi *api = base ? base->GetApi(MSDA_ORT_API_VERSION) : NULL;
    if (!api) {
        const OrtApi *any = base ? base->GetApi(1) : NULL;
        return any ? ORT(any, CreateStatus)(MSDA_ORT_FAIL, "pymsda's MSDeformAttn needs "
                                             "onnxruntime 1.17 or newer (C API 17)")
                   : NULL; /* no runtime to say it to */
    }
    OrtCustomOpDomain *domain = atomic_load(&the_domain);
    if (!domain) {
        OrtStatus *st = ORT(api, CreateCustomOpDomain)(MSDA_ORT_DOMAIN, &domain);
        const int count = MSDA_ORT_CUDA_EP && msda_has_cuda() ? 4 : 2;
        for (int i = 0; !st && i < count; i++)
            st = ORT(api, CustomOpDomain_Add)(domain, &variants[i].op);
        if (st) {
            if (domain) ORT(api, ReleaseCustomOpDomain)(domain);
            return st;
        }
        OrtCustomOpDomain *expected = NULL;
        if (!atomic_compare_exchange_strong(&the_domain, &expected, domain)) {
            ORT(api, ReleaseCustomOpDomain)(domain); /* another thread registered first */
            domain = expected;
        }
    }
    return ORT(api, AddCustomOpDomain)(options, domain);
}
