/* kernels/instances/backward_f64.cu: the backward's kernels for double, compiled apart from
 * the other dtypes' so that `make -j` builds them in parallel (kernels/backward.cuh). */
#include "../backward.cuh"

cudaError_t msda_backward_launch_f64(const msda_problem *pr, cudaStream_t stream) {
    return launch_backward<double>(pr, stream);
}
