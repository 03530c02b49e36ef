/* tests/fuzz/fuzz_msda.c: libFuzzer target for the C API's CPU path (msda_forward, msda_backward).
 *
 * Each input is a small program: sizes, dtype, index dtype, device, thread count, shape tables
 * (honest, perturbed, or made of arbitrary and extreme integers), sampling locations drawn from
 * a list of awkward values (NaN, +-Inf, huge, denormal, the level edges), attention weights,
 * which gradients to ask for, and optionally one NULL or misaligned pointer. Every buffer is
 * allocated with exactly the size the claimed sizes imply, so AddressSanitizer sees any read or
 * write past it. Sizes are capped (B <= 3, Q <= 8, H <= 4, C <= 9, L <= 5, P <= 4, sides <= 8 when
 * honest) so an input runs in microseconds; a separate mode draws extreme sizes (negative, 2^31,
 * 2^62, INT64_MAX, ...) and calls only when they must be refused, with tiny buffers.
 *
 * Beside the sanitizers, the target aborts (a finding) when:
 *   - the status disagrees with a model of the documented checks written here (a valid call
 *     refused, or an invalid one accepted), or the error text is empty on failure / left set on
 *     success;
 *   - an output or a requested gradient is left unwritten (buffers start as NaN) although every
 *     weight and value is finite;
 *   - an output exceeds sum|A| * max|value| (every sample is a convex mix of value entries), or a
 *     weight gradient exceeds sum|grad_out| * max|value|;
 *   - with honest tables, the forward differs from a direct double computation.
 * Built without OpenMP (the pragmas compile away): the index arithmetic is the same serially.
 * `make fuzz` builds and runs it; tests/fuzz/corpus holds six hand-made seeds, one per mode and
 * dtype family (honest f32 forward, honest f64 backward, f16 with NaN/Inf locations and weights,
 * bf16 with a perturbed int32 table, arbitrary tables, extreme sizes). Input layout: a mode byte
 * (below), then for modes 0-2 the bytes B, H, C, L, Q, P, dtype/index codes, device, threads,
 * gradients (bits 0-2; bit 3 runs the backward), sabotage, victim, two sides per level, the
 * table changes of modes 1-2, a value seed, one byte per location and one per weight.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "dtypes.h"
#include "msda.h"

#define MAX_THREADS 1024 /* MSDA_MAX_THREADS in c/msda.c */

// ---------------------------------------------------------------------------------------------
// input reader: bytes past the end read as 0

typedef struct {
    const uint8_t *p;
    size_t n;
} reader;

static uint8_t u8(reader *r) {
    if (!r->n) return 0;
    r->n--;
    return *r->p++;
}

static uint64_t u64(reader *r) {
    uint64_t v = 0;
    for (int i = 0; i < 8; i++) v |= (uint64_t)u8(r) << (8 * i);
    return v;
}

static const int64_t MAGIC[] = {
    0, 1, 2, -1, -2, 3, 7, 8, 64, 255, 4096, 65535, 65536, (int64_t)1 << 24, ((int64_t)1 << 24) + 1,
    INT32_MAX, (int64_t)INT32_MAX + 1, INT32_MIN, (int64_t)1 << 32, ((int64_t)1 << 40) - 1,
    (int64_t)1 << 40, ((int64_t)1 << 40) + 1, (int64_t)1 << 53, (int64_t)1 << 61, (int64_t)1 << 62,
    INT64_MAX, INT64_MIN, INT64_MIN + 1, -((int64_t)1 << 40),
};
#define N_MAGIC (sizeof MAGIC / sizeof MAGIC[0])

/* An integer from the magic list, a small one, or 64 arbitrary bits. */
static int64_t any_int(reader *r) {
    uint8_t k = u8(r);
    if (k < 128) return MAGIC[k % N_MAGIC];
    if (k < 224) return (int64_t)(k - 176); /* -48 .. 47 */
    return (int64_t)u64(r);
}

static double any_location(reader *r) {
    static const double awkward[] = {
        NAN, INFINITY, -INFINITY, 0.0, -0.0, 1.0, 0.5, -0.5, 1.5, 1e30, -1e30, 1e-40, -1e-300,
        0.9999999, 1e-8, 16777216.0, -16777216.0, 1e300, 2.0, -1.0,
    };
    uint8_t k = u8(r);
    if (k < 40) return awkward[k % (sizeof awkward / sizeof awkward[0])];
    return -0.2 + 1.4 * (double)(k - 40) / 215.0;
}

// ---------------------------------------------------------------------------------------------
// element storage in the four dtypes

static int64_t elem_size(int dtype) {
    return dtype == MSDA_F64 ? 8 : (dtype == MSDA_F16 || dtype == MSDA_BF16) ? 2 : 4;
}

static void put(void *buf, int dtype, int64_t i, double v) {
    switch (dtype) {
    case MSDA_F64: ((double *)buf)[i] = v; break;
    case MSDA_F16: ((uint16_t *)buf)[i] = msda_float_to_half((float)v); break;
    case MSDA_BF16: ((uint16_t *)buf)[i] = msda_float_to_bf16((float)v); break;
    default: ((float *)buf)[i] = (float)v;
    }
}

static double get(const void *buf, int dtype, int64_t i) {
    switch (dtype) {
    case MSDA_F64: return ((const double *)buf)[i];
    case MSDA_F16: return msda_half_to_float(((const uint16_t *)buf)[i]);
    case MSDA_BF16: return msda_bf16_to_float(((const uint16_t *)buf)[i]);
    default: return ((const float *)buf)[i];
    }
}

// ---------------------------------------------------------------------------------------------
// a model of the documented argument checks

/* a * b * ... of non-negative factors, saturated just past INT64_MAX. */
static unsigned __int128 product(const int64_t *f, int n) {
    unsigned __int128 p = 1;
    for (int i = 0; i < n; i++)
        if (f[i] == 0) return 0;
    for (int i = 0; i < n; i++) {
        p *= (unsigned __int128)f[i];
        if (p > (unsigned __int128)INT64_MAX) return (unsigned __int128)INT64_MAX + 1;
    }
    return p;
}

static int sizes_valid(int64_t B, int64_t S, int64_t H, int64_t C, int64_t L, int64_t Q,
                       int64_t P) {
    if (B < 0 || S < 0 || Q < 0 || H < 1 || C < 1 || L < 1 || P < 1) return 0;
    const int64_t value[] = {B, S, H, C, 8}, out[] = {B, Q, H, C, 8};
    const int64_t loc[] = {B, Q, H, L, P, 2, 8}, levels[] = {L, 24};
    const unsigned __int128 max = (unsigned __int128)INT64_MAX;
    return product(value, 5) <= max && product(out, 5) <= max && product(loc, 7) <= max &&
           product(levels, 2) <= max;
}

static int codes_valid(int dtype, int index_dtype, int device, int num_threads) {
    return dtype >= 0 && dtype <= 3 && (index_dtype == MSDA_I64 || index_dtype == MSDA_I32) &&
           device == -1 /* a CPU-only build: device >= 0 is unsupported */ &&
           num_threads <= MAX_THREADS;
}

static void check_status(int st, int expect_ok) {
    const char *text = msda_last_error();
    if (expect_ok ? st != MSDA_OK : st == MSDA_OK) abort();
    if (st != MSDA_OK && st != MSDA_ERR_INVALID_ARGUMENT && st != MSDA_ERR_UNSUPPORTED) abort();
    if ((st == MSDA_OK) != (text[0] == '\0')) abort();
    if (st != MSDA_OK && !strstr(text, "msda_")) abort();
}

// ---------------------------------------------------------------------------------------------
// extreme sizes: call only where the model says the call must be refused

static int fuzz_extreme(reader *r) {
    int64_t s[7];
    for (int i = 0; i < 7; i++) s[i] = any_int(r);
    const int dtype = u8(r) % 5, index_dtype = u8(r) % 3, backward = u8(r) & 1;
    if (sizes_valid(s[0], s[1], s[2], s[3], s[4], s[5], s[6]) &&
        codes_valid(dtype, index_dtype, -1, 1))
        return 0; /* would need buffers of the claimed (huge) sizes */
    double buf[16] = {0};
    const msda_args a = {.B = s[0], .S = s[1], .H = s[2], .C = s[3], .L = s[4], .Q = s[5],
                         .P = s[6], .dtype = dtype, .index_dtype = index_dtype, .device = -1,
                         .num_threads = 1, .value = buf, .spatial_shapes = buf,
                         .level_start_index = buf, .sampling_locations = buf,
                         .attention_weights = buf, .grad_output = buf, .output = buf,
                         .grad_value = buf, .grad_sampling_locations = buf,
                         .grad_attention_weights = buf};
    int st = backward ? msda_backward(&a) : msda_forward(&a);
    check_status(st, 0);
    return 0;
}

// ---------------------------------------------------------------------------------------------
// small problems with real buffers

/* Direct double computation of out[b,q,h,c] from honest tables (test_c_api.c's formula). */
static double reference(const void *value, int dtype, const int64_t *tab, int64_t S, int64_t H,
                        int64_t C, int64_t L, int64_t P, const void *loc, const void *attn,
                        int64_t qh, int64_t b, int64_t h, int64_t c) {
    double sum = 0;
    for (int64_t l = 0; l < L; l++) {
        const int64_t Hl = tab[2 * l], Wl = tab[2 * l + 1], start = tab[2 * L + l];
        for (int64_t p = 0; p < P; p++) {
            const int64_t i = (qh * L + l) * P + p;
            const double x = get(loc, dtype, 2 * i) * (double)Wl - 0.5;
            const double y = get(loc, dtype, 2 * i + 1) * (double)Hl - 0.5;
            if (!(x > -1.0 && y > -1.0 && x < (double)Wl && y < (double)Hl)) continue;
            const double x0 = floor(x), y0 = floor(y), a = get(attn, dtype, i);
            for (int k = 0; k < 4; k++) {
                const int64_t xx = (int64_t)x0 + (k & 1), yy = (int64_t)y0 + (k >> 1);
                if (xx < 0 || yy < 0 || xx >= Wl || yy >= Hl) continue;
                const double wx = (k & 1) ? x - x0 : 1 - (x - x0);
                const double w = wx * ((k >> 1) ? y - y0 : 1 - (y - y0));
                sum += a * w * get(value, dtype, ((b * S + start + yy * Wl + xx) * H + h) * C + c);
            }
        }
    }
    return sum;
}

static void *alloc_nan(int64_t bytes) {
    void *p = malloc((size_t)bytes);
    if (!p && bytes) abort();
    if (p) memset(p, 0xff, (size_t)bytes); /* all-ones: NaN in every float type */
    return p;
}

static int fuzz_small(reader *r, int mode) {
    const int64_t B = u8(r) % 4, H = u8(r) % 5, C = u8(r) % 10, L = u8(r) % 6, Q = u8(r) % 9,
                  P = u8(r) % 5;
    const uint8_t codes = u8(r);
    const int dtype = (codes & 15) == 15 ? 4 : (codes & 3); /* 4: not a dtype code */
    const int index_dtype = (codes >> 4) == 15 ? 2 : (codes >> 4) & 1;
    const uint8_t dev = u8(r);
    const int device = dev < 250 ? -1 : dev < 253 ? -2 : 0;
    const uint8_t thr = u8(r);
    const int num_threads = thr < 250 ? (int)(thr % 4) - 1 : thr < 253 ? 5000 : INT32_MAX;
    const uint8_t grads = u8(r); /* bit 0..2: which gradients; bit 3: run backward */
    const uint8_t sabotage = u8(r), victim = u8(r) % 10;
    const int null_ptr = sabotage >= 240 && sabotage < 248, misalign = sabotage >= 248;

    /* shape tables, kept as int64 here and stored in the index dtype */
    const int64_t nL = L > 0 ? L : 0;
    int64_t *tab = calloc((size_t)(3 * nL + 1), sizeof(int64_t)); /* H_l, W_l pairs, then starts */
    int64_t S = 0;
    for (int64_t l = 0; l < nL; l++) {
        tab[2 * l] = 1 + u8(r) % 8;
        tab[2 * l + 1] = 1 + u8(r) % 8;
        tab[2 * nL + l] = S;
        S += tab[2 * l] * tab[2 * l + 1];
    }
    int honest = 1;
    if (mode == 1 && nL > 0) { /* perturb one entry, or S */
        const uint8_t k = u8(r);
        if (k % 4 == 3) S = (int64_t)(u8(r) % 130);
        else tab[k % (3 * nL)] = any_int(r);
        honest = 0;
    } else if (mode == 2) { /* every entry arbitrary */
        for (int64_t j = 0; j < 3 * nL; j++) tab[j] = any_int(r);
        S = (int64_t)(u8(r) % 65);
        honest = 0;
    }
    if (index_dtype == MSDA_I32) /* what an int32 table can hold */
        for (int64_t j = 0; j < 3 * nL; j++) tab[j] = (int32_t)tab[j];

    const int64_t es = elem_size(dtype), is = index_dtype == MSDA_I64 ? 8 : 4;
    const int64_t n_value = B * S * H * C, n_out = B * Q * H * C, n_attn = B * Q * H * L * P;
    const int64_t n_loc = 2 * n_attn;
    const int ok_sizes = sizes_valid(B, S, H, C, L, Q, P);
    const int64_t nv = ok_sizes ? n_value : 0, no = ok_sizes ? n_out : 0;
    const int64_t na = ok_sizes ? n_attn : 0, nl = ok_sizes ? n_loc : 0;

    void *value = malloc((size_t)(nv * es)), *loc = malloc((size_t)(nl * es));
    void *attn = malloc((size_t)(na * es)), *gout = malloc((size_t)(no * es));
    void *shapes = malloc((size_t)(2 * nL * is)), *starts = malloc((size_t)(nL * is));
    uint64_t seed = 0x9E3779B97F4A7C15ull ^ u8(r);
    double max_value = 0;
    for (int64_t i = 0; i < nv; i++) {
        seed = seed * 6364136223846793005ull + 1442695040888963407ull;
        put(value, dtype, i, (double)(int64_t)(seed >> 33) / 1073741824.0 - 2.0);
        max_value = fmax(max_value, fabs(get(value, dtype, i)));
    }
    for (int64_t i = 0; i < nl; i++) put(loc, dtype, i, any_location(r));
    int finite_weights = 1;
    for (int64_t i = 0; i < na; i++) {
        const uint8_t k = u8(r);
        const double a = k == 255 ? NAN : k == 254 ? INFINITY : (double)k / 63.0 - 2.0;
        put(attn, dtype, i, a);
        finite_weights &= isfinite(get(attn, dtype, i));
    }
    for (int64_t i = 0; i < no; i++) put(gout, dtype, i, (double)(i % 7) / 3.0 - 1.0);
    for (int64_t j = 0; j < 2 * nL; j++) {
        if (is == 8) ((int64_t *)shapes)[j] = tab[j];
        else ((int32_t *)shapes)[j] = (int32_t)tab[j];
    }
    for (int64_t j = 0; j < nL; j++) {
        if (is == 8) ((int64_t *)starts)[j] = tab[2 * nL + j];
        else ((int32_t *)starts)[j] = (int32_t)tab[2 * nL + j];
    }

    const int run_backward = (grads >> 3) & 1;
    const int64_t acc = dtype == MSDA_F64 ? 8 : 4;
    void *out = alloc_nan(no * es);
    void *gv = (grads & 1) ? alloc_nan(nv * acc) : NULL;
    void *gl = (grads & 2) ? alloc_nan(nl * es) : NULL;
    void *ga = (grads & 4) ? alloc_nan(na * es) : NULL;

    /* One pointer replaced by NULL or by itself + 1 byte; the model says when that must be
     * refused. The forward takes value, shapes, starts, loc, attn and out (0-4, 6). */
    const void *args[10] = {value, shapes, starts, loc, attn, gout, out, gv, gl, ga};
    const int used = run_backward ? victim != 6 : victim <= 4 || victim == 6;
    int expect_ok = ok_sizes && codes_valid(dtype, index_dtype, device, num_threads);
    int sabotaged = 0;
    if (misalign && args[victim]) {
        args[victim] = (const char *)args[victim] + 1; /* never dereferenced: must be refused */
        sabotaged = 1;
        if (used) expect_ok = 0;
    } else if (null_ptr && args[victim]) {
        args[victim] = NULL;
        sabotaged = 1;
        /* Which pointers each entry point needs after its early returns (c/msda.c). */
        const int needed =
            run_backward
                ? (args[7] || args[8] || args[9]) && !(B == 0 || (Q == 0 && S == 0)) &&
                      (victim == 1 || victim == 2 ||
                       (Q > 0 && (victim == 3 || victim == 4 || victim == 5 ||
                                  (victim == 0 && S > 0))))
                : !(B == 0 || Q == 0) && used && (victim != 0 || S > 0);
        if (needed) expect_ok = 0;
    }
    msda_args call = {.B = B, .S = S, .H = H, .C = C, .L = L, .Q = Q, .P = P, .dtype = dtype,
                      .index_dtype = index_dtype, .device = device, .num_threads = num_threads,
                      .value = args[0], .spatial_shapes = args[1], .level_start_index = args[2],
                      .sampling_locations = args[3], .attention_weights = args[4]};
    if (run_backward) {
        call.grad_output = args[5];
        call.grad_value = (void *)args[7];
        call.grad_sampling_locations = (void *)args[8];
        call.grad_attention_weights = (void *)args[9];
    } else {
        call.output = (void *)args[6];
    }
    const int st = run_backward ? msda_backward(&call) : msda_forward(&call);
    check_status(st, expect_ok);

    if (st == MSDA_OK && !run_backward && finite_weights && !sabotaged) {
        for (int64_t qh = 0; qh < B * Q * H; qh++) {
            double sum_a = 0;
            for (int64_t i = qh * L * P; i < (qh + 1) * L * P; i++)
                sum_a += fabs(get(attn, dtype, i));
            const double bound = sum_a * max_value * 1.01 + 1e-6;
            const int64_t b = qh / (Q * H), h = qh % H;
            for (int64_t c = 0; c < C; c++) {
                const double o = get(out, dtype, qh * C + c);
                if (isnan(o) || fabs(o) > bound) abort();
                if (honest) {
                    const double want = reference(value, dtype, tab, S, H, C, L, P, loc, attn,
                                                  qh, b, h, c);
                    const double tol = dtype == MSDA_F64 ? 1e-9 : dtype == MSDA_F32 ? 1e-4 : 2e-2;
                    if (fabs(o - want) > tol * (bound + 1)) abort();
                }
            }
        }
    }
    if (st == MSDA_OK && run_backward && finite_weights && !sabotaged) {
        for (int64_t i = 0; gv && i < nv; i++)
            if (isnan(get(gv, dtype == MSDA_F64 ? MSDA_F64 : MSDA_F32, i))) abort();
        for (int64_t i = 0; gl && i < nl; i++)
            if (isnan(get(gl, dtype, i))) abort();
        for (int64_t qh = 0; ga && qh < B * Q * H; qh++) {
            double sum_g = 0;
            for (int64_t c = 0; c < C; c++) sum_g += fabs(get(gout, dtype, qh * C + c));
            for (int64_t i = qh * L * P; i < (qh + 1) * L * P; i++) {
                const double g = get(ga, dtype, i);
                if (isnan(g) || fabs(g) > sum_g * max_value * 1.01 + 1e-6) abort();
            }
        }
    }
    free(value), free(loc), free(attn), free(gout), free(shapes), free(starts);
    free(out), free(gv), free(gl), free(ga), free(tab);
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    reader r = {data, size};
    const int mode = u8(&r) % 4; /* 0 honest, 1 one entry perturbed, 2 arbitrary, 3 extreme */
    return mode == 3 ? fuzz_extreme(&r) : fuzz_small(&r, mode);
}
