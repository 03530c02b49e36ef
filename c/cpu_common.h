/* c/cpu_common.h: the setup both CPU kernel families share: c/cpu_plain.c (the tuned plain
 * op) and c/cpu_options.c (per-level points, nearest sampling). Each includes it once:
 *   - the template idiom of their per-element-type kernels (below);
 *   - a level's sizes read from the caller's shape tables (cpu_level_at);
 *   - the thread count of a call and the thread's number (cpu_threads, cpu_thread_num);
 *   - the entry points' dispatch by dtype around a family's per-call tables (run_kernel).
 * Math: c/msda.h. Each family's .c file says its thread map and numerics. */
#ifndef MSDA_CPU_COMMON_H
#define MSDA_CPU_COMMON_H

#include <stdint.h>
#include <stdlib.h>

#include "msda_internal.h"

#ifdef _OPENMP
#include <omp.h>
#endif

/* ---- the template idiom ---------------------------------------------------------------------
 * A family writes its kernels once, in a .inc file that its .c file names as CPU_TEMPLATE before
 * it includes c/cpu_instances.inc, which includes the template once per row of the dtype table
 * (MSDA_DTYPES, c/dtypes.h) with SUFFIX (f32, f64, f16, bf16), SCALAR (the CPU storage type),
 * ACC (the accumulation type) and HALF_STORAGE (the row's half column) defined. Inside,
 * FN(name) is name_SUFFIX (a function or type of this element type), LOAD and STORE the element
 * conversions of c/dtypes.h for SCALAR. A family's dispatch tables are rows of the same table
 * (run_kernel). */
#define FN(name) MSDA_CAT(name, SUFFIX)
#define LOAD FN(load)
#define STORE FN(store)

/* ---- levels -------------------------------------------------------------------------------- */

/* Level l's sizes and start as the caller's int32 or int64 tables give them (unchecked: each
 * family decides which levels no point can land in). */
typedef struct {
    int64_t h, w, start;
} cpu_level;

static inline cpu_level cpu_level_at(const msda_problem *pr, int64_t l) {
    const cpu_level lv = {msda_index_at(pr->spatial_shapes, pr->index_dtype, 2 * l),
                          msda_index_at(pr->spatial_shapes, pr->index_dtype, 2 * l + 1),
                          msda_index_at(pr->level_start_index, pr->index_dtype, l)};
    return lv;
}

/* ---- threads ------------------------------------------------------------------------------- */

/* Threads for a call with `work` sampling points and `tasks` tasks: the caller's count
 * (torch.get_num_threads()), the OpenMP default when it passed <= 0, or its pool's (a forward
 * from ONNX Runtime); never more than `tasks`. 1 for tiny calls (a team costs more than it
 * saves), when called from inside an OpenMP parallel region (a nested team would
 * oversubscribe), or when no OpenMP runtime was found (c/omp_runtime.c). With 1 thread no
 * OpenMP function is called at all, which keeps a forked DataLoader worker (torch sets 1 thread
 * there) clear of the parent's thread pool, which fork does not copy. */
static inline int cpu_threads(const msda_problem *pr, int64_t work, int64_t tasks) {
    if (pr->num_threads == 1 || work < 2048 || tasks < 2) return 1;
    int n = 1;
    if (pr->pool) {
        n = pr->pool->threads;
    } else {
#ifdef _OPENMP
        if (!msda_openmp_available() || omp_in_parallel()) return 1;
        n = pr->num_threads > 0 ? pr->num_threads : omp_get_max_threads();
#endif
    }
    if ((int64_t)n > tasks) n = (int)tasks;
    return n > 1 ? n : 1;
}

/* This thread's number in its team, and the team's size (0 and 1 outside one). */
static inline int cpu_thread_num(void) {
#ifdef _OPENMP
    return omp_get_thread_num();
#else
    return 0;
#endif
}

static inline int cpu_num_threads(void) {
#ifdef _OPENMP
    return omp_get_num_threads();
#else
    return 1;
#endif
}

/* Runs fn(arg, i) for every worker i < threads: on the call's pool, else on an OpenMP team whose
 * thread i runs worker i (a team smaller than asked runs fewer workers: the workers take their
 * tasks from a shared counter, so those there do all of them). MSDA_OK or the pool's status. */
static inline int cpu_run_workers(const msda_problem *pr, int threads,
                                  void (*fn)(void *arg, size_t worker), void *arg) {
    if (threads <= 1) {
        fn(arg, 0);
        return MSDA_OK;
    }
    if (pr->pool) return pr->pool->run(pr->pool->pool, fn, arg, (size_t)threads);
#pragma omp parallel num_threads(threads)
    fn(arg, (size_t)cpu_thread_num());
    return MSDA_OK;
}

/* ---- dispatch ------------------------------------------------------------------------------
 * A family's per-call tables: its .c file defines struct cpu_tables, read_tables (MSDA_OK, or
 * a status with the error set) and free_tables. */
typedef struct cpu_tables cpu_tables;
static int read_tables(const msda_problem *pr, const char *fn, cpu_tables **out);
static void free_tables(cpu_tables *t);

/* A kernel of one element type. */
typedef int (*cpu_kernel)(const msda_problem *pr, const cpu_tables *t);

/* kernels[pr->dtype] (indexed by msda_dtype: a family's table is {MSDA_DTYPES(entry)}) on the
 * call's tables, read once. */
static inline int run_kernel(const msda_problem *pr, const char *fn,
                             const cpu_kernel kernels[MSDA_DTYPE_COUNT]) {
    if (pr->dtype < 0 || pr->dtype >= MSDA_DTYPE_COUNT)
        return msda_set_error(MSDA_ERR_INTERNAL, "%s: dtype %d", fn, pr->dtype);
    cpu_tables *t = NULL;
    int st = read_tables(pr, fn, &t);
    if (st != MSDA_OK) return st;
    st = kernels[pr->dtype](pr, t);
    free_tables(t);
    return st;
}

#endif /* MSDA_CPU_COMMON_H */
