/* kernels/instances/backward_f16.cu: the backward's kernels for __half, compiled apart from
 * the other dtypes' so that `make -j` builds them in parallel (kernels/backward.cuh). */
#include "../backward.cuh"

cudaError_t msda_backward_launch_f16(const msda_problem *pr, cudaStream_t stream) {
    return launch_backward<__half>(pr, stream);
}
