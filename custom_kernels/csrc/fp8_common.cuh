// FP8 quantization of values a kernel already holds in registers: the rule of
// custom_kernels/fp8/fp8_quant.py (and csrc/fp8_quant.cu), for the kernels that write an FP8 copy of
// their own output (the RMSNorm forward's NORM_FP8, the SwiGLU forward's FP8 kernel):
//
//   amax  = the largest |v| of a group, as the bits of |v| (sign cleared): unsigned order is
//           float order for non-negative floats and a NaN's bits sit above inf's, so an integer
//           max propagates NaN where fmaxf would drop it;
//   inv   = fp8_max / amax (IEEE division, __fdiv_rn, once a group), 1.0f where amax is 0,
//           FLT_MAX where the quotient overflows (NaN stays NaN);
//   scale = 1 / inv (IEEE, __frcp_rn): the dequantization multiplier;
//   q     = cvt.rn.satfinite(v * inv) (one rounded product): torch's cast of
//           clamp(v * inv, -fp8_max, fp8_max), bit for bit.
// A product an element, not a quotient: IEEE division is a dozen instructions, which made the
// quantization kernels issue-bound at about half of HBM bandwidth (docs/measurements.md).
//
// The FP8 type is a template parameter (3 e4m3 / 4 e5m2: custom_kernels.core.elements' codes) so
// that a file can hold this with its own -D names.
#pragma once

#include <cuda_fp8.h>

#include "norm_common.cuh"

namespace ck {

template <int FP8_CODE>
struct Fp8Type {
  static constexpr __nv_fp8_interpretation_t kKind = FP8_CODE == 4 ? __NV_E5M2 : __NV_E4M3;
  static constexpr float kMax = FP8_CODE == 4 ? 57344.0f : 448.0f;  // torch.finfo(...).max
};

__device__ __forceinline__ unsigned abs_bits(float v) { return __float_as_uint(v) & 0x7fffffffu; }

// The largest |element| of a vector, as bits.
template <class T, int N>
__device__ __forceinline__ unsigned vec_abs_max(const Vec<T, N>& v) {
  unsigned m = 0;
#pragma unroll
  for (int j = 0; j < N; ++j) m = max(m, abs_bits(elem_float(v, j)));
  return m;
}

// A group's factors: `inv` multiplies its values into FP8's range, `scale` (= 1 / inv)
// dequantizes them.
struct Fp8Factor {
  float scale;
  float inv;
};

// The factors of a group whose largest magnitude (float bits) is `amax`, with FP8 largest `top`.
__device__ __forceinline__ Fp8Factor fp8_factor_of(unsigned amax, float top) {
  const float a = __uint_as_float(amax);
  float inv = a == 0.0f ? 1.0f : __fdiv_rn(top, a);
  if (inv > 3.402823466e38f) inv = 3.402823466e38f;  // amax under top / FLT_MAX; NaN stays NaN
  return {__frcp_rn(inv), inv};
}

template <int FP8_CODE>
__device__ __forceinline__ Fp8Factor fp8_factor(unsigned amax) {
  return fp8_factor_of(amax, Fp8Type<FP8_CODE>::kMax);
}

// N values (N even) times the group's `inv`, converted two a cvt (the first in the low byte).
template <int FP8_CODE, class T, int N>
__device__ __forceinline__ Vec<unsigned char, N> fp8_quantize(const Vec<T, N>& v,
                                                              const Fp8Factor& factor) {
  static_assert(N % 2 == 0, "values are converted in pairs");
  Vec<unsigned char, N> out;
#pragma unroll
  for (int j = 0; j < N; j += 2) {
    const float2 f = make_float2(__fmul_rn(elem_float(v, j), factor.inv),
                                 __fmul_rn(elem_float(v, j + 1), factor.inv));
    const __nv_fp8x2_storage_t pair =
        __nv_cvt_float2_to_fp8x2(f, __NV_SATFINITE, Fp8Type<FP8_CODE>::kKind);
    out.v[j] = static_cast<unsigned char>(pair & 0xff);
    out.v[j + 1] = static_cast<unsigned char>(pair >> 8);
  }
  return out;
}

// The max over aligned groups of `width` consecutive lanes (a power of two, at most 32), in each
// of them; all 32 lanes of the warp take part.
__device__ __forceinline__ unsigned lanes_max(unsigned v, int width) {
  for (int off = width >> 1; off > 0; off >>= 1) v = max(v, __shfl_xor_sync(0xffffffffu, v, off));
  return v;
}

// The max over a team of `team` consecutive threads (a power of two, at most THREADS), in each;
// every thread of the block calls it (`red`: THREADS / 32 words of shared memory).
template <int THREADS>
__device__ __forceinline__ unsigned team_max(unsigned v, int team, unsigned* red) {
  v = lanes_max(v, team < 32 ? team : 32);
  if (team <= 32) return v;
  const int warp = threadIdx.x >> 5;
  __syncthreads();  // the previous call's reads are done
  if ((threadIdx.x & 31) == 0) red[warp] = v;
  __syncthreads();
  const int warps = team >> 5, first = warp & ~(warps - 1);
  v = 0;
  for (int w = 0; w < warps; ++w) v = max(v, red[first + w]);
  return v;
}

// The max of the bits of non-negative floats, for the block and cluster reducers of
// cluster_reduce.cuh (whose MaxOp, fmaxf, drops NaN): Reducer::reduce(v, AbsBitsMaxOp{}).
struct AbsBitsMaxOp {
  __device__ __forceinline__ float operator()(float a, float b) const {
    return __uint_as_float(max(__float_as_uint(a), __float_as_uint(b)));
  }
};

// combine_partials' identity for lanes without a partial (max is idempotent: a copy of the first).
template <class T>
__device__ __forceinline__ T identity_like(T first, AbsBitsMaxOp) { return first; }

}  // namespace ck
