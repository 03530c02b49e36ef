/* kernels/instances/forward_f16.cu: the forward's kernels for __half, compiled apart from the
 * other dtypes' so that `make -j` builds them in parallel (kernels/forward.cuh). */
#include "../forward.cuh"

cudaError_t msda_forward_launch_f16(const msda_problem *pr, cudaStream_t stream) {
    return launch_forward<__half>(pr, stream);
}
