/* tests/c/test_launch_shapes.cu: routes and launches agree. For every route c/routes.c chooses
 * over a sweep of problems (every dtype of the table, channel counts, decoders and encoders,
 * options, flags, alignment, device facts, wanted gradients), the one switch per pass that turns
 * a route into a kernel instance (with_forward_kernel, with_backward_kernel) must name an
 * instance, and the grid the route sized (plan.blocks) must be the one that instance's block
 * takes (c/launch.h): msda_grid_blocks(items, K::block_items). Host code only: it runs without
 * a GPU (tests/test_launch_shapes.py compiles it with nvcc and c/routes.c with cc).
 * Prints "N passed, N failed" and exits non-zero on any failure. */
#include <stdio.h>

#include "../../kernels/backward.cuh"
#include "../../kernels/forward.cuh"

static int passed, failed;
#define CHECK(cond, ...)                                                                         \
    do {                                                                                         \
        if (cond) {                                                                              \
            passed++;                                                                            \
        } else if (failed++ < 20) {                                                              \
            printf("FAIL %s:%d: ", __FILE__, __LINE__);                                          \
            printf(__VA_ARGS__);                                                                 \
            printf("\n");                                                                        \
        }                                                                                        \
    } while (0)

/* Routes seen, per pass: [dtype][route kernel]. */
static int seen_forward[MSDA_DTYPE_COUNT][8], seen_backward[MSDA_DTYPE_COUNT][8];

struct Shape {
    const char *name;
    int64_t B, S, H, L, Q, P;
};

/* A checked problem as the entry points hand it over (c/msda.c), its tensors at a 16-byte
 * aligned stand-in address (only their presence matters to the routes). */
static msda_problem make_problem(int dtype, const Shape &s, int64_t C, int flags, bool uniform,
                                 int grads) {
    alignas(16) static char stand_in[16];
    msda_problem pr = {};
    pr.B = s.B, pr.S = s.S, pr.H = s.H, pr.C = C, pr.L = s.L, pr.Q = s.Q, pr.P = s.P;
    pr.dtype = dtype, pr.flags = flags, pr.device = 0;
    pr.uniform_points = uniform ? 1 : 0;
    if (uniform) {
        pr.NP = s.L * s.P;
    } else { /* level l has l + 1 points */
        pr.NP = 0;
        for (int64_t l = 0; l < s.L; l++) pr.point_start[l] = (int32_t)pr.NP, pr.NP += l + 1;
        pr.point_start[s.L] = (int32_t)pr.NP;
        pr.P = pr.NP;
    }
    pr.value = pr.spatial_shapes = pr.level_start_index = stand_in;
    pr.sampling_locations = pr.attention_weights = pr.grad_output = stand_in;
    pr.output = pr.workspace = stand_in;
    pr.grad_value = grads & 1 ? stand_in : nullptr;
    pr.grad_sampling_locations = grads & 2 ? stand_in : nullptr;
    pr.grad_attention_weights = grads & 4 ? stand_in : nullptr;
    return pr;
}

template <typename T> static void check_forward(const msda_problem &pr, int aligned, const char *what) {
    msda_forward_plan plan;
    msda_plan_forward(&pr, aligned, &plan);
    seen_forward[pr.dtype][plan.kernel] = 1;
    if (plan.kernel == MSDA_FWD_ROUTE_NONE) return;
    const int64_t items = pr.B * pr.Q * pr.H;
    const cudaError_t e = with_forward_kernel<T>(plan, [&](auto kernel) {
        typedef decltype(kernel) K;
        const unsigned int blocks = msda_grid_blocks(items, K::block_items, MSDA_MAX_GRID_BLOCKS);
        CHECK(plan.blocks == blocks, "%s: forward route %d (group %d) sized %u blocks, its kernel "
              "takes %d items a block (%u blocks)", what, plan.kernel, plan.group, plan.blocks,
              K::block_items, blocks);
        CHECK(K::threads % 32 == 0 && K::threads <= 1024, "%s: forward block of %d threads", what,
              K::threads);
        return cudaSuccess;
    });
    CHECK(e == cudaSuccess, "%s: forward route %d (group %d, options %d) has no kernel instance",
          what, plan.kernel, plan.group, plan.options);
}

template <typename T>
static void check_backward(const msda_problem &pr, int aligned, int multiprocessors, int sm90,
                           const char *what) {
    msda_backward_plan plan;
    msda_plan_backward(&pr, aligned, multiprocessors, sm90, &plan);
    seen_backward[pr.dtype][plan.kernel] = 1;
    if (plan.kernel == MSDA_ROUTE_NONE) return;
    CHECK(!(plan.modifiers & MSDA_ROUTE_F32_WORKSPACE) || IsHalf<T>::value,
          "%s: an f32 workspace for a dtype that is not half", what);
    CHECK(plan.slices >= 1 && plan.slices <= MSDA_BWD_MAX_SLICES, "%s: %d slices", what,
          plan.slices);
    const int64_t items = pr.B * pr.Q * pr.H;
    auto check = [&](auto kernel) {
        typedef decltype(kernel) K;
        const unsigned int blocks = msda_grid_blocks(items, K::block_items, MSDA_MAX_GRID_BLOCKS);
        CHECK(plan.blocks == blocks, "%s: backward route %d (group %d) sized %u blocks, its "
              "kernel takes %d items a block (%u blocks)", what, plan.kernel, plan.group,
              plan.blocks, K::block_items, blocks);
        CHECK(K::threads % 32 == 0 && K::threads <= 1024, "%s: backward block of %d threads",
              what, K::threads);
        return cudaSuccess;
    };
    const cudaError_t e = plan.modifiers & MSDA_ROUTE_DETERMINISTIC
                              ? with_backward_kernel<T, true>(&pr, plan, check)
                              : with_backward_kernel<T, false>(&pr, plan, check);
    CHECK(e == cudaSuccess, "%s: backward route %d (group %d, options %d, modifiers %#x) has no "
          "kernel instance", what, plan.kernel, plan.group, plan.options, plan.modifiers);
}

template <typename T> static void sweep(int dtype) {
    static const Shape shapes[] = {
        {"one point", 1, 16, 1, 1, 1, 1},          {"decoder", 1, 1000, 8, 4, 100, 4},
        {"dino decoder", 2, 20000, 8, 4, 900, 4},  {"encoder", 1, 5000, 8, 4, 5000, 4},
        {"large encoder", 2, 20000, 8, 4, 20000, 4}, {"no queries", 2, 100, 8, 4, 0, 4},
    };
    static const int64_t channels[] = {4, 8, 16, 32, 64, 128, 6, 256};
    static const int flag_sets[] = {0, MSDA_NEAREST, MSDA_DETERMINISTIC, MSDA_POINTS_F32,
                                    MSDA_NEAREST | MSDA_DETERMINISTIC};
    char what[160];
    for (const Shape &s : shapes)
        for (int64_t C : channels)
            for (int flags : flag_sets) {
                if ((flags & MSDA_POINTS_F32) && !msda_dtype_half(dtype)) continue;
                for (int uniform = 0; uniform < 2; uniform++)
                    for (int aligned = 0; aligned < 2; aligned++)
                        for (int grads : {7, 1, 6}) {
                            const msda_problem pr = make_problem(dtype, s, C, flags, uniform, grads);
                            snprintf(what, sizeof what, "dtype %d %s C=%lld flags %d uniform %d "
                                     "aligned %d grads %d", dtype, s.name, (long long)C, flags,
                                     uniform, aligned, grads);
                            check_forward<T>(pr, aligned, what);
                            for (int multiprocessors : {0, 132})
                                for (int sm90 = 0; sm90 < 2; sm90++)
                                    check_backward<T>(pr, aligned, multiprocessors, sm90, what);
                        }
            }
}

int main(void) {
#define SWEEP(code, suffix, cpu_type, acc_type, cuda_type, half) sweep<cuda_type>(code);
    MSDA_DTYPES(SWEEP)
#undef SWEEP
    /* the sweep reaches every route (a route it never chose would go unchecked) */
    for (int k = MSDA_FWD_ROUTE_GENERIC; k <= MSDA_FWD_ROUTE_DIRECT; k++) {
        int any = 0;
        for (int d = 0; d < MSDA_DTYPE_COUNT; d++) any |= seen_forward[d][k];
        CHECK(any, "no problem of the sweep takes forward route %d", k);
    }
    for (int k = MSDA_ROUTE_GENERIC; k <= MSDA_ROUTE_DIRECT; k++) {
        int any = 0;
        for (int d = 0; d < MSDA_DTYPE_COUNT; d++) any |= seen_backward[d][k];
        CHECK(any, "no problem of the sweep takes backward route %d", k);
    }
    printf("%d passed, %d failed\n", passed, failed);
    return failed ? 1 : 0;
}
