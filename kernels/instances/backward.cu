/* kernels/instances/backward.cu: the backward's kernels (kernels/backward.cuh) for one dtype, the row of
 * c/dtypes.h whose suffix the Makefile passes as MSDA_INSTANCE: one object per row
 * (build/instances/backward_f32.o, ...), so that `make -j` compiles the dtypes in parallel and a
 * new row needs no file here. */
#include "../backward.cuh"

#ifndef MSDA_INSTANCE
#error "compile with -DMSDA_INSTANCE=<a suffix of c/dtypes.h> (the Makefile does)"
#endif

cudaError_t MSDA_CAT(msda_backward_launch, MSDA_INSTANCE)(const msda_problem *pr, cudaStream_t stream) {
    return launch_backward<MSDA_CAT(msda_cuda_type, MSDA_INSTANCE)>(pr, stream);
}
