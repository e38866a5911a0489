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
// AMAX 1 (tensorwise FP8, issue 38): the forward and backward kernels also reduce the largest
// |value| they write (the rounded outputs: y, or both halves of dgu) into *amax, the float's bits
// atomicMax'ed into a word the host zeroed: fp8_quant.tensor_amax of the output, bit for bit, so
// that its FP8 quantization skips a pass of its own over the output. One atomic a block (the
// host caps the grid; the row loop covers the rest). AMAX 0 builds ignore `amax`.
//
// Defines: DTYPE 0 fp32 / 1 fp16 / 2 bf16; VEC 1 when I, every row stride and every pointer
// allow 16-byte accesses (else one element an access); BLOCK threads; AMAX. Scalar parameters
// are 64-bit, as cuda.core packs Python ints.
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
#ifndef AMAX
#define AMAX 0
#endif
#if AMAX
#include "fp8_common.cuh"
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

// The block's largest |value| (float bits) into *amax; every thread of the block calls it.
__device__ __forceinline__ void block_amax(unsigned m, unsigned* amax) {
#if AMAX
  __shared__ unsigned red[BLOCK / 32];
  m = ck::team_max<BLOCK>(m, BLOCK, red);
  if (threadIdx.x == 0 && m != 0) atomicMax(amax, m);
#endif
}

template <int N>
__device__ __forceinline__ unsigned abs_max_if_amax(unsigned m, const ck::Vec<T, N>& v) {
#if AMAX
  return max(m, ck::vec_abs_max(v));
#else
  return m;
#endif
}

}  // namespace swiglu

using namespace swiglu;

// y[r, c] = silu(gu[r, c]) * gu[r, I + c], rounded as eager torch (see the top).
extern "C" __global__ void __launch_bounds__(BLOCK)
swiglu_fwd_kernel(const T* __restrict__ gu, T* __restrict__ y, long long rows, long long inter,
                  long long ld_gu, long long ld_y, long long shift, unsigned* __restrict__ amax) {
  const Slot s = slot(inter, shift);
  unsigned m = 0;
  for (long long r = s.row; s.col >= 0 && r < rows; r += s.row_step) {
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
    m = abs_max_if_amax(m, out);
    ck::store(y + r * ld_y + s.col, out);
  }
  block_amax(m, amax);
}

// dgu[r, c] = dg, dgu[r, I + c] = du (see the top): fp32 math, one rounding.
extern "C" __global__ void __launch_bounds__(BLOCK)
swiglu_bwd_kernel(const T* __restrict__ dy, const T* __restrict__ gu, T* __restrict__ dgu,
                  long long rows, long long inter, long long ld_dy, long long ld_gu,
                  long long ld_dgu, long long shift, unsigned* __restrict__ amax) {
  const Slot s = slot(inter, shift);
  unsigned m = 0;
  for (long long r = s.row; s.col >= 0 && r < rows; r += s.row_step) {
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
    m = abs_max_if_amax(abs_max_if_amax(m, dg), du);
    T* q = dgu + r * ld_dgu + s.col;
    ck::store(q, dg);
    ck::store(q + inter, du);
  }
  block_amax(m, amax);
}

// ---------------------------------------------------------------------------------------------
// FP8 output (compiled with FP8 defined): y = silu(g) * u as the forward kernel rounds it, and q,
// y quantized to FP8 with float32 dequantization scales, equal to
// custom_kernels.fp8.fp8_quant.quantize(y, granularity) bit for bit (fp8_common.cuh has the rule).
// MODE 1: a scale per row, scale[r]; MODE 2: per 128 columns, scale[(c / 128) * rows + r]
// (column-major (rows, I / 128)). As fp8_quant.cu's rows kernel: a team of 1 << shift threads
// owns a group (a row, or a row's 128 columns; group_cols its width), computes its y a 16-byte
// slot at a time (EPT elements; VEC: 16-byte loads of each half, else one element an access,
// zeros past the group), keeps up to NV slots a thread in registers (longer rows compute the
// rest again from gu), reduces the amax across the team, writes the scale and q. y (contiguous
// [rows, I]) is written when not null; q is [rows, I] contiguous.
// Defines: FP8 3 e4m3 / 4 e5m2, MODE, NV; DTYPE, VEC, BLOCK as above.
// ---------------------------------------------------------------------------------------------
#ifdef FP8
#include "fp8_common.cuh"

#ifndef MODE
#define MODE 1
#endif
#ifndef NV
#define NV 8
#endif

namespace swiglu {

constexpr int EPT = 16 / static_cast<int>(sizeof(T));  // elements of a slot
using VS = ck::Vec<T, EPT>;

// silu(g) * u: swiglu_fwd_kernel's operations (IEEE, each rounding as there: the same bits).
__device__ __forceinline__ T swiglu_value(float g, float u) {
  const float act = round_t(__fdiv_rn(g, one_plus_exp_neg(g)));
  return ck::from_float<T>(__fmul_rn(act, u));
}

// y of the slot at column c of a group (gate at `gate`, up `inter` elements after it).
__device__ __forceinline__ VS y_slot(const T* gate, long long inter, long long c,
                                     long long extent) {
  VS g, u, out;
  if constexpr (VEC) {
    ck::load(g, gate + c);
    ck::load(u, gate + inter + c);
  } else {
#pragma unroll
    for (int j = 0; j < EPT; ++j) {
      const bool in = c + j < extent;
      g.v[j] = in ? gate[c + j] : ck::from_float<T>(0.0f);
      u.v[j] = in ? gate[inter + c + j] : ck::from_float<T>(0.0f);
    }
  }
#pragma unroll
  for (int j = 0; j < EPT; ++j) out.v[j] = swiglu_value(ck::elem_float(g, j), ck::elem_float(u, j));
  return out;
}

template <class E>
__device__ __forceinline__ void store_elems(E* row, long long c, long long extent,
                                            const ck::Vec<E, EPT>& v) {
  if constexpr (VEC) {
    ck::store(row + c, v);
  } else {
#pragma unroll
    for (int j = 0; j < EPT; ++j)
      if (c + j < extent) row[c + j] = v.v[j];
  }
}

}  // namespace swiglu

extern "C" __global__ void __launch_bounds__(BLOCK)
swiglu_fp8_kernel(const T* __restrict__ gu, T* __restrict__ y, unsigned char* __restrict__ q,
                  float* __restrict__ scale, long long rows, long long inter, long long ld_gu,
                  long long group_cols, long long shift) {
  __shared__ unsigned red[BLOCK / 32];
  const int team = 1 << shift;
  const int lane = threadIdx.x & (team - 1);
  const int teams = BLOCK >> shift;
  const long long per_row = inter / group_cols;
  const long long groups = rows * per_row;
  const long long step = static_cast<long long>(team) * EPT;
  for (long long base = static_cast<long long>(blockIdx.x) * teams; base < groups;
       base += static_cast<long long>(gridDim.x) * teams) {  // uniform over the block
    const long long gid = base + (threadIdx.x >> shift);
    const bool active = gid < groups;
    const long long r = active ? gid / per_row : 0, g = active ? gid % per_row : 0;
    const T* src = gu + r * ld_gu + g * group_cols;
    T* dst_y = y != nullptr ? y + r * inter + g * group_cols : nullptr;
    unsigned char* dst_q = q + r * inter + g * group_cols;
    VS keep[NV];
    unsigned m = 0;
#pragma unroll
    for (int k = 0; k < NV; ++k) {
      const long long c = k * step + lane * EPT;
      if (active && c < group_cols) {
        keep[k] = y_slot(src, inter, c, group_cols);
        if (dst_y != nullptr) store_elems(dst_y, c, group_cols, keep[k]);
        m = max(m, ck::vec_abs_max(keep[k]));
      }
    }
    for (long long c = NV * step + lane * EPT; active && c < group_cols; c += step) {
      const VS v = y_slot(src, inter, c, group_cols);
      if (dst_y != nullptr) store_elems(dst_y, c, group_cols, v);
      m = max(m, ck::vec_abs_max(v));
    }
    const ck::Fp8Factor s = ck::fp8_factor<FP8>(ck::team_max<BLOCK>(m, team, red));
    if (active && lane == 0) scale[MODE == 2 ? g * rows + r : r] = s.scale;
#pragma unroll
    for (int k = 0; k < NV; ++k) {
      const long long c = k * step + lane * EPT;
      if (active && c < group_cols)
        store_elems(dst_q, c, group_cols, ck::fp8_quantize<FP8>(keep[k], s));
    }
    for (long long c = NV * step + lane * EPT; active && c < group_cols; c += step) {
      const VS v = y_slot(src, inter, c, group_cols);  // computed again from gu (L2)
      store_elems(dst_q, c, group_cols, ck::fp8_quantize<FP8>(v, s));
    }
  }
}
#endif  // FP8
