/* kernels/cuda_info.cu: what the CUDA half of the library can tell about itself. */
#include "common.cuh"

#ifndef MSDA_CUDA_ARCHS
#define MSDA_CUDA_ARCHS "unknown"
#endif

extern "C" int msda_cuda_built(void) { return 1; }

/* 0 when no driver is installed or no device is visible: a query, never an error. */
extern "C" int msda_cuda_devices(void) {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
        cudaGetLastError();
        return 0;
    }
    return n;
}

/* Never launched: whether the runtime finds code of it for a device says whether this build's
 * kernels run there (they are all compiled for the same targets). */
__global__ void runs_on_probe() {}

extern "C" int msda_cuda_kernels_run_on(int device) {
    static const char fn[] = "msda_cuda_runs_on";
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess || device < 0 || device >= count) {
        cudaGetLastError();
        msda_set_error(MSDA_ERR_INVALID_ARGUMENT, "%s: no CUDA device %d (%d visible)", fn,
                       device, count);
        return 0;
    }
    DeviceGuard guard;
    cudaFuncAttributes attr;
    cudaError_t e = guard.select(device);
    if (e == cudaSuccess) e = cudaFuncGetAttributes(&attr, runs_on_probe);
    if (e != cudaSuccess) {
        cudaGetLastError();
        msda_set_error(MSDA_ERR_UNSUPPORTED, "%s: the kernels (%s) cannot run on CUDA device %d: "
                       "%s (%s)", fn, MSDA_CUDA_ARCHS, device, cudaGetErrorName(e),
                       cudaGetErrorString(e));
        return 0;
    }
    return 1;
}

extern "C" const char *msda_cuda_arch_list(void) { return MSDA_CUDA_ARCHS; }

extern "C" int msda_cuda_toolkit_version(void) { return CUDART_VERSION; }
