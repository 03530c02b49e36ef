/* kernels/backward_agg_rows.cuh: a walker's sums over one row segment, the walk phase of the
 * aggregated backward (kernels/backward_agg.cuh): RowSums (f32 sums, one vector atomic or
 * half-precision reduction a half row) and DetRowSums (MSDA_DETERMINISTIC's fixed point). */
#pragma once

#include "backward_common.cuh"

/* A walker's sums over one row segment (agg_walk): load() reads the lane's 8 value channels of
 * the row (zeros where !on), step() adds slot `il`'s item with coefficient cf and returns the
 * lane's part of grad_output . row, flush() adds the sums to grad_value.
 * RowSums: lane `part` owns channels part * 8 .. + 7 in two 4-channel halves, summed in f32
 * apart and then added, so the point gradients have the same bits whichever half a walker
 * takes first (odd walkers take them in the other order, so that the two walkers of a quarter
 * warp read s_go from different banks; which walker gets a row varies from run to run); one
 * 16-byte atomic per half, or one half-precision vector reduction. s_go is indexed as float4s
 * of the shared array itself (a generic pointer into it had the compiler recompute shared
 * addresses in every step of the walk). */
template <typename T, int G, bool NATIVE> struct RowSums {
    int odd, h0, h1, q0, q1;
    float v[8], a0[4], a1[4];
    __device__ __forceinline__ RowSums(int walker, int part, long long *, float)
        : odd(walker & 1), h0(part * 8 + (walker & 1) * 4), h1(part * 8 + 4 - (walker & 1) * 4),
          q0(h0 >> 2), q1(h1 >> 2) {}
    __device__ __forceinline__ void load(const msda_problem &pr, int key, bool on) {
        if (on) {
            float u[8];
            load_vec8((const T *)pr.value + (unsigned)key + (h0 & ~7), u);
#pragma unroll
            for (int q = 0; q < 4; q++) {
                v[q] = odd ? u[q + 4] : u[q];
                v[q + 4] = odd ? u[q] : u[q + 4];
            }
        }
#pragma unroll
        for (int q = 0; q < 4; q++) a0[q] = a1[q] = 0.f;
    }
    template <int N>
    __device__ __forceinline__ float step(const float4 (&s_go)[N], int il, float cf, bool gv,
                                          bool dots) {
        const float4 g0 = s_go[il * G + q0];
        const float4 g1 = s_go[il * G + q1];
        if (gv) {
            a0[0] += cf * g0.x, a0[1] += cf * g0.y, a0[2] += cf * g0.z, a0[3] += cf * g0.w;
            a1[0] += cf * g1.x, a1[1] += cf * g1.y, a1[2] += cf * g1.z, a1[3] += cf * g1.w;
        }
        if (!dots) return 0.f;
        const float d0 = g0.x * v[0] + g0.y * v[1] + g0.z * v[2] + g0.w * v[3];
        const float d1 = g1.x * v[4] + g1.y * v[5] + g1.z * v[6] + g1.w * v[7];
        return d0 + d1;
    }
    __device__ __forceinline__ void flush(const msda_problem &pr, int key) {
        if constexpr (NATIVE) {
            float a8[8]; /* the lane's 8 channels in order: odd walkers hold them swapped */
#pragma unroll
            for (int q = 0; q < 4; q++) {
                a8[q] = odd ? a1[q] : a0[q];
                a8[q + 4] = odd ? a0[q] : a1[q];
            }
            red_half<T, 8>((T *)pr.grad_value + (unsigned)key + (h0 & ~7), a8);
        } else {
            atomic_add_vec<4>((float *)pr.grad_value + (unsigned)key + h0, a0);
            atomic_add_vec<4>((float *)pr.grad_value + (unsigned)key + h1, a1);
        }
    }
};

/* DetRowSums (MSDA_DETERMINISTIC): lane `part` owns channels part + WG * q, so each of its 8
 * integer atomics covers WG consecutive words (whole sectors). Each contribution is rounded to
 * the fixed point on its own, as msda_backward_fast rounds them, so the integer sum is exact
 * and grad_value has the same bits as there. */
template <typename T, int G> struct DetRowSums {
    static constexpr int WG = G / 2;
    long long *acc_row;
    float scale;
    int part;
    float v[8];
    long long acc[8];
    __device__ __forceinline__ DetRowSums(int, int part_, long long *det_acc, float scale_)
        : acc_row(det_acc), scale(scale_), part(part_) {}
    __device__ __forceinline__ void load(const msda_problem &pr, int key, bool on) {
        const T *value = (const T *)pr.value;
#pragma unroll
        for (int q = 0; q < 8; q++) {
            v[q] = on ? to_acc(value[key + part + WG * q]) : 0.f;
            acc[q] = 0;
        }
    }
    template <int N>
    __device__ __forceinline__ float step(const float4 (&s_go)[N], int il, float cf, bool gv,
                                          bool) {
        const float *gi = reinterpret_cast<const float *>(s_go) + il * (4 * G) + part;
        float d = 0.f;
#pragma unroll
        for (int q = 0; q < 8; q++) {
            const float gq = gi[WG * q];
            if (gv) acc[q] += llrintf(cf * gq * scale);
            d += gq * v[q];
        }
        return d;
    }
    __device__ __forceinline__ void flush(const msda_problem &, int key) {
#pragma unroll
        for (int q = 0; q < 8; q++)
            if (acc[q] != 0)
                atomicAdd((unsigned long long *)(acc_row + key + part + WG * q),
                          (unsigned long long)acc[q]);
    }
};
