/* c/ort_cuda.c: the CUDA execution provider's kernel of ONNX Runtime's op MSDeformAttn
 * (c/ort_op.c says the op). Registered only in a library with CUDA kernels, and only while
 * MSDA_ORT_CUDA_EP (c/ort_op.h) is 1: this file and that switch are the whole GPU path.
 * The inputs are checked as on the CPU, but only by what the runtime says of them (types, ranks,
 * sizes): their contents live on the GPU, and reading them on the host would synchronise the
 * stream at every call. Tables that disagree with value still read nothing outside it (the
 * kernels bounds-check every gather, c/msda.h), and a NaN location adds nothing there.
 * The kernels run on the runtime's stream for this node (KernelContext_GetGPUComputeStream) on
 * the device holding value; the library selects that device for the launch and restores the
 * caller's, allocates nothing and never synchronises. */
#include "ort_op.h"

#if MSDA_ORT_CUDA_EP

OrtStatus *msda_ort_compute_cuda(const msda_ort_kernel *k, OrtKernelContext *context) {
    const OrtApi *api = k->api;
    msda_args args;
    OrtStatus *st = msda_ort_prepare(k, context, &args);
    if (st) return st;
    const OrtValue *value = NULL;
    const OrtMemoryInfo *memory = NULL;
    int device = -1;
    void *stream = NULL;
    if ((st = ORT(api, KernelContext_GetInput)(context, 0, &value)) ||
        (st = ORT(api, GetTensorMemoryInfo)(value, &memory)) ||
        (st = ORT(api, MemoryInfoGetId)(memory, &device)) ||
        (st = ORT(api, KernelContext_GetGPUComputeStream)(context, &stream)))
        return st;
    args.device = device;
    args.stream = stream;
    if (msda_forward(&args) != MSDA_OK)
        return msda_ort_error(api, MSDA_ORT_FAIL, "%s", msda_last_error());
    return NULL;
}

#endif
