/* kernels/backward_aux.cuh: the backward's small kernels: zero_kernel (grad_value = 0 by a
 * grid resident at once, letting the aggregated or sliced kernel start as its programmatic
 * dependent), MSDA_DETERMINISTIC's scan (the scale's maxima) and convert (fixed point to
 * grad_value), and the f32-workspace conversion of a half grad_value. Grid-stride, 64-bit. */
#pragma once

#include "backward_common.cuh"

/* grad_value = 0, 16 bytes a store, by a grid resident at once whose blocks let the dependent
 * kernel launch at their start. MSDA_ZERO_THREADS threads a block, one block a multiprocessor:
 * small enough to sit beside the 5 blocks of the aggregated kernel (their registers leave
 * 4096 free), so that kernel runs at full occupancy while the zeroing goes on. */
#define MSDA_ZERO_THREADS 64
__global__ void __launch_bounds__(MSDA_ZERO_THREADS) zero_kernel(float4 *p, int64_t n16);

/* MSDA_DETERMINISTIC, step 1: header maxima of |grad_output| and |A| (deterministic.cuh), as
 * doubles compared by their bits (monotone for values >= 0; a NaN compares above +Inf). */
template <typename T>
__global__ void __launch_bounds__(MSDA_BLOCK_THREADS) det_scan_kernel(msda_problem pr) {
    const T *gout = (const T *)pr.grad_output;
    const PointTensor<T> attn(pr.attention_weights, pr);
    DetHeader *hd = (DetHeader *)pr.workspace;
    const int64_t n_g = pr.B * pr.Q * pr.H * pr.C, n_a = pr.B * pr.Q * pr.H * pr.NP;
    double mg = 0.0, ma = 0.0;
    const int64_t stride = (int64_t)gridDim.x * blockDim.x;
    for (int64_t j = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; j < n_g; j += stride) {
        const double v = fabs((double)to_acc(gout[j]));
        mg = (v > mg || v != v) ? v : mg;
    }
    for (int64_t j = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; j < n_a; j += stride) {
        const double v = fabs((double)to_acc(attn[j]));
        ma = (v > ma || v != v) ? v : ma;
    }
    unsigned long long bg = (unsigned long long)__double_as_longlong(mg);
    unsigned long long ba = (unsigned long long)__double_as_longlong(ma);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const unsigned long long og = __shfl_xor_sync(0xffffffffu, bg, o);
        const unsigned long long oa = __shfl_xor_sync(0xffffffffu, ba, o);
        bg = og > bg ? og : bg;
        ba = oa > ba ? oa : ba;
    }
    if ((threadIdx.x & 31) == 0) {
        atomicMax(&hd->max_g, bg);
        atomicMax(&hd->max_a, ba);
    }
}

/* MSDA_DETERMINISTIC, last step: grad_value = accumulator / scale (NaN if the scale is 0), in
 * T (half types: through f32, the accumulation type). */
template <typename T>
__global__ void __launch_bounds__(MSDA_BLOCK_THREADS) det_convert_kernel(msda_problem pr) {
    typedef typename AccOf<T>::type Acc;
    const long long *det_acc = (const long long *)((const char *)pr.workspace + MSDA_DET_HEADER_BYTES);
    T *grad_value = (T *)pr.grad_value;
    const double scale = det_scale(pr, (const DetHeader *)pr.workspace);
    const double inv = scale > 0.0 ? 1.0 / scale : __longlong_as_double(0x7ff8000000000000LL);
    const int64_t n = pr.B * pr.S * pr.H * pr.C;
    const int64_t stride = (int64_t)gridDim.x * blockDim.x;
    for (int64_t j = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; j < n; j += stride)
        grad_value[j] = from_acc<T>((Acc)((double)det_acc[j] * inv)); /* scale: a power of two */
}

/* Half types without NativeHalf, last step: grad_value (T) = the f32 buffer in the workspace,
 * 8 elements a step (two 16-byte loads, one 16-byte store) where both are 16-byte aligned. */
template <typename T>
__global__ void __launch_bounds__(MSDA_BLOCK_THREADS) half_convert_kernel(msda_problem pr) {
    const float *acc = (const float *)pr.workspace;
    T *grad_value = (T *)pr.grad_value;
    const int64_t n = pr.B * pr.S * pr.H * pr.C;
    const int64_t stride = (int64_t)gridDim.x * blockDim.x;
    const int64_t n8 = (((uintptr_t)acc | (uintptr_t)grad_value) & 15) ? 0 : n / 8;
    for (int64_t j = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; j < n8; j += stride) {
        const float4 a = reinterpret_cast<const float4 *>(acc)[2 * j];
        const float4 b = reinterpret_cast<const float4 *>(acc)[2 * j + 1];
        reinterpret_cast<uint4 *>(grad_value)[j] =
            make_uint4(pack2(grad_value, a.x, a.y), pack2(grad_value, a.z, a.w),
                       pack2(grad_value, b.x, b.y), pack2(grad_value, b.z, b.w));
    }
    for (int64_t j = n8 * 8 + (int64_t)blockIdx.x * blockDim.x + threadIdx.x; j < n; j += stride)
        grad_value[j] = from_acc<T>(acc[j]);
}
