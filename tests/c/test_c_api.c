/* tests/c/test_c_api.c: C-level tests of libpymsda, without Python or torch.
 * - capability queries and status strings;
 * - argument checks return MSDA_ERR_INVALID_ARGUMENT with a text naming the argument (a NULL
 *   msda_args included), and the text is per thread;
 * - the half/bfloat16 conversions (c/dtypes.h): every binary16 value round-trips, and float ->
 *   half/bf16 rounds to the nearest representable value, ties to even;
 * - a small CPU forward and backward against a direct double computation written here;
 * - MSDA_POINTS_F32: refused without a half dtype; on the CPU, half values with float32
 *   locations and weights give what dtype F32 gives on the same numbers, with every option;
 * - lying shape tables (sizes far beyond S) neither crash nor write outside the output;
 * - msda_level_starts derives level starts from sizes, lying sizes included.
 * Prints "N passed, N failed" and exits non-zero on any failure. */
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "dtypes.h"
#include "msda.h"

static int passed, failed;
#define CHECK(cond, ...)                                                                         \
    do {                                                                                         \
        if (cond) {                                                                              \
            passed++;                                                                            \
        } else {                                                                                 \
            failed++;                                                                            \
            printf("FAIL %s:%d: ", __FILE__, __LINE__);                                          \
            printf(__VA_ARGS__);                                                                 \
            printf("\n");                                                                        \
        }                                                                                        \
    } while (0)

static uint64_t rng = 88172645463325252ull;
static double urand(void) { /* xorshift64, uniform in [0, 1) */
    rng ^= rng << 13, rng ^= rng >> 7, rng ^= rng << 17;
    return (double)(rng >> 11) / 9007199254740992.0;
}

// ---------------------------------------------------------------------------------------------

static void test_capabilities(void) {
    CHECK(msda_abi_version() == MSDA_ABI_VERSION, "abi %d", msda_abi_version());
    CHECK(msda_has_cuda() == 0 || msda_has_cuda() == 1, "has_cuda %d", msda_has_cuda());
    CHECK(msda_cuda_device_count() >= 0, "device count %d", msda_cuda_device_count());
    CHECK(msda_cuda_archs() != NULL, "archs NULL");
    CHECK(strcmp(msda_status_string(MSDA_OK), "ok") == 0, "status string");
    CHECK(strcmp(msda_status_string(12345), "unknown status") == 0, "unknown status string");
}

/* The msda_args of a call on these sizes, codes and inputs (one thread, no options); the
 * caller sets the outputs. */
static msda_args make_args(int64_t B, int64_t S, int64_t H, int64_t C, int64_t L, int64_t Q,
                           int64_t P, int dtype, int index_dtype, int device, const void *value,
                           const void *shapes, const void *starts, const void *loc,
                           const void *attn) {
    msda_args a = {.B = B, .S = S, .H = H, .C = C, .L = L, .Q = Q, .P = P, .dtype = dtype,
                   .index_dtype = index_dtype, .device = device, .num_threads = 1,
                   .value = value, .spatial_shapes = shapes, .level_start_index = starts,
                   .sampling_locations = loc, .attention_weights = attn};
    return a;
}

static int call_forward(int64_t B, int64_t S, int64_t H, int64_t C, int64_t L, int64_t Q,
                        int64_t P, int dtype, int index_dtype, int device, const void *value,
                        const void *shapes, const void *starts, const void *loc,
                        const void *attn, void *out) {
    msda_args a = make_args(B, S, H, C, L, Q, P, dtype, index_dtype, device, value, shapes,
                            starts, loc, attn);
    a.output = out;
    return msda_forward(&a);
}

/* A CPU backward on num_threads threads, no workspace. */
static int call_backward(int64_t B, int64_t S, int64_t H, int64_t C, int64_t L, int64_t Q,
                         int64_t P, int dtype, int num_threads, const void *value,
                         const void *shapes, const void *starts, const void *loc,
                         const void *attn, const void *gout, void *gv, void *gloc, void *gattn) {
    msda_args a = make_args(B, S, H, C, L, Q, P, dtype, MSDA_I64, -1, value, shapes, starts, loc,
                            attn);
    a.num_threads = num_threads;
    a.grad_output = gout;
    a.grad_value = gv;
    a.grad_sampling_locations = gloc;
    a.grad_attention_weights = gattn;
    return msda_backward(&a);
}

static void test_argument_checks(void) {
    float buf[64] = {0};
    int64_t shapes[2] = {2, 2}, starts[1] = {0};
    int st = call_forward(1, 4, 1, 0, 1, 1, 1, MSDA_F32, MSDA_I64, -1, buf, shapes, starts, buf,
                          buf, buf);
    CHECK(st == MSDA_ERR_INVALID_ARGUMENT && strstr(msda_last_error(), "size C"),
          "C=0: %d %s", st, msda_last_error());
    st = call_forward(1, 4, 1, 1, 1, 1, 1, 7, MSDA_I64, -1, buf, shapes, starts, buf, buf, buf);
    CHECK(st == MSDA_ERR_INVALID_ARGUMENT && strstr(msda_last_error(), "dtype"),
          "bad dtype: %d %s", st, msda_last_error());
    st = call_forward(1, 4, 1, 1, 1, 1, 1, MSDA_F32, 9, -1, buf, shapes, starts, buf, buf, buf);
    CHECK(st == MSDA_ERR_INVALID_ARGUMENT && strstr(msda_last_error(), "index_dtype"),
          "bad index dtype: %d %s", st, msda_last_error());
    st = call_forward(1, 4, 1, 1, 1, 1, 1, MSDA_F32, MSDA_I64, -1, buf, shapes, starts, NULL, buf,
                      buf);
    CHECK(st == MSDA_ERR_INVALID_ARGUMENT && strstr(msda_last_error(), "sampling_locations"),
          "NULL locations: %d %s", st, msda_last_error());
    st = call_forward(1, 4, 1, 1, 1, 1, 1, MSDA_F32, MSDA_I64, -2, buf, shapes, starts, buf, buf,
                      buf);
    CHECK(st == MSDA_ERR_INVALID_ARGUMENT && strstr(msda_last_error(), "device"),
          "device -2: %d %s", st, msda_last_error());
    st = call_forward((int64_t)1 << 40, (int64_t)1 << 40, 1, 1, 1, 1, 1, MSDA_F32, MSDA_I64, -1,
                      buf, shapes, starts, buf, buf, buf);
    CHECK(st == MSDA_ERR_INVALID_ARGUMENT && strstr(msda_last_error(), "overflow"),
          "overflow: %d %s", st, msda_last_error());
    /* flags: the removed fused softmax (bit 2) is refused by name, an unknown bit as such */
    const struct { int flags; const char *says; } bad_flags[] = {{MSDA_REMOVED_SOFTMAX, "softmax"},
                                                                {16, "bits outside"}};
    for (int f = 0; f < 2; f++) {
        msda_args a = make_args(1, 4, 1, 1, 1, 1, 1, MSDA_F32, MSDA_I64, -1, buf, shapes, starts,
                                buf, buf);
        a.flags = bad_flags[f].flags;
        a.output = buf;
        st = msda_forward(&a);
        CHECK(st == MSDA_ERR_INVALID_ARGUMENT && strstr(msda_last_error(), bad_flags[f].says),
              "flags %d: %d %s", bad_flags[f].flags, st, msda_last_error());
    }
    if (!msda_has_cuda()) {
        st = call_forward(1, 4, 1, 1, 1, 1, 1, MSDA_F32, MSDA_I64, 0, buf, shapes, starts, buf,
                          buf, buf);
        CHECK(st == MSDA_ERR_UNSUPPORTED, "CUDA device in CPU build: %d", st);
    }
    /* success clears the text */
    st = call_forward(1, 4, 1, 1, 1, 1, 1, MSDA_F32, MSDA_I64, -1, buf, shapes, starts, buf, buf,
                      buf);
    CHECK(st == MSDA_OK && msda_last_error()[0] == '\0', "valid call: %d %s", st,
          msda_last_error());
}

static void test_null_args_refused(void) {
    /* Every entry point taking a msda_args refuses NULL, naming itself; a nonzero reserved field
     * is refused too. */
    CHECK(msda_forward(NULL) == MSDA_ERR_INVALID_ARGUMENT &&
              strcmp(msda_last_error(), "msda_forward: args is NULL") == 0,
          "forward NULL: %s", msda_last_error());
    CHECK(msda_backward(NULL) == MSDA_ERR_INVALID_ARGUMENT &&
              strcmp(msda_last_error(), "msda_backward: args is NULL") == 0,
          "backward NULL: %s", msda_last_error());
    CHECK(msda_backward_workspace_size(NULL) == -1 &&
              strcmp(msda_last_error(), "msda_backward_workspace_size: args is NULL") == 0,
          "workspace size NULL: %s", msda_last_error());
    CHECK(msda_forward_route(NULL, 1) == -1 &&
              strcmp(msda_last_error(), "msda_forward_route: args is NULL") == 0,
          "forward route NULL: %s", msda_last_error());
    CHECK(msda_backward_route(NULL, 7, 1, 132, 1) == -1 &&
              strcmp(msda_last_error(), "msda_backward_route: args is NULL") == 0,
          "route NULL: %s", msda_last_error());
    float buf[8] = {0};
    int64_t shapes[2] = {2, 2}, starts[1] = {0};
    msda_args a = make_args(1, 4, 1, 1, 1, 1, 1, MSDA_F32, MSDA_I64, -1, buf, shapes, starts, buf,
                            buf);
    a.output = buf;
    a.reserved = 1;
    CHECK(msda_forward(&a) == MSDA_ERR_INVALID_ARGUMENT && strstr(msda_last_error(), "reserved"),
          "reserved 1: %s", msda_last_error());
    a.reserved = 0;
    CHECK(msda_forward(&a) == MSDA_OK && msda_backward_workspace_size(&a) == 0 &&
              msda_last_error()[0] == '\0',
          "valid args after a refusal: %s", msda_last_error());
}

static void *thread_fails(void *arg) {
    (void)arg;
    float buf[8] = {0};
    int64_t shapes[2] = {2, 2}, starts[1] = {0};
    call_forward(1, 4, 1, 1, 1, 1, 1, 7, MSDA_I64, -1, buf, shapes, starts, buf, buf, buf);
    return NULL;
}

static void test_error_text_is_per_thread(void) {
    float buf[8] = {0};
    int64_t shapes[2] = {2, 2}, starts[1] = {0};
    call_forward(1, 4, 1, 0, 1, 1, 1, MSDA_F32, MSDA_I64, -1, buf, shapes, starts, buf, buf, buf);
    pthread_t t;
    pthread_create(&t, NULL, thread_fails, NULL);
    pthread_join(t, NULL);
    CHECK(strstr(msda_last_error(), "size C") != NULL,
          "another thread's failure replaced this thread's text: %s", msda_last_error());
}

// ---------------------------------------------------------------------------------------------

static void test_half_conversions(void) {
    int bad = 0;
    for (uint32_t h = 0; h < 65536; h++) {
        float f = msda_half_to_float((uint16_t)h);
        uint16_t back = msda_float_to_half(f);
        int is_nan = (h & 0x7c00u) == 0x7c00u && (h & 0x3ffu);
        if (is_nan ? !isnan(f) || (back & 0x7fffu) <= 0x7c00u : back != h) bad++;
    }
    CHECK(bad == 0, "%d binary16 values do not round-trip", bad);

    /* float -> half: nearest of the two neighbouring halves, ties to the even mantissa. */
    bad = 0;
    for (int i = 0; i < 200000; i++) {
        double mag = pow(2.0, -26.0 + 43.0 * urand());
        float f = (float)(urand() < 0.5 ? -mag : mag);
        uint16_t h = msda_float_to_half(f);
        double got = msda_half_to_float(h);
        if (fabs(f) >= 65520.0) {
            if (!isinf(got)) bad++;
            continue;
        }
        uint16_t up = (uint16_t)(h + 1), down = (uint16_t)(h - 1);
        double e = fabs(got - f);
        double eu = (h & 0x7fffu) < 0x7bffu ? fabs(msda_half_to_float(up) - f) : INFINITY;
        double ed = (h & 0x7fffu) > 0 ? fabs(msda_half_to_float(down) - f) : INFINITY;
        if (e > eu || e > ed || ((e == eu || e == ed) && (h & 1u))) bad++;
    }
    CHECK(bad == 0, "%d floats rounded to the wrong binary16", bad);

    bad = 0;
    for (int i = 0; i < 200000; i++) {
        float f = (float)((urand() - 0.5) * pow(2.0, -60.0 + 120.0 * urand()));
        uint16_t b = msda_float_to_bf16(f);
        double got = msda_bf16_to_float(b);
        double eu = fabs(msda_bf16_to_float((uint16_t)(b + 1)) - f);
        double ed = fabs(msda_bf16_to_float((uint16_t)(b - 1)) - f);
        double e = fabs(got - f);
        if (e > eu || e > ed || ((e == eu || e == ed) && (b & 1u))) bad++;
    }
    CHECK(bad == 0, "%d floats rounded to the wrong bfloat16", bad);
    CHECK(isnan(msda_bf16_to_float(msda_float_to_bf16(NAN))), "bf16 NaN");
    CHECK(isinf(msda_half_to_float(msda_float_to_half(1e6f))), "half overflow to inf");
}

// ---------------------------------------------------------------------------------------------

/* Direct double computation of one bilinear sample with zero padding. */
static double sample(const double *v, int64_t S, int64_t H, int64_t C, int64_t start, int64_t Hl,
                     int64_t Wl, int64_t b, int64_t h, int64_t c, double lx, double ly) {
    double x = lx * Wl - 0.5, y = ly * Hl - 0.5;
    double x0 = floor(x), y0 = floor(y), sum = 0;
    for (int dy = 0; dy < 2; dy++)
        for (int dx = 0; dx < 2; dx++) {
            int64_t xx = (int64_t)x0 + dx, yy = (int64_t)y0 + dy;
            if (xx < 0 || yy < 0 || xx >= Wl || yy >= Hl) continue;
            double w = (dx ? x - x0 : 1 - (x - x0)) * (dy ? y - y0 : 1 - (y - y0));
            sum += w * v[((b * S + start + yy * Wl + xx) * H + h) * C + c];
        }
    return sum;
}

static void test_cpu_forward_backward(void) {
    enum { B = 2, H = 3, C = 5, L = 2, Q = 4, P = 3 };
    const int64_t shapes[2 * L] = {4, 6, 2, 3}, starts[L] = {0, 24};
    const int32_t shapes32[2 * L] = {4, 6, 2, 3}, starts32[L] = {0, 24};
    enum { S = 30 };
    static double v[B * S * H * C], loc[B * Q * H * L * P * 2], attn[B * Q * H * L * P];
    static double out[B * Q * H * C], out32[B * Q * H * C], gout[B * Q * H * C];
    static double gv[B * S * H * C], gloc[B * Q * H * L * P * 2], gattn[B * Q * H * L * P];
    for (int i = 0; i < B * S * H * C; i++) v[i] = urand() * 2 - 1;
    for (int i = 0; i < B * Q * H * L * P * 2; i++) loc[i] = urand() * 1.2 - 0.1;
    for (int i = 0; i < B * Q * H * L * P; i++) attn[i] = urand();
    for (int i = 0; i < B * Q * H * C; i++) gout[i] = urand() * 2 - 1;

    int st = call_forward(B, S, H, C, L, Q, P, MSDA_F64, MSDA_I64, -1, v, shapes, starts, loc,
                          attn, out);
    CHECK(st == MSDA_OK, "forward: %s", msda_last_error());
    st = call_forward(B, S, H, C, L, Q, P, MSDA_F64, MSDA_I32, -1, v, shapes32, starts32, loc,
                      attn, out32);
    CHECK(st == MSDA_OK && memcmp(out, out32, sizeof out) == 0, "int32 shapes differ");
    double err = 0;
    for (int64_t b = 0; b < B; b++)
        for (int64_t q = 0; q < Q; q++)
            for (int64_t h = 0; h < H; h++)
                for (int64_t c = 0; c < C; c++) {
                    double want = 0;
                    for (int64_t l = 0; l < L; l++)
                        for (int64_t p = 0; p < P; p++) {
                            int64_t i = (((b * Q + q) * H + h) * L + l) * P + p;
                            want += attn[i] * sample(v, S, H, C, starts[l], shapes[2 * l],
                                                     shapes[2 * l + 1], b, h, c, loc[2 * i],
                                                     loc[2 * i + 1]);
                        }
                    err = fmax(err, fabs(want - out[((b * Q + q) * H + h) * C + c]));
                }
    CHECK(err < 1e-12, "forward max error %g", err);

    /* Backward: compare the location gradient with central differences of the forward, and
     * the weight gradient with its definition (the sample), on a few entries. */
    st = call_backward(B, S, H, C, L, Q, P, MSDA_F64, 2, v, shapes, starts, loc, attn, gout, gv,
                       gloc, gattn);
    CHECK(st == MSDA_OK, "backward: %s", msda_last_error());
    double worst = 0;
    for (int i = 0; i < 12; i++) {
        int64_t k = (int64_t)(urand() * (B * Q * H * L * P * 2));
        double saved = loc[k], eps = 1e-6, fp = 0, fm = 0;
        loc[k] = saved + eps;
        call_forward(B, S, H, C, L, Q, P, MSDA_F64, MSDA_I64, -1, v, shapes, starts, loc, attn, out);
        for (int j = 0; j < B * Q * H * C; j++) fp += out[j] * gout[j];
        loc[k] = saved - eps;
        call_forward(B, S, H, C, L, Q, P, MSDA_F64, MSDA_I64, -1, v, shapes, starts, loc, attn, out);
        for (int j = 0; j < B * Q * H * C; j++) fm += out[j] * gout[j];
        loc[k] = saved;
        worst = fmax(worst, fabs((fp - fm) / (2 * eps) - gloc[k]));
    }
    CHECK(worst < 1e-5, "location gradient vs finite differences: %g", worst);
    /* grad_value is linear: sum(gv * v) == sum(out * gout) */
    call_forward(B, S, H, C, L, Q, P, MSDA_F64, MSDA_I64, -1, v, shapes, starts, loc, attn, out);
    double lhs = 0, rhs = 0;
    for (int j = 0; j < B * S * H * C; j++) lhs += gv[j] * v[j];
    for (int j = 0; j < B * Q * H * C; j++) rhs += out[j] * gout[j];
    CHECK(fabs(lhs - rhs) < 1e-10 * (1 + fabs(rhs)), "grad_value identity %g vs %g", lhs, rhs);
}

static void test_points_f32_needs_half_dtype(void) {
    double buf[64] = {0};
    int64_t shapes[2] = {2, 2}, starts[1] = {0};
    const int dtypes[2] = {MSDA_F32, MSDA_F64};
    for (int d = 0; d < 2; d++) {
        msda_args a = make_args(1, 4, 1, 1, 1, 1, 1, dtypes[d], MSDA_I64, -1, buf, shapes, starts,
                                buf, buf);
        a.flags = MSDA_POINTS_F32;
        a.output = buf;
        int st = msda_forward(&a);
        CHECK(st == MSDA_ERR_INVALID_ARGUMENT && strstr(msda_last_error(), "MSDA_POINTS_F32"),
              "forward, dtype %d with MSDA_POINTS_F32: %d %s", dtypes[d], st, msda_last_error());
        a.output = NULL;
        a.grad_output = buf;
        a.grad_value = buf + 8;
        a.grad_sampling_locations = buf + 16;
        a.grad_attention_weights = buf + 24;
        st = msda_backward(&a);
        CHECK(st == MSDA_ERR_INVALID_ARGUMENT && strstr(msda_last_error(), "MSDA_POINTS_F32"),
              "backward, dtype %d with MSDA_POINTS_F32: %d %s", dtypes[d], st, msda_last_error());
    }
}

/* max |a - b| / max |b| over n elements */
static double relative_difference(const float *a, const float *b, int64_t n) {
    double diff = 0, scale = 0;
    for (int64_t i = 0; i < n; i++) {
        diff = fmax(diff, fabs((double)a[i] - b[i]));
        scale = fmax(scale, fabs((double)b[i]));
    }
    return scale > 0 ? diff / scale : diff;
}

static void test_points_f32_matches_f32_cpu(void) {
    /* MSDA_POINTS_F32 on the CPU: half values with float32 locations and weights give what dtype
     * F32 gives on the same numbers (the half values widened). Both accumulate in f32, so the
     * half output differs only by its final rounding to the half type, and the float32 gradients
     * (grad_value is the f32 buffer in both) agree to float32 rounding. The locations are float32
     * numbers no half type holds: a kernel that rounded them would fail. LP = 18 points: a full
     * group of 16 and a partial one in the fast kernels; Q != S: the query order is sorted. */
    enum { B = 2, H = 3, C = 11, L = 3, Q = 7, NP = 18, S = 45 };
    enum { NV = B * S * H * C, NO = B * Q * H * C, NA = B * Q * H * NP };
    const int64_t shapes[2 * L] = {4, 6, 2, 3, 3, 5}, starts[L] = {0, 24, 30};
    const int64_t level_points[L] = {6, 9, 3}; /* NP in all, unevenly */
    static uint16_t v16[NV], gout16[NO], out16[NO];
    static float v[NV], gout[NO], out[NO], loc[2 * NA], loc_rounded[2 * NA], attn[NA];
    static float gv16[NV], gloc16[2 * NA], gattn16[NA], gv[NV], gloc[2 * NA], gattn[NA];
    const struct { const char *name; int flags, per_level; } options[] = {
        {"plain", 0, 0}, {"nearest", MSDA_NEAREST, 0}, {"level_points", 0, 1},
        {"nearest_level_points", MSDA_NEAREST, 1}};
    const int dtypes[2] = {MSDA_F16, MSDA_BF16};
    for (int d = 0; d < 2; d++) {
        const int bf16 = dtypes[d] == MSDA_BF16;
        const double unit = bf16 ? 1.0 / 256 : 1.0 / 2048; /* the type's rounding, relative */
#define TO_HALF(x) (bf16 ? msda_float_to_bf16(x) : msda_float_to_half(x))
#define FROM_HALF(h) (bf16 ? msda_bf16_to_float(h) : msda_half_to_float(h))
        for (int i = 0; i < NV; i++)
            v16[i] = TO_HALF((float)(urand() * 2 - 1)), v[i] = FROM_HALF(v16[i]);
        for (int i = 0; i < NO; i++)
            gout16[i] = TO_HALF((float)(urand() * 2 - 1)), gout[i] = FROM_HALF(gout16[i]);
        for (int i = 0; i < 2 * NA; i++) {
            loc[i] = (float)(urand() * 1.2 - 0.1);
            loc_rounded[i] = FROM_HALF(TO_HALF(loc[i]));
        }
        for (int i = 0; i < NA; i++) attn[i] = (float)(urand() * 3 - 1);
        for (size_t o = 0; o < sizeof options / sizeof options[0]; o++) {
            const char *name = bf16 ? "bf16" : "f16", *option = options[o].name;
            msda_args a = make_args(B, S, H, C, L, Q, options[o].per_level ? NP : NP / L,
                                    dtypes[d], MSDA_I64, -1, v16, shapes, starts, loc, attn);
            a.level_points = options[o].per_level ? level_points : NULL;
            a.flags = options[o].flags | MSDA_POINTS_F32;
            msda_args want = a; /* the same call in f32 */
            want.dtype = MSDA_F32;
            want.flags = options[o].flags;
            want.value = v;

            a.output = out16;
            want.output = out;
            int st = msda_forward(&a), st_want = msda_forward(&want);
            CHECK(st == MSDA_OK && st_want == MSDA_OK, "%s %s forward: %d %d %s", name, option,
                  st, st_want, msda_last_error());
            double worst = 0, scale = 0;
            for (int i = 0; i < NO; i++) scale = fmax(scale, fabs(out[i]));
            for (int i = 0; i < NO; i++)
                worst = fmax(worst, fabs(FROM_HALF(out16[i]) - out[i]) - unit * fabs(out[i]));
            CHECK(worst <= 1e-6 * scale, "%s %s output: %g past the rounding of %g", name,
                  option, worst, scale);

            a.output = want.output = NULL;
            a.grad_output = gout16, a.grad_value = gv16;
            a.grad_sampling_locations = gloc16, a.grad_attention_weights = gattn16;
            want.grad_output = gout, want.grad_value = gv;
            want.grad_sampling_locations = gloc, want.grad_attention_weights = gattn;
            st = msda_backward(&a), st_want = msda_backward(&want);
            CHECK(st == MSDA_OK && st_want == MSDA_OK, "%s %s backward: %d %d %s", name, option,
                  st, st_want, msda_last_error());
            const double e_value = relative_difference(gv16, gv, NV);
            const double e_loc = relative_difference(gloc16, gloc, 2 * NA);
            const double e_attn = relative_difference(gattn16, gattn, NA);
            CHECK(e_value <= 1e-6 && e_loc <= 1e-6 && e_attn <= 1e-6,
                  "%s %s gradients: relative differences value %g locations %g weights %g", name,
                  option, e_value, e_loc, e_attn);
            if (options[o].flags == 0 && !options[o].per_level) {
                /* the check can tell: locations rounded to the half type move the gradients */
                want.sampling_locations = loc_rounded;
                msda_backward(&want);
                CHECK(relative_difference(gattn16, gattn, NA) > 1e-4,
                      "%s: rounding the locations changes nothing (%g)", name,
                      relative_difference(gattn16, gattn, NA));
            }
        }
#undef TO_HALF
#undef FROM_HALF
    }
}

static void test_lying_shapes_stay_in_bounds(void) {
    /* S = 4 but the table claims a 2^40 x 2^40 level starting at a negative offset and a level
     * starting past S: the call must succeed, reading and writing only inside the buffers
     * (run under AddressSanitizer to make this strict). */
    enum { S = 4, L = 3, Q = 64, P = 2 };
    float *v = malloc(S * sizeof(float)), *loc = malloc(Q * L * P * 2 * sizeof(float));
    float *attn = malloc(Q * L * P * sizeof(float)), *out = malloc(Q * sizeof(float));
    float *gout = malloc(Q * sizeof(float)), *gv = malloc(S * sizeof(float));
    float *gloc = malloc(Q * L * P * 2 * sizeof(float)), *gattn = malloc(Q * L * P * sizeof(float));
    int64_t shapes[2 * L] = {(int64_t)1 << 40, (int64_t)1 << 40, 2, 2, 3, 9}, starts[L] = {-7, 2, 99};
    for (int i = 0; i < S; i++) v[i] = 1;
    for (int i = 0; i < Q * L * P * 2; i++) loc[i] = (float)urand();
    for (int i = 0; i < Q * L * P; i++) attn[i] = 1;
    for (int i = 0; i < Q; i++) gout[i] = 1;
    int st = call_forward(1, S, 1, 1, L, Q, P, MSDA_F32, MSDA_I64, -1, v, shapes, starts, loc,
                          attn, out);
    int finite = 1;
    for (int i = 0; i < Q; i++) finite &= isfinite(out[i]) && out[i] >= 0 && out[i] <= L * P;
    CHECK(st == MSDA_OK && finite, "lying shapes forward: %d %s", st, msda_last_error());
    st = call_backward(1, S, 1, 1, L, Q, P, MSDA_F32, 1, v, shapes, starts, loc, attn, gout, gv,
                       gloc, gattn);
    CHECK(st == MSDA_OK, "lying shapes backward: %d %s", st, msda_last_error());
    free(v), free(loc), free(attn), free(out), free(gout), free(gv), free(gloc), free(gattn);
}

static void test_level_starts(void) {
    /* msda_level_starts on the CPU: the prefix sums of H*W, in both index types; from a level
     * whose size is < 1 or overruns S on, S; bad arguments refused. */
    const int64_t shapes[8] = {4, 6, 2, 3, 1, 1, 3, 3}, want[4] = {0, 24, 30, 31};
    const int32_t shapes32[8] = {4, 6, 2, 3, 1, 1, 3, 3};
    int64_t starts[4] = {-1, -1, -1, -1};
    int32_t starts32[4] = {-1, -1, -1, -1};
    int st = msda_level_starts(4, 40, MSDA_I64, -1, shapes, starts, NULL);
    CHECK(st == MSDA_OK && memcmp(starts, want, sizeof want) == 0, "starts %lld %lld %lld %lld",
          (long long)starts[0], (long long)starts[1], (long long)starts[2], (long long)starts[3]);
    st = msda_level_starts(4, 40, MSDA_I32, -1, shapes32, starts32, NULL);
    CHECK(st == MSDA_OK && starts32[0] == 0 && starts32[1] == 24 && starts32[2] == 30 &&
              starts32[3] == 31, "int32 starts");
    const int64_t lying[8] = {-4, 6, 2, 3, (int64_t)1 << 40, (int64_t)1 << 40, 1, 1};
    st = msda_level_starts(4, 40, MSDA_I64, -1, lying, starts, NULL);
    CHECK(st == MSDA_OK && starts[0] == 0 && starts[1] == 40 && starts[2] == 40 &&
              starts[3] == 40, "negative side: %lld %lld", (long long)starts[1],
          (long long)starts[3]);
    const int64_t huge[8] = {4, 6, (int64_t)1 << 40, (int64_t)1 << 40, 1, 1, 1, 1};
    st = msda_level_starts(4, 40, MSDA_I64, -1, huge, starts, NULL);
    CHECK(st == MSDA_OK && starts[1] == 24 && starts[2] == 40 && starts[3] == 40,
          "overrun: %lld %lld", (long long)starts[2], (long long)starts[3]);
    CHECK(msda_level_starts(0, 40, MSDA_I64, -1, shapes, starts, NULL) ==
                  MSDA_ERR_INVALID_ARGUMENT &&
              strstr(msda_last_error(), "L = 0") != NULL,
          "L = 0: %s", msda_last_error());
    CHECK(msda_level_starts(4, 40, MSDA_I64, -1, NULL, starts, NULL) ==
                  MSDA_ERR_INVALID_ARGUMENT &&
              strstr(msda_last_error(), "spatial_shapes") != NULL,
          "NULL shapes: %s", msda_last_error());
    CHECK(msda_level_starts(4, 40, 7, -1, shapes, starts, NULL) == MSDA_ERR_INVALID_ARGUMENT,
          "index_dtype 7");
    CHECK(msda_level_starts(4, 40, MSDA_I64, -1, shapes, (char *)starts + 4, NULL) ==
              MSDA_ERR_INVALID_ARGUMENT,
          "misaligned starts");
}

int main(void) {
    test_capabilities();
    test_argument_checks();
    test_null_args_refused();
    test_error_text_is_per_thread();
    test_half_conversions();
    test_cpu_forward_backward();
    test_points_f32_needs_half_dtype();
    test_points_f32_matches_f32_cpu();
    test_lying_shapes_stay_in_bounds();
    test_level_starts();
    printf("%d passed, %d failed\n", passed, failed);
    return failed != 0;
}
