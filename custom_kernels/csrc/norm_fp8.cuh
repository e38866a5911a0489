// The RMSNorm forward's FP8 output (NORM_FP8; nothing here otherwise): beside y, the kernel writes
// q = y quantized to FP8 (row-major, like y) and its float32 dequantization scales, from the
// values it has just rounded to Out, so that q and the scales equal
// custom_kernels.fp8.fp8_quant.quantize(y, granularity) bit for bit (the rule: fp8_common.cuh).
//
//   NORM_FP8 1 ("row"):         one scale a row, scale[row]. The row's amax needs every vector
//                               of the row: pass 1 writes y and reduces |y| over the row (the
//                               row's reducer: lanes, block or cluster); pass 2 computes y again
//                               (the same instructions on the same h and weight: the same bits)
//                               and writes q.
//   NORM_FP8 2 ("block_1x128"): one scale per 128 columns, scale[(col / 128) * rows + row]
//                               (column-major (rows, hidden / 128): scaled_mm's scale_a). A chunk
//                               is 128 / kVec consecutive lanes of one sweep of the row, or (rows
//                               of 8 or 16 lanes whose sweep is shorter) the same lanes over
//                               consecutive sweeps: one pass, a few shuffles a chunk.
//
// -D values: NORM_FP8 (0 off, 1, 2), NORM_FP8_TYPE (3 e4m3, 4 e5m2). RMSNorm only, 16-byte vectors
// (kVec even; the host copies unaligned rows), hidden a multiple of 128 for NORM_FP8 2. Kernels
// compiled with NORM_FP8 take two more parameters (NORM_FP8_PARAMS): q and its scales; y may be
// null there (no 16-bit copy wanted).
#pragma once

#include "norm_rows.cuh"

#ifndef NORM_FP8
#define NORM_FP8 0
#endif

#if NORM_FP8
#include "fp8_common.cuh"

#ifndef NORM_FP8_TYPE
#define NORM_FP8_TYPE 3
#endif
#define NORM_FP8_PARAMS , unsigned char* __restrict__ q_out, float* __restrict__ q_scale

static_assert(NORM_FP8 == 1 || NORM_FP8 == 2, "NORM_FP8: 1 (row) or 2 (block_1x128)");
static_assert(!kLN, "the FP8 output is RMSNorm's");
static_assert(kVec % 2 == 0, "the FP8 output takes 16-byte vectors (the host copies others)");

using VQ = Vec<unsigned char, kVec>;

// Row granularity: y (where yr[i] is not null) and q of R rows of this thread; `red` is the
// row's reducer (every thread of the row unit calls it, rows past the end too).
template <int R, class Reducer, class GetH, class GetW>
__device__ __forceinline__ void write_fp8_rows_per_row(
    Out* const (&yr)[R], const bool (&active)[R], const long long (&row)[R], Reducer& red,
    GetH get_h, GetW get_w, const float2 (&stats)[R], unsigned char* q, float* q_scale,
    int hidden, int rank, int lane) {
  VW bv;  // RMSNorm has no bias
  unsigned m[R];
#pragma unroll
  for (int i = 0; i < R; ++i) m[i] = 0;
#pragma unroll
  for (int it = 0; it < kIters; ++it) {
    const int col = vec_col(it, rank, lane);
    if (col < hidden) {
      const VW wv = get_w(it, col);
#pragma unroll
      for (int i = 0; i < R; ++i) {
        const VOut o = normalize_vec(get_h(i, it, col), wv, bv, stats[i]);
        if (active[i] && yr[i] != nullptr) store_out(yr[i] + col, o);
        m[i] = max(m[i], ck::vec_abs_max(o));
      }
    }
  }
  ck::Fp8Factor s[R];
#pragma unroll
  for (int i = 0; i < R; ++i) {
    s[i] = ck::fp8_factor<NORM_FP8_TYPE>(
        __float_as_uint(red.reduce(__uint_as_float(m[i]), ck::AbsBitsMaxOp{})));
    if (active[i] && lane == 0 && rank == 0) q_scale[row[i]] = s[i].scale;
  }
#pragma unroll
  for (int it = 0; it < kIters; ++it) {
    const int col = vec_col(it, rank, lane);
    if (col < hidden) {
      const VW wv = get_w(it, col);
#pragma unroll
      for (int i = 0; i < R; ++i) {
        if (active[i]) {
          const VOut o = normalize_vec(get_h(i, it, col), wv, bv, stats[i]);
          store_out(q + row[i] * hidden + col, ck::fp8_quantize<NORM_FP8_TYPE>(o, s[i]));
        }
      }
    }
  }
}

// Columns of one sweep of a row by its lanes (one block of a cluster), and how a 128-column chunk
// lies in them: kChunkLanes consecutive lanes of one sweep, or all kTpr lanes over kChunkIters
// consecutive sweeps.
constexpr int kSweep = kTpr * kVec;
constexpr int kChunkIters = kSweep >= 128 ? 1 : 128 / kSweep;
constexpr int kChunkLanes = kSweep >= 128 ? 128 / kVec : kTpr;
static_assert(kChunkLanes <= 32, "a chunk within a warp");
static_assert(NORM_FP8 != 2 || kIters % kChunkIters == 0,
              "block_1x128: hidden a multiple of 128 (whole chunks a thread)");

// block_1x128 granularity: y and q of R rows of this thread, one pass.
template <int R, class GetH, class GetW>
__device__ __forceinline__ void write_fp8_rows_per_chunk(
    Out* const (&yr)[R], const bool (&active)[R], const long long (&row)[R], GetH get_h,
    GetW get_w, const float2 (&stats)[R], unsigned char* q, float* q_scale, long long rows,
    int hidden, int rank, int lane) {
  VW bv;  // RMSNorm has no bias
#pragma unroll
  for (int it0 = 0; it0 < kIters; it0 += kChunkIters) {
    VOut o[kChunkIters][R];
    unsigned m[R];
#pragma unroll
    for (int i = 0; i < R; ++i) m[i] = 0;
#pragma unroll
    for (int j = 0; j < kChunkIters; ++j) {
      const int col = vec_col(it0 + j, rank, lane);
      if (col < hidden) {  // a chunk lies inside the row or past its end as a whole
        const VW wv = get_w(it0 + j, col);
#pragma unroll
        for (int i = 0; i < R; ++i) {
          o[j][i] = normalize_vec(get_h(i, it0 + j, col), wv, bv, stats[i]);
          if (active[i] && yr[i] != nullptr) store_out(yr[i] + col, o[j][i]);
          m[i] = max(m[i], ck::vec_abs_max(o[j][i]));
        }
      }
    }
#pragma unroll
    for (int i = 0; i < R; ++i) {
      const ck::Fp8Factor s =
          ck::fp8_factor<NORM_FP8_TYPE>(ck::lanes_max(m[i], kChunkLanes));  // all lanes
#pragma unroll
      for (int j = 0; j < kChunkIters; ++j) {
        const int col = vec_col(it0 + j, rank, lane);
        if (col < hidden && active[i]) {
          store_out(q + row[i] * hidden + col, ck::fp8_quantize<NORM_FP8_TYPE>(o[j][i], s));
          if (j == 0 && lane % kChunkLanes == 0) q_scale[(col / 128) * rows + row[i]] = s.scale;
        }
      }
    }
  }
}

// The FP8 forward output of R rows (in place of write_normalized_rows).
template <int R, class Reducer, class GetH, class GetW>
__device__ __forceinline__ void write_fp8_rows(Out* const (&yr)[R], const bool (&active)[R],
                                               const long long (&row)[R], Reducer& red,
                                               GetH get_h, GetW get_w, const float2 (&stats)[R],
                                               unsigned char* q, float* q_scale, long long rows,
                                               int hidden, int rank, int lane) {
  if constexpr (NORM_FP8 == 1) {
    write_fp8_rows_per_row(yr, active, row, red, get_h, get_w, stats, q, q_scale, hidden, rank,
                           lane);
  } else {
    write_fp8_rows_per_chunk(yr, active, row, get_h, get_w, stats, q, q_scale, rows, hidden,
                             rank, lane);
  }
}

#else
#define NORM_FP8_PARAMS
#endif  // NORM_FP8
