/* c/cuda_stub.c: the CUDA half of the library in a CPU-only build (no nvcc, or MSDA_CUDA=0).
 * Linked instead of the kernels/ objects so the entry points are the same in every build. */
#include "msda_internal.h"

int msda_cuda_built(void) { return 0; }
int msda_cuda_devices(void) { return 0; }
int msda_cuda_kernels_run_on(int device) {
    (void)device;
    msda_set_error(MSDA_ERR_UNSUPPORTED, "msda_cuda_runs_on: this build has no CUDA kernels");
    return 0;
}
const char *msda_cuda_arch_list(void) { return ""; }
int msda_cuda_toolkit_version(void) { return 0; }

int msda_cuda_forward(const msda_problem *pr) {
    (void)pr;
    return msda_set_error(MSDA_ERR_UNSUPPORTED, "msda_forward: this build has no CUDA kernels");
}

int msda_cuda_backward(const msda_problem *pr) {
    (void)pr;
    return msda_set_error(MSDA_ERR_UNSUPPORTED, "msda_backward: this build has no CUDA kernels");
}

int64_t msda_cuda_workspace_size(const msda_problem *pr) {
    (void)pr;
    return 0;
}

int msda_cuda_level_starts(int64_t L, int64_t S, int index_dtype, int device,
                           const void *spatial_shapes, void *level_start_index, void *stream) {
    (void)L, (void)S, (void)index_dtype, (void)device, (void)spatial_shapes;
    (void)level_start_index, (void)stream;
    return msda_set_error(MSDA_ERR_UNSUPPORTED, "msda_level_starts: this build has no CUDA "
                          "kernels");
}

int msda_cuda_device_facts(int device, int *multiprocessors, int *sm90_code) {
    (void)device, (void)multiprocessors, (void)sm90_code;
    return msda_set_error(MSDA_ERR_UNSUPPORTED, "msda_backward_route: this build has no CUDA "
                          "kernels to ask a device (give multiprocessors and sm90_code)");
}
