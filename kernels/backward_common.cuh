/* kernels/backward_common.cuh: how the backward kernels add into grad_value.
 * f32 sums: 16-byte (8-byte for 2 channels) vector atomics on sm_90 and newer, scalar ones
 * before. Half types: on sm_90 and newer red.global.add.noftz.v4/v2 of packed f16x2 / bf16x2
 * pairs straight into the half-precision grad_value (each f32 sum rounded once as it is added),
 * whatever the points' dtype; older code adds into an f32 workspace that a last kernel converts
 * (c/routes.c, MSDA_ROUTE_F32_WORKSPACE); each half type's pair packing and reduction are in
 * c/dtypes.h. Also the programmatic-dependent-launch wait and the launch bound of the per-point
 * and aggregated kernels. */
#pragma once

#include <type_traits>

#include "deterministic.cuh"
#include "staging.cuh"

/* Half-precision grad_value accumulated in its own type where the code is built for sm_90 or
 * newer, which has vector reductions of packed f16x2 / bf16x2 (red.global.add.noftz.v2 / .v4):
 * N f32 sums, each rounded once, go to N consecutive channels with one 8- or 16-byte
 * reduction. Older code accumulates in an f32 buffer (the workspace) that a last kernel
 * converts. The host asks which code runs on a device with sm90_code(). */
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define MSDA_NATIVE_HALF 1
#else
#define MSDA_NATIVE_HALF 0
#endif
/* DET sums in fixed point whatever the type (its convert kernel writes grad_value) */
template <typename T, bool DET> struct NativeHalf {
    static constexpr bool value = MSDA_NATIVE_HALF && !DET && IsHalf<T>::value;
};
template <typename T, int N> __device__ __forceinline__ void red_half(T *p, const float (&v)[N]) {
    static_assert(N == 4 || N == 8, "4 or 8 channels");
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    unsigned w[N / 2];
#pragma unroll
    for (int i = 0; i < N / 2; i++) w[i] = pack2(p, v[2 * i], v[2 * i + 1]);
    red_pairs(p, w); /* the type's pair reduction: c/dtypes.h */
#else
    (void)p, (void)v; /* not compiled in: NativeHalf is false before sm_90 */
#endif
}

/* Programmatic dependent launch (sm_90 and newer): the aggregated backward is launched as
 * a dependent of zero_kernel, which zeroes grad_value, so its blocks start their first chunk
 * (staging, filing, sort) while grad_value is being zeroed; griddepcontrol.wait, before the
 * first scatter, holds them until zero_kernel has finished and its stores are visible. In code
 * built for older architectures the wait is compiled out and the host uses cudaMemsetAsync. */
__device__ __forceinline__ void grid_dep_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}


template <int V> __device__ __forceinline__ void atomic_add_vec(float *p, const float (&v)[V]) {
    if constexpr (V == 2) { /* 8 bytes */
#if __CUDA_ARCH__ >= 900
        atomicAdd(reinterpret_cast<float2 *>(p), make_float2(v[0], v[1]));
#else
        atomicAdd(p, v[0]), atomicAdd(p + 1, v[1]);
#endif
    } else {
#pragma unroll
        for (int j = 0; j < V; j += 4) {
#if __CUDA_ARCH__ >= 900
            atomicAdd(reinterpret_cast<float4 *>(p + j), make_float4(v[j], v[j + 1], v[j + 2], v[j + 3]));
#else
            atomicAdd(p + j, v[j]), atomicAdd(p + j + 1, v[j + 1]);
            atomicAdd(p + j + 2, v[j + 2]), atomicAdd(p + j + 3, v[j + 3]);
#endif
        }
    }
}

/* 4 channels per thread for every type: one 16-byte f32 vector atomic per corner, the pieces of
 * a group contiguous (8 half channels per thread left a warp's atomics half-filling twice as many
 * sectors); plain f32 decoders with unsliced points 2 (VV = 2, G = C / 2: 8-byte loads and
 * atomics, twice the warps), their point loop software-pipelined (PIPE: each point's
 * gathers issued one point ahead), as is that of plain bf16 decoders. 5 blocks per
 * multiprocessor: the register cap costs no spills (sm_75 holds 4). */
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
#define MSDA_BWD_MIN_BLOCKS 4
#else
#define MSDA_BWD_MIN_BLOCKS 5
#endif
