// The rotary embedding's cos / sin tables in one launch: Hugging Face's ...RotaryEmbedding.forward
// (the static RoPE types), which is eight small launches in torch (the positions widened, their
// product with inv_freq, the two halves concatenated, cos, sin, two scalings, two casts).
//
// For row r (a (batch, position) pair) and frequency f < HALF:
//   angle = float(position[r]) * inv_freq[f]
//   cos[r, f] = cos[r, f + HALF] = T(cos(angle) * scaling),  likewise sin
// in fp32 with the rounding torch's eager ops do, so that the tables are the same bits:
// the int64 position converted once (round to nearest), one fp32 product (torch's elementwise
// product, or its K = 1 matmul: one rounding either way), the precise cosf / sinf (no fast math,
// as torch's cos / sin kernels), the scaling an fp32 product, one rounding to T.
// __fmul_rn keeps the compiler from contracting anything into an FMA.
//
// Layout: positions [rows] (int64, contiguous), inv_freq [HALF] (contiguous, widened to fp32
// exactly, as Hugging Face's .float() does for a model cast to bf16 with its buffers), cos / sin
// [rows, 2 * HALF] contiguous. Grid: one thread per (row, f) pair, x covering rows * HALF.
//
// Defines: DTYPE and FREQ_DTYPE 0 fp32 / 1 fp16 / 2 bf16 (the tables' type, inv_freq's).
// Scalars are 64-bit, as cuda.core packs Python ints, except the fp32 scaling.
#include "norm_common.cuh"

#ifndef DTYPE
#define DTYPE 2
#endif

#ifndef FREQ_DTYPE
#define FREQ_DTYPE 0
#endif

using T = typename ck::DType<DTYPE>::type;
using F = typename ck::DType<FREQ_DTYPE>::type;

extern "C" __global__ void rotary_tables_kernel(const long long* __restrict__ positions,
                                                const F* __restrict__ inv_freq,
                                                T* __restrict__ cos_out, T* __restrict__ sin_out,
                                                long long rows, long long half, float scaling) {
  const long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= rows * half) return;
  const long long row = i / half, f = i - row * half;
  const float angle = __fmul_rn(static_cast<float>(positions[row]), ck::to_float(inv_freq[f]));
  const T c = ck::from_float<T>(__fmul_rn(cosf(angle), scaling));
  const T s = ck::from_float<T>(__fmul_rn(sinf(angle), scaling));
  const long long at = row * 2 * half + f;
  cos_out[at] = c;
  cos_out[at + half] = c;
  sin_out[at] = s;
  sin_out[at + half] = s;
}
