/* kernels/forward.cu: the forward's entry point (msda_cuda_forward); the kernels and their
 * launch, templated on the dtype: kernels/forward.cuh, one instance per row of c/dtypes.h from
 * kernels/instances/forward.cu. */
#include "forward.cuh"

#define LAUNCHER_OF(code, suffix, ...) MSDA_CAT(msda_forward_launch, suffix),

extern "C" int msda_cuda_forward(const msda_problem *pr) {
    static const msda_launcher by_dtype[MSDA_DTYPE_COUNT] = {MSDA_DTYPES(LAUNCHER_OF)};
    return run_launcher("msda_forward", pr, by_dtype);
}
