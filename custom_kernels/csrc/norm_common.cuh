// Element types chosen by integer codes (0 float, 1 half, 2 bfloat16), conversions through
// float, and fixed-size vectors loaded and stored with the widest access their alignment allows
// (16 bytes when the vector is a multiple of 16 bytes).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace ck {

template <int CODE>
struct DType;
template <>
struct DType<0> { using type = float; };
template <>
struct DType<1> { using type = __half; };
template <>
struct DType<2> { using type = __nv_bfloat16; };

template <bool B, class T, class F>
struct Conditional { using type = T; };
template <class T, class F>
struct Conditional<false, T, F> { using type = F; };

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }

template <class T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ float from_float<float>(float v) { return v; }
template <>
__device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}

template <class T, int N>
struct alignas((sizeof(T) * N) >= 16 ? 16 : sizeof(T) * N) Vec {
  T v[N];
};

// Element j of a vector as float. bfloat16 pairs are read as 32-bit words and widened with one
// shift or mask each: cvt.f32.bf16 of a 16-bit half costs ptxas a PRMT and a SHF for every high
// half, and LayerNorm's long-row forward unpacks three operands per element (x, w, b).
template <class T, int N>
__device__ __forceinline__ float elem_float(const Vec<T, N>& v, int j) {
  return to_float(v.v[j]);
}

template <int N>
__device__ __forceinline__ float elem_float(const Vec<__nv_bfloat16, N>& v, int j) {
  if constexpr (N % 2 == 0 && alignof(Vec<__nv_bfloat16, N>) >= 4) {
    const unsigned word = reinterpret_cast<const unsigned*>(v.v)[j / 2];
    return __uint_as_float(j % 2 ? (word & 0xffff0000u) : (word << 16));
  } else {
    return to_float(v.v[j]);
  }
}

// `p` must be aligned to alignof(Vec<T, N>).
template <class T, int N>
__device__ __forceinline__ void load(Vec<T, N>& d, const T* p) {
  constexpr int kBytes = sizeof(T) * N;
  if constexpr (kBytes % 16 == 0) {
#pragma unroll
    for (int i = 0; i < kBytes / 16; ++i)
      reinterpret_cast<uint4*>(d.v)[i] = reinterpret_cast<const uint4*>(p)[i];
  } else if constexpr (kBytes == 8) {
    *reinterpret_cast<uint2*>(d.v) = *reinterpret_cast<const uint2*>(p);
  } else if constexpr (kBytes == 4) {
    *reinterpret_cast<unsigned*>(d.v) = *reinterpret_cast<const unsigned*>(p);
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i) d.v[i] = p[i];
  }
}

template <class T, int N>
__device__ __forceinline__ void store(T* p, const Vec<T, N>& s) {
  constexpr int kBytes = sizeof(T) * N;
  if constexpr (kBytes % 16 == 0) {
#pragma unroll
    for (int i = 0; i < kBytes / 16; ++i)
      reinterpret_cast<uint4*>(p)[i] = reinterpret_cast<const uint4*>(s.v)[i];
  } else if constexpr (kBytes == 8) {
    *reinterpret_cast<uint2*>(p) = *reinterpret_cast<const uint2*>(s.v);
  } else if constexpr (kBytes == 4) {
    *reinterpret_cast<unsigned*>(p) = *reinterpret_cast<const unsigned*>(s.v);
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i) p[i] = s.v[i];
  }
}

}  // namespace ck
