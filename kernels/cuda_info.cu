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

extern "C" const char *msda_cuda_arch_list(void) { return MSDA_CUDA_ARCHS; }

extern "C" int msda_cuda_toolkit_version(void) { return CUDART_VERSION; }
