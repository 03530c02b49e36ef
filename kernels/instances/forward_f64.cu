/* kernels/instances/forward_f64.cu: the forward's kernels for double, compiled apart from the
 * other dtypes' so that `make -j` builds them in parallel (kernels/forward.cuh). */
#include "../forward.cuh"

cudaError_t msda_forward_launch_f64(const msda_problem *pr, cudaStream_t stream) {
    return launch_forward<double>(pr, stream);
}
