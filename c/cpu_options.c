/* c/cpu_options.c: the CPU forward and backward for every problem the tuned kernels of
 * c/cpu_plain.c do not serve (msda_uses_options()): per-level point counts (level_points),
 * nearest sampling (MSDA_NEAREST), and both together.
 *
 * Math, gradients and the out-of-range rule: c/msda.h.
 *
 * Thread map: forward, (b, q) rows with all their heads, handed out dynamically; backward, one
 * task per (b, h), which zeroes grad_value[b, :, h, :], scatters into it and writes the point
 * gradients of its (b, *, h) points: no two threads write the same element, no atomics, and the
 * results do not depend on the thread count (the CPU backward is deterministic).
 * Numerics: ACC (accumulation) is f32 for f32/f16/bf16 and f64 for f64; positions are
 * computed in double, where they are exact. Halves are converted as they are loaded (dtypes.h), the
 * grad_output row once per (b, q, h). Channel loops are innermost and contiguous. With
 * MSDA_POINTS_F32 the half kernels read locations and weights as float32 and write
 * their gradients as float32, testing the flag per point, outside the channel loops.
 * Not tuned: these paths serve RT-DETRv2-style layers, where the tuned kernels do not apply
 * (their times beside the tuned plain op's: kernels/TUNING.md, CPU "general", the
 * name this family had when it was measured).
 * The per-element-type kernels are cpu_options.inc, included once per type in the idiom of
 * c/cpu_common.h (as cpu_plain.c includes cpu_plain.inc).
 */

#include <math.h>
#include <string.h>

#include "cpu_common.h"

// ---------------------------------------------------------------------------------------------
// helpers

/* What every task of one call shares (c/cpu_common.h: the per-call tables). */
struct cpu_tables {
    const msda_problem *pr;
    cpu_level *levels;    /* L entries; h = w = 0: a level no point can land in */
    int32_t *point_level; /* NP entries: the level of each point of a (b, q, h) */
    int nearest;
};

/* Where one point reads: up to four corners (nearest: corner 0 alone). */
typedef struct {
    int64_t pos[4]; /* flat position in S of corner k = 2*dy + dx; -1: reads 0 */
    double w[4];    /* the corner's weight in the sample */
    double fx, fy;  /* bilinear: the point's fraction inside its cell */
    int hit;        /* some corner is read */
} options_sample;

static void free_tables(cpu_tables *cx) { free(cx); }

/* Reads the level tables and the point -> level map, in one allocation with the struct. */
static int read_tables(const msda_problem *pr, const char *fn, cpu_tables **out) {
    cpu_tables *cx = (cpu_tables *)malloc(sizeof(cpu_tables) +
                                          (size_t)pr->L * sizeof(cpu_level) +
                                          (size_t)pr->NP * sizeof(int32_t));
    if (!cx)
        return msda_set_error(MSDA_ERR_INTERNAL, "%s: host malloc of the level tables (L = %lld, "
                              "%lld points) failed", fn, (long long)pr->L, (long long)pr->NP);
    cx->pr = pr;
    cx->nearest = (pr->flags & MSDA_NEAREST) != 0;
    cx->levels = (cpu_level *)(cx + 1);
    cx->point_level = (int32_t *)(cx->levels + pr->L);
    for (int64_t l = 0; l < pr->L; l++) {
        cpu_level *lv = &cx->levels[l];
        *lv = cpu_level_at(pr, l);
        /* Sizes whose positions could overflow int64 arithmetic come only from lying tables:
         * such a level reads nothing (any real level has h*w <= S < 2^62). */
        const int64_t limit = (int64_t)1 << 52;
        if (lv->h <= 0 || lv->w <= 0 || lv->h > limit / lv->w || lv->start < -limit ||
            lv->start > limit)
            lv->h = lv->w = 0;
    }
    for (int64_t l = 0, i = 0; l < pr->L; l++) {
        const int64_t end = pr->uniform_points ? (l + 1) * pr->P : pr->point_start[l + 1];
        for (; i < end; i++) cx->point_level[i] = (int32_t)l;
    }
    *out = cx;
    return MSDA_OK;
}

/* The flat position of pixel (x, y) of a level, or -1 when it is outside the level or [0, S). */
static inline int64_t checked_position(const cpu_level *lv, int64_t S, int64_t x, int64_t y) {
    if (x < 0 || y < 0 || x >= lv->w || y >= lv->h) return -1;
    const int64_t pos = lv->start + y * lv->w + x;
    return pos >= 0 && pos < S ? pos : -1;
}

static void locate_bilinear(options_sample *g, const cpu_level *lv, int64_t S, double loc_x,
                            double loc_y) {
    const double W = (double)lv->w, H = (double)lv->h;
    const double x = loc_x * W - 0.5, y = loc_y * H - 0.5;
    g->hit = 0;
    g->fx = g->fy = 0.0;
    for (int k = 0; k < 4; k++) g->pos[k] = -1, g->w[k] = 0.0;
    if (!(x > -1.0 && y > -1.0 && x < W && y < H)) return; /* NaN and infinities too */
    /* floor without a libm call: x, y are in (-1, 2^52), where the truncation is exact */
    const double xt = (double)(int64_t)x, yt = (double)(int64_t)y;
    const double x0 = xt - (double)(xt > x), y0 = yt - (double)(yt > y);
    g->fx = x - x0;
    g->fy = y - y0;
    for (int k = 0; k < 4; k++) {
        const int dx = k & 1, dy = k >> 1;
        g->pos[k] = checked_position(lv, S, (int64_t)x0 + dx, (int64_t)y0 + dy);
        g->w[k] = (dx ? g->fx : 1.0 - g->fx) * (dy ? g->fy : 1.0 - g->fy);
        g->hit |= g->pos[k] >= 0;
    }
}

/* clamp(floor(v), 0, size - 1) for a finite v, without converting an out-of-range double. */
static inline int64_t nearest_index(double v, int64_t size) {
    if (!(v >= 0.0)) return 0;
    if (v >= (double)size) return size - 1;
    return (int64_t)v; /* truncation is floor for v >= 0 */
}

static void locate_nearest(options_sample *g, const cpu_level *lv, int64_t S, double loc_x,
                           double loc_y) {
    g->hit = 0;
    g->fx = g->fy = 0.0;
    for (int k = 0; k < 4; k++) g->pos[k] = -1, g->w[k] = 0.0;
    if (!isfinite(loc_x) || !isfinite(loc_y) || lv->w == 0) return;
    const int64_t x = nearest_index(loc_x * (double)lv->w + 0.5, lv->w);
    const int64_t y = nearest_index(loc_y * (double)lv->h + 0.5, lv->h);
    g->pos[0] = checked_position(lv, S, x, y);
    g->w[0] = 1.0;
    g->hit = g->pos[0] >= 0;
}

static inline void locate(options_sample *g, const cpu_tables *cx, int64_t point, double loc_x,
                          double loc_y) {
    const cpu_level *lv = &cx->levels[cx->point_level[point]];
    if (cx->nearest)
        locate_nearest(g, lv, cx->pr->S, loc_x, loc_y);
    else
        locate_bilinear(g, lv, cx->pr->S, loc_x, loc_y);
}

/* One task of a call (a forward row, a backward slice) with its thread's scratch. */
typedef void (*options_task)(const cpu_tables *cx, int64_t task, void *scratch);

/* The tasks of a call, handed out `chunk` at a time from a shared counter to its workers, each
 * with scratch_bytes of scratch of its own. */
typedef struct {
    const cpu_tables *cx;
    options_task task;
    int64_t tasks, next, chunk, scratch_bytes;
    char *scratch;
} task_queue;

static void run_queue(void *arg, size_t worker) {
    task_queue *q = (task_queue *)arg;
    void *scratch = q->scratch + (int64_t)worker * q->scratch_bytes;
    for (;;) {
        const int64_t begin = __atomic_fetch_add(&q->next, q->chunk, __ATOMIC_RELAXED);
        if (begin >= q->tasks) break;
        const int64_t end = begin + q->chunk < q->tasks ? begin + q->chunk : q->tasks;
        for (int64_t t = begin; t < end; t++) q->task(q->cx, t, scratch);
    }
}

/* Runs tasks [0, tasks) of a call with `work` sampling points, handed out `chunk` at a time to
 * the threads, each with scratch_bytes of its own scratch (a multiple of the element size). */
static int run_tasks(const cpu_tables *cx, const char *fn, options_task task, int64_t tasks,
                     int64_t work, int64_t scratch_bytes, int chunk) {
    const int threads = cpu_threads(cx->pr, work, tasks);
    task_queue q = {cx, task, tasks, 0, chunk, scratch_bytes, NULL};
    q.scratch = (char *)malloc((size_t)threads * (size_t)scratch_bytes);
    if (!q.scratch)
        return msda_set_error(MSDA_ERR_INTERNAL, "%s: host malloc of %d x %lld scratch bytes "
                              "failed", fn, threads, (long long)scratch_bytes);
    const int st = cpu_run_workers(cx->pr, threads, run_queue, &q);
    free(q.scratch);
    return st;
}

// ---------------------------------------------------------------------------------------------
// kernels, once per element type (c/cpu_instances.inc: a row of the dtype table each)

#define CPU_TEMPLATE "cpu_options.inc"
#include "cpu_instances.inc"

// ---------------------------------------------------------------------------------------------
// entry points

#define FORWARD_OF(code, suffix, ...) [code] = MSDA_CAT(options_forward, suffix),
#define BACKWARD_OF(code, suffix, ...) [code] = MSDA_CAT(options_backward, suffix),

int msda_cpu_options_forward(const msda_problem *pr) {
    static const cpu_kernel kernels[MSDA_DTYPE_COUNT] = {MSDA_DTYPES(FORWARD_OF)};
    return run_kernel(pr, "msda_forward", kernels);
}

int msda_cpu_options_backward(const msda_problem *pr) {
    static const cpu_kernel kernels[MSDA_DTYPE_COUNT] = {MSDA_DTYPES(BACKWARD_OF)};
    if (!pr->grad_value && !pr->grad_sampling_locations && !pr->grad_attention_weights)
        return MSDA_OK;
    return run_kernel(pr, "msda_backward", kernels);
}
