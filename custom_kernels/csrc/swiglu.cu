// SwiGLU of a merged gate+up projection, forward and backward: each row of gu holds
// [g_0 .. g_{I-1}, u_0 .. u_{I-1}] (the output of one GEMM with weight cat([W_gate, W_up])).
//
//   forward   y = silu(g) * u,   silu(g) = g / (1 + exp(-g))
//   backward  with s = sigmoid(g) = 1 / (1 + exp(-g)):
//             dg = dy * u * s * (1 + g * (1 - s)),   du = dy * silu(g)
//
// The forward pass rounds as Hugging Face's LlamaMLP does in eager torch (act_fn(gate) * up), so
// that bf16 / fp16 results are the same bits: torch's silu kernel computes x / (1 + expf(-x))
// in fp32 and rounds to T, then the product is computed in fp32 from the rounded silu and
// rounded again (a product of two bf16 or fp16 values is exact in fp32, so the fp32 product
// rounded is torch's product). __fdiv_rn / __fadd_rn / __fmul_rn are the IEEE operations
// torch's kernels compile to (NVRTC's defaults: -prec-div=true, no flush to zero); expf is
// libdevice's, as in torch. In fp32 the rounding to T is the identity and the result is again
// torch's. The backward pass is fp32 math rounded once (HF's autograd rounds dy * u and
// silu(g) to T before using them; this is within one rounding of the fp32 gradient instead).
//
// Layout: rows of gu, dy, y and dgu are addressed through their own row strides (elements; the
// last dimension is unit-stride), so a view with strided rows is read in place. A thread owns
// one vector (VW elements) of the gate half and the matching vector of the up half: with 16-byte
// vectors a bf16 row of I = 14336 is 1792 threads, each loading 2 x 16 bytes and storing 16.
//
// Grid: a block of BLOCK threads is ROWS_PER_BLOCK rows x LANES column vectors, LANES = 1 << shift
// the smallest power of two covering a row's vectors (at most BLOCK), so that short rows still
// fill the block; x covers a row's vectors, y the row groups, looping past 65535 of them. The
// shift is a kernel argument (one cubin per dtype and access width serves every I).
//
// Defines: DTYPE 0 fp32 / 1 fp16 / 2 bf16; VEC 1 when I, every row stride and every pointer
// allow 16-byte accesses (else one element an access); BLOCK threads. Scalar parameters are
// 64-bit, as cuda.core packs Python ints.
#include "norm_common.cuh"

#ifndef DTYPE
#define DTYPE 2
#endif
#ifndef VEC
#define VEC 1
#endif
#ifndef BLOCK
#define BLOCK 256
#endif

namespace swiglu {

using T = typename ck::DType<DTYPE>::type;
constexpr int VW = VEC ? 16 / static_cast<int>(sizeof(T)) : 1;  // elements per access
using V = ck::Vec<T, VW>;

// x rounded to T and back: the rounding of a torch op whose result has dtype T.
__device__ __forceinline__ float round_t(float x) {
  return ck::to_float(ck::from_float<T>(x));
}

// 1 + exp(-g), the denominator of both silu and sigmoid (torch's formula).
__device__ __forceinline__ float one_plus_exp_neg(float g) {
  return __fadd_rn(1.0f, expf(-g));
}

// The thread's column vector and first row; the row step of the grid-stride loop.
struct Slot {
  long long col;  // first element of the vector, or -1 past the row's end
  long long row;
  long long row_step;
};

__device__ __forceinline__ Slot slot(long long inter, long long shift) {
  const long long lane = threadIdx.x & ((1LL << shift) - 1);
  const long long vector = (static_cast<long long>(blockIdx.x) << shift) + lane;
  const long long rows_per_block = BLOCK >> shift;
  Slot s;
  s.col = vector < inter / VW ? vector * VW : -1;
  s.row = static_cast<long long>(blockIdx.y) * rows_per_block + (threadIdx.x >> shift);
  s.row_step = static_cast<long long>(gridDim.y) * rows_per_block;
  return s;
}

}  // namespace swiglu

using namespace swiglu;

// y[r, c] = silu(gu[r, c]) * gu[r, I + c], rounded as eager torch (see the top).
extern "C" __global__ void __launch_bounds__(BLOCK)
swiglu_fwd_kernel(const T* __restrict__ gu, T* __restrict__ y, long long rows, long long inter,
                  long long ld_gu, long long ld_y, long long shift) {
  const Slot s = slot(inter, shift);
  if (s.col < 0) return;
  for (long long r = s.row; r < rows; r += s.row_step) {
    const T* p = gu + r * ld_gu + s.col;
    V g, u, out;
    ck::load(g, p);
    ck::load(u, p + inter);
#pragma unroll
    for (int j = 0; j < VW; ++j) {
      const float gj = ck::elem_float(g, j);
      const float act = round_t(__fdiv_rn(gj, one_plus_exp_neg(gj)));
      out.v[j] = ck::from_float<T>(__fmul_rn(act, ck::elem_float(u, j)));
    }
    ck::store(y + r * ld_y + s.col, out);
  }
}

// dgu[r, c] = dg, dgu[r, I + c] = du (see the top): fp32 math, one rounding.
extern "C" __global__ void __launch_bounds__(BLOCK)
swiglu_bwd_kernel(const T* __restrict__ dy, const T* __restrict__ gu, T* __restrict__ dgu,
                  long long rows, long long inter, long long ld_dy, long long ld_gu,
                  long long ld_dgu, long long shift) {
  const Slot s = slot(inter, shift);
  if (s.col < 0) return;
  for (long long r = s.row; r < rows; r += s.row_step) {
    const T* p = gu + r * ld_gu + s.col;
    V d, g, u, dg, du;
    ck::load(d, dy + r * ld_dy + s.col);
    ck::load(g, p);
    ck::load(u, p + inter);
#pragma unroll
    for (int j = 0; j < VW; ++j) {
      const float gj = ck::elem_float(g, j), dj = ck::elem_float(d, j);
      const float den = one_plus_exp_neg(gj);
      const float sig = __fdiv_rn(1.0f, den);
      const float act = __fdiv_rn(gj, den);
      dg.v[j] = ck::from_float<T>(dj * ck::elem_float(u, j) * sig * (1.0f + gj * (1.0f - sig)));
      du.v[j] = ck::from_float<T>(dj * act);
    }
    T* q = dgu + r * ld_dgu + s.col;
    ck::store(q, dg);
    ck::store(q + inter, du);
  }
}
