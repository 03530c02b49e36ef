/* kernels/instances/backward_bf16.cu: the backward's kernels for __nv_bfloat16, compiled apart from
 * the other dtypes' so that `make -j` builds them in parallel (kernels/backward.cuh). */
#include "../backward.cuh"

cudaError_t msda_backward_launch_bf16(const msda_problem *pr, cudaStream_t stream) {
    return launch_backward<__nv_bfloat16>(pr, stream);
}
