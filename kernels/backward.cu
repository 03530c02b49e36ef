/* kernels/backward.cu: the backward's entry points (msda_cuda_backward, the workspace size, the
 * device facts the route depends on) and the host helpers the dtype instances share. */
#include "backward.cuh"

// ---------------------------------------------------------------------------------------------
// kernels of the launch itself (zero_kernel: declared, with what it does, in backward_aux.cuh)

__global__ void __launch_bounds__(MSDA_ZERO_THREADS) zero_kernel(float4 *p, int64_t n16) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;");
#endif
    const float4 z = make_float4(0.f, 0.f, 0.f, 0.f);
    const int64_t stride = (int64_t)gridDim.x * MSDA_ZERO_THREADS;
    int64_t j = (int64_t)blockIdx.x * MSDA_ZERO_THREADS + threadIdx.x;
    for (; j + 3 * stride < n16; j += 4 * stride) /* four stores in flight a thread */
        p[j] = z, p[j + stride] = z, p[j + 2 * stride] = z, p[j + 3 * stride] = z;
    for (; j < n16; j += stride) p[j] = z;
}


/* Never launched: its PTX version tells which code this build runs on a device (sm90_code). */
__global__ void code_probe() {}

// ---------------------------------------------------------------------------------------------
// host helpers (declared, with what they do, in kernels/backward.cuh)

int sm_count(int device) {
    static int known[64];
    if (device < 0 || device >= 64) return 0;
    if (known[device] == 0) {
        int sms = 0;
        if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess) {
            cudaGetLastError();
            return 0;
        }
        known[device] = sms;
    }
    return known[device];
}

bool sm90_code(int device) {
    static signed char known[64]; /* 0 unknown, 1 no, 2 yes */
    if (device < 0 || device >= 64) return false;
    if (known[device] == 0) {
        DeviceGuard guard; /* the workspace query comes without one */
        cudaFuncAttributes attr;
        if (guard.select(device) != cudaSuccess ||
            cudaFuncGetAttributes(&attr, code_probe) != cudaSuccess) {
            cudaGetLastError();
            return false;
        }
        known[device] = attr.ptxVersion >= 90 ? 2 : 1;
    }
    return known[device] == 2;
}

msda_backward_plan backward_plan_of(const msda_problem *pr) {
    const bool sm90 = sm90_code(pr->device);
    /* with MSDA_ROUTE_F32_WORKSPACE the kernels write the workspace instead of grad_value */
    const void *written = msda_backward_f32_workspace(pr, sm90) ? pr->workspace : pr->grad_value;
    msda_backward_plan plan;
    msda_plan_backward(pr, aligned16(pr->value) && aligned16(pr->grad_output) && aligned16(written),
                       sm_count(pr->device), sm90, &plan);
    return plan;
}

cudaError_t memset_grad_value(const msda_problem *pr, int64_t bytes, cudaStream_t stream) {
    if (bytes <= 0 || !pr->grad_value) return cudaSuccess;
    return cudaMemsetAsync(pr->grad_value, 0, (size_t)bytes, stream);
}

cudaError_t zero_then_launch(void (*kernel)(msda_problem), dim3 grid, int threads, int64_t bytes,
                             const msda_problem *pr, cudaStream_t stream) {
    bool pdl = false;
    if (bytes > 0 && pr->grad_value) {
        const int sms = sm_count(pr->device);
        if (bytes % 16 == 0 && aligned16(pr->grad_value) && sms > 0 && sm90_code(pr->device)) {
            const int64_t n16 = bytes / 16, want = (n16 + MSDA_ZERO_THREADS - 1) / MSDA_ZERO_THREADS;
            zero_kernel<<<(unsigned int)(want < sms ? want : sms), MSDA_ZERO_THREADS, 0,
                          stream>>>((float4 *)pr->grad_value, n16);
            pdl = true;
        } else {
            const cudaError_t e = memset_grad_value(pr, bytes, stream);
            if (e != cudaSuccess) return e;
        }
    }
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = grid;
    cfg.blockDim = dim3(threads);
    cfg.stream = stream;
    cfg.attrs = attr;
    cfg.numAttrs = pdl ? 1 : 0;
    return cudaLaunchKernelEx(&cfg, kernel, *pr);
}

// ---------------------------------------------------------------------------------------------
// entry points

#define LAUNCHER_OF(code, suffix, ...) MSDA_CAT(msda_backward_launch, suffix),

extern "C" int msda_cuda_backward(const msda_problem *pr) {
    static const msda_launcher by_dtype[MSDA_DTYPE_COUNT] = {MSDA_DTYPES(LAUNCHER_OF)};
    return run_launcher("msda_backward", pr, by_dtype);
}

extern "C" int64_t msda_cuda_workspace_size(const msda_problem *pr) {
    /* MSDA_DETERMINISTIC: the header, then one 64-bit fixed-point accumulator per grad_value
     * element; MSDA_ROUTE_F32_WORKSPACE: the f32 accumulation buffer (asked with a stand-in for
     * grad_value: the callers size the workspace of a call that wants it) */
    const int64_t n_value = pr->B * pr->S * pr->H * pr->C;
    if (pr->flags & MSDA_DETERMINISTIC) return MSDA_DET_HEADER_BYTES + n_value * 8;
    msda_problem wanted = *pr;
    static char stand_in;
    wanted.grad_value = &stand_in;
    return msda_backward_f32_workspace(&wanted, sm90_code(pr->device)) ? n_value * 4 : 0;
}

extern "C" int msda_cuda_device_facts(int device, int *multiprocessors, int *sm90) {
    static const char fn[] = "msda_backward_route";
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess || device < 0 || device >= count) {
        cudaGetLastError();
        return msda_set_error(MSDA_ERR_INVALID_ARGUMENT, "%s: no CUDA device %d (%d visible)", fn,
                              device, count);
    }
    *multiprocessors = sm_count(device);
    *sm90 = sm90_code(device);
    return MSDA_OK;
}
