/* kernels/instances/forward_bf16.cu: the forward's kernels for __nv_bfloat16, compiled apart from the
 * other dtypes' so that `make -j` builds them in parallel (kernels/forward.cuh). */
#include "../forward.cuh"

cudaError_t msda_forward_launch_bf16(const msda_problem *pr, cudaStream_t stream) {
    return launch_forward<__nv_bfloat16>(pr, stream);
}
