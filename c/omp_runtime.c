/* c/omp_runtime.c: the OpenMP runtime the CPU kernels run on, chosen at their first parallel call.
 *
 * GCC compiles the kernels' pragmas into calls of libgomp's entry points. This file defines those
 * few (hidden: never exported, so they bind only inside this library), each forwarding to a table
 * filled once, at the first call, from the first of:
 *   1. an OpenMP runtime already mapped into the process (torch's libgomp, LLVM's libomp or
 *      Intel's libiomp5, which also serve the GOMP_ entry points): the process keeps one
 *      runtime and one thread pool, whatever the runtime's file is called;
 *   2. the system's libgomp.so.1 (dlopen): threads on a box with no torch (ONNX Runtime only);
 *   3. none: each entry point's one-thread meaning, so the kernels run on the calling thread.
 * So the library names no OpenMP library and loads in any process (a wheel's library needing
 * GOMP_barrier from a runtime that was not there failed to load without torch). A runtime mapped
 * only after the first call is not used: resolve once, never mix two runtimes in one call.
 * The entry points are those `nm -u` lists for the kernels' objects; tests/test_openmp_runtime.py
 * checks that the objects need these and no others, so a new pragma cannot slip through.
 * Cost: one indirect call per entry (a few per kernel call); the table is read with acquire. */
#if !defined(_GNU_SOURCE)
#define _GNU_SOURCE /* dl_iterate_phdr, RTLD_NOLOAD */
#endif
#include <dlfcn.h>
#include <link.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>

#include "msda_internal.h"

#define HIDDEN __attribute__((visibility("hidden")))

// ---------------------------------------------------------------------------------------------
// the table and its one-thread meaning

typedef struct {
    void (*parallel)(void (*fn)(void *), void *data, unsigned num_threads, unsigned flags);
    void (*barrier)(void);
    int (*max_threads)(void);
    int (*num_threads)(void);
    int (*thread_num)(void);
    int (*in_parallel)(void);
} omp_entries;

/* The names of omp_entries' fields, in their order: what the runtime is asked for. */
static const char *const entry_names[] = {
    "GOMP_parallel", "GOMP_barrier",       "omp_get_max_threads",
    "omp_get_num_threads", "omp_get_thread_num", "omp_in_parallel",
};
_Static_assert(sizeof(omp_entries) == sizeof entry_names / sizeof entry_names[0] * sizeof(void *),
               "one name per entry");

static void serial_parallel(void (*fn)(void *), void *data, unsigned n, unsigned flags) {
    (void)n, (void)flags;
    fn(data); /* a team of one: the calling thread is thread 0 */
}
static void serial_barrier(void) {}
static int serial_one(void) { return 1; }
static int serial_zero(void) { return 0; }

static const omp_entries serial = {serial_parallel, serial_barrier, serial_one,
                                   serial_one,      serial_zero,    serial_zero};

// ---------------------------------------------------------------------------------------------
// finding the runtime

static omp_entries found;
static char found_path[512]; /* "" for the one-thread fallback */
static atomic_int state;     /* 0 not resolved, 1 being resolved, 2 resolved */

/* Every entry from `handle`, or 0 (and `out` untouched) when one is missing. */
static int take_entries(void *handle, omp_entries *out) {
    void *fns[sizeof entry_names / sizeof entry_names[0]];
    for (size_t i = 0; i < sizeof entry_names / sizeof entry_names[0]; i++)
        if ((fns[i] = dlsym(handle, entry_names[i])) == NULL) return 0;
    memcpy(out, fns, sizeof *out); /* POSIX: data and function pointers share a representation */
    return 1;
}

/* The OpenMP runtimes mapped now, GNU's first (its GOMP_ entry points are the native ones). */
typedef struct {
    char path[3][512]; /* libgomp*, libomp*, libiomp5* */
} mapped_runtimes;

static int note_runtime(struct dl_phdr_info *info, size_t size, void *data) {
    (void)size;
    static const char *const prefixes[3] = {"libgomp", "libomp", "libiomp5"};
    mapped_runtimes *m = (mapped_runtimes *)data;
    const char *base = info->dlpi_name ? strrchr(info->dlpi_name, '/') : NULL;
    base = base ? base + 1 : info->dlpi_name;
    for (int i = 0; base && i < 3; i++)
        if (strncmp(base, prefixes[i], strlen(prefixes[i])) == 0 && !m->path[i][0])
            snprintf(m->path[i], sizeof m->path[i], "%s", info->dlpi_name);
    return 0;
}

static void resolve(void) {
    mapped_runtimes m;
    memset(&m, 0, sizeof m);
    dl_iterate_phdr(note_runtime, &m);
    for (int i = 0; i < 3; i++) {
        if (!m.path[i][0]) continue;
        /* RTLD_NOLOAD: a handle on the copy already there, never a second one */
        void *handle = dlopen(m.path[i], RTLD_NOW | RTLD_LOCAL | RTLD_NOLOAD);
        if (handle && take_entries(handle, &found)) {
            snprintf(found_path, sizeof found_path, "%s", m.path[i]);
            return;
        }
    }
    void *handle = dlopen("libgomp.so.1", RTLD_NOW | RTLD_LOCAL);
    if (handle && take_entries(handle, &found)) {
        struct link_map *map = NULL;
        const int named = dlinfo(handle, RTLD_DI_LINKMAP, &map) == 0 && map && map->l_name;
        snprintf(found_path, sizeof found_path, "%s", named ? map->l_name : "libgomp.so.1");
        return;
    }
    found = serial;
    found_path[0] = '\0';
}

static const omp_entries *entries(void) {
    if (atomic_load_explicit(&state, memory_order_acquire) == 2) return &found;
    int expected = 0;
    if (atomic_compare_exchange_strong(&state, &expected, 1)) {
        resolve();
        atomic_store_explicit(&state, 2, memory_order_release);
    } else {
        while (atomic_load_explicit(&state, memory_order_acquire) != 2) sched_yield();
    }
    return &found;
}

const char *msda_openmp_runtime(void) {
    entries();
    return found_path;
}

int msda_openmp_available(void) { return entries() != &serial && found_path[0] != '\0'; }

// ---------------------------------------------------------------------------------------------
// the entry points the compiled pragmas call

HIDDEN void GOMP_parallel(void (*fn)(void *), void *data, unsigned num_threads, unsigned flags) {
    entries()->parallel(fn, data, num_threads, flags);
}
HIDDEN void GOMP_barrier(void) { entries()->barrier(); }
HIDDEN int omp_get_max_threads(void) { return entries()->max_threads(); }
HIDDEN int omp_get_num_threads(void) { return entries()->num_threads(); }
HIDDEN int omp_get_thread_num(void) { return entries()->thread_num(); }
HIDDEN int omp_in_parallel(void) { return entries()->in_parallel(); }
