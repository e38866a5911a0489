// The per-row math of the norm kernels, shared by norms.cu (rows in registers or read again from
// global memory) and norms_staged.cu (rows in shared memory). Each helper walks this thread's
// vectors of a row (norm_layout.cuh) and reads them through accessors: callables
// `(int it, int col) -> vector`, called only where col < hidden, which hide where the row lives.
// The formulas are in norms.cu's header (forward) and norm_layout.cuh (backward).
#pragma once

#include "norm_layout.cuh"

// 1: outputs are written with st.global.cs (evict-first: nothing reads them again soon).
#ifndef NORM_STORE_CS
#define NORM_STORE_CS 0
#endif

template <class T, int N>
__device__ __forceinline__ void store_out(T* p, const Vec<T, N>& v) {
  if constexpr (NORM_STORE_CS != 0 && sizeof(v) % 16 == 0) {
#pragma unroll
    for (int i = 0; i < static_cast<int>(sizeof(v)) / 16; ++i)
      __stcs(reinterpret_cast<uint4*>(p) + i, reinterpret_cast<const uint4*>(v.v)[i]);
  } else {
    store(p, v);
  }
}

// Forward: the row's (mean, rstd) from this thread's first-pass sum `s` (of h for LayerNorm, of
// h^2 for RMSNorm; mean 0 for RMSNorm). LayerNorm reads h again for the centred second moment.
template <class Reducer, class GetH>
__device__ __forceinline__ float2 row_statistics(Reducer& red, float s, GetH get_h, int hidden,
                                                 int rank, int lane, float eps) {
  const float inv_n = 1.0f / static_cast<float>(hidden);
  float mean = 0.0f;
  float var;
  if constexpr (kLN) {
    mean = red.sum(s) * inv_n;
    float s2 = 0.0f;
#pragma unroll
    for (int it = 0; it < kIters; ++it) {
      const int col = vec_col(it, rank, lane);
      if (col < hidden) {
        const VIn v = get_h(it, col);
#pragma unroll
        for (int j = 0; j < kVec; ++j) {
          const float d = to_float(v.v[j]) - mean;
          s2 += d * d;
        }
      }
    }
    var = red.sum(s2) * inv_n;
  } else {
    var = red.sum(s) * inv_n;
  }
  return make_float2(mean, rsqrtf(var + eps));
}

// Forward output: y = (h - mean) * rstd * w (+ b).
template <class GetH, class GetW, class GetB>
__device__ __forceinline__ void write_normalized_row(Out* yr, GetH get_h, GetW get_w, GetB get_b,
                                                     float2 stats, int hidden, int rank,
                                                     int lane) {
#pragma unroll
  for (int it = 0; it < kIters; ++it) {
    const int col = vec_col(it, rank, lane);
    if (col < hidden) {
      const VIn v = get_h(it, col);
      const VW wv = get_w(it, col);
      VW bv;
      if constexpr (kLN) bv = get_b(it, col);
      VOut o;
#pragma unroll
      for (int j = 0; j < kVec; ++j) {
        float f = (to_float(v.v[j]) - stats.x) * stats.y * to_float(wv.v[j]);
        if constexpr (kLN) f += to_float(bv.v[j]);
        o.v[j] = from_float<Out>(f);
      }
      store_out(yr + col, o);
    }
  }
}

// Backward pass 1: adds dy * xhat (and dy) to the dW (dB) accumulators and returns this thread's
// sums of g * xhat and of g (g = dy * w).
template <class GetX, class GetDy, class GetW>
__device__ __forceinline__ float2 accumulate_row(float (&acc)[kAccRows][kIters][kVec], GetX get_x,
                                                 GetDy get_dy, GetW get_w, float m, float rs,
                                                 int hidden, int rank, int lane) {
  float s1 = 0.0f, s2 = 0.0f;
#pragma unroll
  for (int it = 0; it < kIters; ++it) {
    const int col = vec_col(it, rank, lane);
    if (col < hidden) {
      const VIn xv = get_x(it, col);
      const VOut dv = get_dy(it, col);
      const VW wv = get_w(it, col);
#pragma unroll
      for (int j = 0; j < kVec; ++j) {
        const float xhat = (to_float(xv.v[j]) - m) * rs;
        const float d = to_float(dv.v[j]);
        const float g = d * to_float(wv.v[j]);
        s1 += g * xhat;
        s2 += g;
        acc[0][it][j] += d * xhat;
        if constexpr (kLN) acc[kAccRows - 1][it][j] += d;
      }
    }
  }
  return make_float2(s1, s2);
}

// Backward pass 2: dx = rstd * (g - c2 - xhat * c1) (+ the residual's gradient), c1 and c2 the
// row means of g * xhat and g.
template <class GetX, class GetDy, class GetW, class GetDres>
__device__ __forceinline__ void write_dx_row(In* dxr, GetX get_x, GetDy get_dy, GetW get_w,
                                             bool has_dres, GetDres get_dres, float m, float rs,
                                             float c1, float c2, int hidden, int rank, int lane) {
#pragma unroll
  for (int it = 0; it < kIters; ++it) {
    const int col = vec_col(it, rank, lane);
    if (col < hidden) {
      const VIn xv = get_x(it, col);
      const VOut dv = get_dy(it, col);
      const VW wv = get_w(it, col);
      VIn rv;
      if (has_dres) rv = get_dres(it, col);
      VIn o;
#pragma unroll
      for (int j = 0; j < kVec; ++j) {
        const float xhat = (to_float(xv.v[j]) - m) * rs;
        const float g = to_float(dv.v[j]) * to_float(wv.v[j]);
        float d = rs * (g - c2 - xhat * c1);
        if (has_dres) d += to_float(rv.v[j]);
        o.v[j] = from_float<In>(d);
      }
      store_out(dxr + col, o);
    }
  }
}
