// The per-row math of the norm kernels, shared by norms.cu (rows in registers or read again from
// global memory) and norms_staged.cu (rows in shared memory). Each helper walks this thread's
// vectors of a row (norm_layout.cuh) and reads them through accessors: callables
// `(int it, int col) -> vector`, called only where col < hidden; they hide where the row
// lives. The bounds check stays a branch per vector even where the row fills every vector:
// kernels specialised for such rows let ptxas hoist loads across vectors, and the register
// pressure made them slower (docs/measurements.md). The formulas are in norms.cu's header
// (forward) and norm_layout.cuh (backward).
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

// Forward pass 1, per vector: h = x + residual, rounded to In (the new residual, and the value
// the norm reads).
__device__ __forceinline__ void add_residual(VIn& v, const VIn& r) {
#pragma unroll
  for (int j = 0; j < kVec; ++j) v.v[j] = from_float<In>(elem_float(v, j) + elem_float(r, j));
}

// Forward pass 1, per vector: RMSNorm's running sum of h^2 (LayerNorm's statistics take their
// own pass over h in row_statistics).
__device__ __forceinline__ void accumulate_first_pass(float& s, const VIn& v) {
  if constexpr (!kLN) {
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      const float f = elem_float(v, j);
      s += f * f;
    }
  }
}

// Forward: the row's (mean, rstd). RMSNorm: from this thread's first-pass sum `s` of h^2.
// LayerNorm: one reduction of (sum of d, sum of d^2) with d = h - shift, for a `shift` that every
// thread of the row shares (the row's first element, row_shift):
//   mean = shift + E[d],   var = E[d^2] - E[d]^2.
// Against the two-pass form (the mean, then the centred second moment) it saves one reduction,
// which for a cluster is a cluster-wide barrier per row. The shift keeps E[d]^2 near the
// variance, so the subtraction does not cancel (a row's values sit within a few deviations of
// its first one).
// kRmsFromH: RMSNorm sums h^2 here from get_h and ignores `s` (the direct kernel with the row in
// registers: with the sum out of the load pass, its 16-lanes split fits 32 registers unspilled).
template <bool kRmsFromH = false, class Reducer, class GetH>
__device__ __forceinline__ float2 row_statistics(Reducer& red, float s, float shift, GetH get_h,
                                                 int hidden, int rank, int lane, float eps) {
  const float inv_n = 1.0f / static_cast<float>(hidden);
  float mean = 0.0f;
  float var;
  if constexpr (kLN) {
    float d1 = 0.0f;
    float d2 = 0.0f;
#pragma unroll
    for (int it = 0; it < kIters; ++it) {
      const int col = vec_col(it, rank, lane);
      if (col < hidden) {
        const VIn v = get_h(it, col);
#pragma unroll
        for (int j = 0; j < kVec; ++j) {
          const float d = elem_float(v, j) - shift;
          d1 += d;
          d2 += d * d;
        }
      }
    }
    const float2 t = red.sum(make_float2(d1, d2));
    const float m1 = t.x * inv_n;
    mean = shift + m1;
    var = fmaxf(t.y * inv_n - m1 * m1, 0.0f);
  } else {
    if constexpr (kRmsFromH) {
      s = 0.0f;
#pragma unroll
      for (int it = 0; it < kIters; ++it) {
        const int col = vec_col(it, rank, lane);
        if (col < hidden) accumulate_first_pass(s, get_h(it, col));
      }
    }
    var = red.sum(s) * inv_n;
  }
  return make_float2(mean, rsqrtf(var + eps));
}

// LayerNorm's shift for row_statistics: the row's first element of h (x + residual, rounded to
// In as h is), so that a row normalizes the same with its residual added here or beforehand.
__device__ __forceinline__ float row_shift(const In* xr, const In* rr) {
  if constexpr (!kLN) {
    return 0.0f;
  } else {
    const float x0 = to_float(xr[0]);
    return rr != nullptr ? to_float(from_float<In>(x0 + to_float(rr[0]))) : x0;
  }
}

// Forward output of one vector: y = (h - mean) * rstd * w (+ b); `bv` is read by LayerNorm only.
// LayerNorm takes xhat as one FMA, h * rstd + (-mean * rstd), and y as a second (xhat * w + b):
// two instructions an element where (h - mean) * rstd * w + b takes three: the long-row forward
// issues about 14 instructions an element, so the one saved shows (docs/measurements.md). The
// rounding differs from the three-instruction form by an ulp of float, far below the output's.
// RMSNorm (mean 0) keeps h * rstd * w.
__device__ __forceinline__ VOut normalize_vec(const VIn& v, const VW& wv, const VW& bv,
                                              float2 stats) {
  VOut o;
  const float neg_mean_rstd = -stats.x * stats.y;
#pragma unroll
  for (int j = 0; j < kVec; ++j) {
    float f;
    if constexpr (kLN) {
      f = fmaf(fmaf(elem_float(v, j), stats.y, neg_mean_rstd), elem_float(wv, j),
               elem_float(bv, j));
    } else {
      f = elem_float(v, j) * stats.y * elem_float(wv, j);
    }
    o.v[j] = from_float<Out>(f);
  }
  return o;
}

// Forward output of R rows of this thread (R > 1: the direct kernel's rows per thread, which
// share each weight load); rows with `active` false store nothing. get_h(i, it, col) reads
// row i's h; get_w / get_b (it, col) the weight and bias.
template <int R, class GetH, class GetW, class GetB>
__device__ __forceinline__ void write_normalized_rows(Out* const (&yr)[R], const bool (&active)[R],
                                                      GetH get_h, GetW get_w, GetB get_b,
                                                      const float2 (&stats)[R], int hidden,
                                                      int rank, int lane) {
  // Load, then use, one vector at a time. Issuing the weight (and bias) loads of several
  // vectors before their uses lost at every size: ptxas then hoists every load and the
  // registers cost occupancy (docs/measurements.md).
#pragma unroll
  for (int it = 0; it < kIters; ++it) {
    const int col = vec_col(it, rank, lane);
    if (col < hidden) {
      const VW wv = get_w(it, col);
      VW bv;
      if constexpr (kLN) bv = get_b(it, col);
#pragma unroll
      for (int i = 0; i < R; ++i) {
        if (active[i]) store_out(yr[i] + col, normalize_vec(get_h(i, it, col), wv, bv, stats[i]));
      }
    }
  }
}

// Forward output of one row.
template <class GetH, class GetW, class GetB>
__device__ __forceinline__ void write_normalized_row(Out* yr, GetH get_h, GetW get_w, GetB get_b,
                                                     float2 stats, int hidden, int rank,
                                                     int lane) {
  Out* const rows[1] = {yr};
  const bool active[1] = {true};
  const float2 row_stats[1] = {stats};
  write_normalized_rows(rows, active, [&](int, int it, int col) { return get_h(it, col); }, get_w,
                        get_b, row_stats, hidden, rank, lane);
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
        const float xhat = (elem_float(xv, j) - m) * rs;
        const float d = elem_float(dv, j);
        const float g = d * elem_float(wv, j);
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
        const float xhat = (elem_float(xv, j) - m) * rs;
        const float g = elem_float(dv, j) * elem_float(wv, j);
        float d = rs * (g - c2 - xhat * c1);
        if (has_dres) d += elem_float(rv, j);
        o.v[j] = from_float<In>(d);
      }
      store_out(dxr + col, o);
    }
  }
}
