/* kernels/instances/forward.cu: the forward's kernels (kernels/forward.cuh) for one dtype, the row of
 * c/dtypes.h whose suffix the Makefile passes as MSDA_INSTANCE: one object per row
 * (build/instances/forward_f32.o, ...), so that `make -j` compiles the dtypes in parallel and a
 * new row needs no file here. */
#include "../forward.cuh"

#ifndef MSDA_INSTANCE
#error "compile with -DMSDA_INSTANCE=<a suffix of c/dtypes.h> (the Makefile does)"
#endif

cudaError_t MSDA_CAT(msda_forward_launch, MSDA_INSTANCE)(const msda_problem *pr, cudaStream_t stream) {
    return launch_forward<MSDA_CAT(msda_cuda_type, MSDA_INSTANCE)>(pr, stream);
}
