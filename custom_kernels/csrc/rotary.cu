// Rotary position embedding of q and k in one launch (Hugging Face's apply_rotary_pos_emb with
// rotate_half), forward and backward.
//
// With x = [x1, x2] a head's two halves (D / 2 each) and c = [c1, c2], s = [s1, s2] the row's
// cos and sin (HF's cos / sin repeat their halves, but nothing here assumes it):
//   forward   y1 = x1 c1 - x2 s1,   y2 = x2 c2 + x1 s2       (x * cos + rotate_half(x) * sin)
//   backward  g1 = y1' c1 + y2' s2, g2 = y2' c2 - y1' s1     (the transpose, y' the output grad)
// The forward pass rounds as HF does in eager torch, so that bf16 / fp16 results are the same
// bits: each product is rounded to T (a product of two bf16 or fp16 values is exact in fp32, so
// rounding the fp32 product is torch's rounding), then the sum of the two rounded products is
// rounded again. The backward pass is fp32 math rounded once. __fmul_rn / __fadd_rn keep the
// compiler from contracting a product and a sum into an FMA (whose single rounding fp32 torch
// does not do).
//
// Layout: the inputs and outputs are addressed as [B, S, H, D] through their own batch, sequence
// and head strides (elements; the last dimension is unit-stride), so one kernel reads the
// pre-transpose q / k views (column slices of a merged QKV output) and writes [B, H, S, D]
// contiguous in the forward pass, and the reverse in the backward pass. Tensor "a" holds the
// first heads_a heads (q), tensor "b" the next heads_b (k); a tensor with no heads is never read.
// cos and sin are [B or 1, S, D]: a batch stride of 0 broadcasts one batch row.
//
// Grid: x covers (row = b * S + s, vector v of the first half) pairs, one per thread; y covers
// groups of HEADS heads (a grid-stride loop past 65535 groups). A thread loads its cos / sin
// vectors once and applies them to HEADS heads, whose loads are all issued before the first
// store (the pointers are __restrict__: outputs never alias inputs).
//
// Defines: DTYPE 0 fp32 / 1 fp16 / 2 bf16; VW elements per access (16 bytes when the half width,
// every stride and every pointer allow it, down to one element); BLOCK threads; HEADS heads per
// thread. Scalar parameters are 64-bit, as cuda.core packs Python ints.
#include "norm_common.cuh"

#ifndef DTYPE
#define DTYPE 2
#endif
#ifndef VW
#define VW 8
#endif
#ifndef BLOCK
#define BLOCK 128
#endif
#ifndef HEADS
#define HEADS 4
#endif

namespace rotary {

using T = typename ck::DType<DTYPE>::type;
using V = ck::Vec<T, VW>;

// x rounded to T and back: the rounding of a torch op whose result has dtype T.
__device__ __forceinline__ float round_t(float x) {
  return ck::to_float(ck::from_float<T>(x));
}

// One head's vector pair: the outputs of x1 (at p) and x2 (at p + half).
template <bool kBackward>
__device__ __forceinline__ void rotate(const V& x1, const V& x2, const V& c1, const V& c2,
                                       const V& s1, const V& s2, V& y1, V& y2) {
#pragma unroll
  for (int j = 0; j < VW; ++j) {
    const float a = ck::elem_float(x1, j), b = ck::elem_float(x2, j);
    const float cj1 = ck::elem_float(c1, j), cj2 = ck::elem_float(c2, j);
    const float sj1 = ck::elem_float(s1, j), sj2 = ck::elem_float(s2, j);
    if constexpr (kBackward) {
      y1.v[j] = ck::from_float<T>(__fadd_rn(__fmul_rn(a, cj1), __fmul_rn(b, sj2)));
      y2.v[j] = ck::from_float<T>(__fsub_rn(__fmul_rn(b, cj2), __fmul_rn(a, sj1)));
    } else {
      y1.v[j] = ck::from_float<T>(
          __fsub_rn(round_t(__fmul_rn(a, cj1)), round_t(__fmul_rn(b, sj1))));
      y2.v[j] = ck::from_float<T>(
          __fadd_rn(round_t(__fmul_rn(b, cj2)), round_t(__fmul_rn(a, sj2))));
    }
  }
}

}  // namespace rotary

using namespace rotary;

template <bool kBackward>
__global__ void __launch_bounds__(BLOCK)
rotary_kernel(const T* __restrict__ a, const T* __restrict__ b, T* __restrict__ ya,
              T* __restrict__ yb, const T* __restrict__ cos_p, const T* __restrict__ sin_p,
              long long rows, long long seq, long long half, long long heads_a,
              long long heads_b, long long a_sb, long long a_ss, long long a_sh,
              long long b_sb, long long b_ss, long long b_sh, long long ya_sb, long long ya_ss,
              long long ya_sh, long long yb_sb, long long yb_ss, long long yb_sh,
              long long c_sb, long long c_ss, long long s_sb, long long s_ss) {
  const long long vectors = half / VW;
  const long long t = static_cast<long long>(blockIdx.x) * BLOCK + threadIdx.x;
  if (t >= rows * vectors) return;
  long long row, col, bi, si;
  if (rows * vectors <= 0xffffffffLL) {  // the usual case (uniform): 32-bit divisions
    const unsigned tu = static_cast<unsigned>(t), vu = static_cast<unsigned>(vectors);
    const unsigned ru = tu / vu, su = static_cast<unsigned>(seq), bu = ru / su;
    row = ru, col = static_cast<long long>(tu - ru * vu) * VW, bi = bu, si = ru - bu * su;
  } else {
    row = t / vectors, col = (t - row * vectors) * VW, bi = row / seq, si = row - bi * seq;
  }

  V c1, c2, s1, s2;
  const T* cp = cos_p + bi * c_sb + si * c_ss + col;
  const T* sp = sin_p + bi * s_sb + si * s_ss + col;
  ck::load(c1, cp);
  ck::load(c2, cp + half);
  ck::load(s1, sp);
  ck::load(s2, sp + half);

  // This row's (b, s) offsets in each tensor; a head then adds its head stride.
  const T* in_a = a + bi * a_sb + si * a_ss + col;
  const T* in_b = b + bi * b_sb + si * b_ss + col;
  T* out_a = ya + bi * ya_sb + si * ya_ss + col;
  T* out_b = yb + bi * yb_sb + si * yb_ss + col;
  const long long heads = heads_a + heads_b;
  for (long long h0 = static_cast<long long>(blockIdx.y) * HEADS; h0 < heads;
       h0 += static_cast<long long>(gridDim.y) * HEADS) {
    V x1[HEADS], x2[HEADS];
    T* dst[HEADS];
#pragma unroll
    for (int j = 0; j < HEADS; ++j) {
      const long long h = h0 + j;
      dst[j] = nullptr;
      if (h >= heads) continue;
      const T* p;
      if (h < heads_a) {
        p = in_a + h * a_sh;
        dst[j] = out_a + h * ya_sh;
      } else {
        p = in_b + (h - heads_a) * b_sh;
        dst[j] = out_b + (h - heads_a) * yb_sh;
      }
      ck::load(x1[j], p);
      ck::load(x2[j], p + half);
    }
#pragma unroll
    for (int j = 0; j < HEADS; ++j) {
      if (dst[j] == nullptr) continue;
      V y1, y2;
      rotate<kBackward>(x1[j], x2[j], c1, c2, s1, s2, y1, y2);
      ck::store(dst[j], y1);
      ck::store(dst[j] + half, y2);
    }
  }
}
