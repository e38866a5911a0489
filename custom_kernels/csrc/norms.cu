// RMSNorm and LayerNorm, forward and backward, with an optional fused residual add.
//
//   h = x + residual (rounded to x's type; written out as the new residual), or h = x
//   RMSNorm:   y = h * rstd * w,                 rstd = 1 / sqrt(mean(h^2) + eps)
//   LayerNorm: y = (h - mean) * rstd * w + b,    rstd = 1 / sqrt(mean((h - mean)^2) + eps)
//
// Statistics in fp32; per-row rstd (and mean) saved for the backward pass (null pointers: not
// written, for calls that want no gradient).
//
// Direct loads: each thread reads its vectors of the row (norm_layout.cuh says which) straight
// into registers. With NORM_CACHE the row is read from global memory once and kept there;
// without it (rows too long for the register budget) the later passes read it again (mostly
// from L2). This is the kernel of the scalar path (NORM_VEC = 1: unaligned pointers, or hidden
// or a row stride not a multiple of the vector); norms_staged.cu is the fast path of aligned rows.
// NORM_VEC > 1 requires every pointer 16-byte aligned and hidden and the row strides multiples of
// NORM_VEC (the Python side checks).
//
// NORM_FP8 (RMSNorm forward; norm_fp8.cuh): the kernel also writes y quantized to FP8 and its
// scales (per row, or per 128 columns), from the values it rounds to Out for y.
//
// Kernels: norm_fwd (one row per block/cluster, or one row per warp or per 8 or 16 lanes of a
// warp: grid = row groups),
// norm_bwd (persistent: a fixed grid of row units walks the rows, accumulating dW/dB partials
// per unit in registers, written once to a [units, hidden] fp32 workspace), norm_dw_reduce
// (sums the workspace over units into dW/dB in the weight's type; deterministic).

#include "norm_rows.cuh"
#include "norm_fp8.cuh"  // NORM_FP8: the FP8 output beside y (nothing without it)

// ---------------------------------------------------------------------------------------------
// Forward
// ---------------------------------------------------------------------------------------------

#if NORM_HAS_PART(0)
// Pass 1 of the forward with the row in registers, in two steps so that a thread with several
// rows issues the loads of all of them before it uses any: ptxas does not move a load above
// the use of an earlier one (each vector sits behind its own bounds-check branch), so
// load-then-use per vector would wait for one memory round trip per vector
// (docs/measurements.md).
__device__ __forceinline__ void fwd_issue_loads(VIn (&h)[kIters], VIn (&r)[kIters], const In* xr,
                                                const In* rr, int hidden, int rank, int lane) {
#pragma unroll
  for (int it = 0; it < kIters; ++it) {
    const int col = vec_col(it, rank, lane);
    if (col < hidden) {
      load(h[it], xr + col);
      if (rr != nullptr) load(r[it], rr + col);
    }
  }
}

// Then h = x + residual, written to residual_out. (The statistics are summed afterwards from
// the registers: row_statistics<true>.)
__device__ __forceinline__ void fwd_add_residual(VIn (&h)[kIters], const VIn (&r)[kIters],
                                                 bool residual, In* hr, int hidden, int rank,
                                                 int lane) {
#pragma unroll
  for (int it = 0; it < kIters; ++it) {
    const int col = vec_col(it, rank, lane);
    if (col < hidden && residual) {
      add_residual(h[it], r[it]);
      if (hr != nullptr) store(hr + col, h[it]);  // none past the end
    }
  }
}

// Pass 1 without the cache (rows too long for registers): one vector at a time; returns this
// thread's sum of h^2 (RMSNorm's statistics).
__device__ __forceinline__ float fwd_first_pass_uncached(const In* xr, const In* rr, In* hr,
                                                         int hidden, int rank, int lane) {
  float s = 0.0f;
#pragma unroll
  for (int it = 0; it < kIters; ++it) {
    const int col = vec_col(it, rank, lane);
    if (col < hidden) {
      VIn v;
      load(v, xr + col);
      if (rr != nullptr) {
        VIn r;
        load(r, rr + col);
        add_residual(v, r);
        if (hr != nullptr) store(hr + col, v);  // none past the end
      }
      accumulate_first_pass(s, v);
    }
  }
  return s;
}

static_assert(kRowsPerThread == 1 || kCache, "several rows per thread keep them in registers");

// NORM_MAX_REGS > 0: registers per thread capped through __launch_bounds__' minimum of blocks
// per SM (65536 registers), for more resident warps on short rows (norm_config.py says where).
#ifndef NORM_MAX_REGS
#define NORM_MAX_REGS 0
#endif
#if NORM_MAX_REGS > 0
#define NORM_FWD_BOUNDS __launch_bounds__(kThreads, 65536 / (kThreads * NORM_MAX_REGS))
#else
#define NORM_FWD_BOUNDS __launch_bounds__(kThreads)
#endif

// Rows: with kWarpPerRow, a block covers kRowsPerBlock * kRowsPerThread consecutive rows, in
// kRowsPerThread passes of kRowsPerBlock (one per warp or per kTpr lanes); thread t takes row
// t / kTpr of each pass. Otherwise one row per block (cluster).
__global__ void NORM_FWD_BOUNDS norm_fwd(
    const In* __restrict__ x, const In* __restrict__ res, const W* __restrict__ w,
    const W* __restrict__ b, Out* __restrict__ y, In* res_out, float* __restrict__ mean_out,
    float* __restrict__ rstd_out, long long rows, int hidden, long long x_stride,
    long long res_stride, float eps NORM_FP8_PARAMS) {
  constexpr int R = kRowsPerThread;
  constexpr bool kMayOverrun = kSubWarpRows || R > 1;  // rows of a warp may end past `rows`
  // LayerNorm reduces (sum, sum of squares)
  __shared__ __align__(16) RedT red_smem[RowReducer<RedT>::kSlots];
  const int lane = kWarpPerRow ? threadIdx.x % kTpr : threadIdx.x;
  const int rank = cluster_rank();
  long long row[R];
  // false: a row past the end that only keeps its warp's shuffles full (it reads row rows - 1
  // and stores nothing)
  bool active[R];
  if constexpr (kWarpPerRow) {
    const long long first = static_cast<long long>(blockIdx.x) * (kRowsPerBlock * R);
    if (first + threadIdx.x / 32 * (32 / kTpr) >= rows) return;  // the whole warp is past the end
#pragma unroll
    for (int i = 0; i < R; ++i) {
      row[i] = first + i * kRowsPerBlock + threadIdx.x / kTpr;
      active[i] = !kMayOverrun || row[i] < rows;
      if (!active[i]) row[i] = rows - 1;
    }
  } else {
    row[0] = blockIdx.x / kCluster;  // the grid has exactly rows * kCluster blocks
    active[0] = true;
  }
  const In* xr[R];
  const In* rr[R];
  In* hr[R];
#pragma unroll
  for (int i = 0; i < R; ++i) {
    xr[i] = x + row[i] * x_stride;
    rr[i] = res != nullptr ? res + row[i] * res_stride : nullptr;
    hr[i] = res_out != nullptr && active[i] ? res_out + row[i] * static_cast<long long>(hidden)
                                            : nullptr;
  }

  RowReducer<RedT> red(red_smem);
  VIn h[R][kIters];  // unused (and optimized away) without the cache
  float s[R] = {};  // RMSNorm's first-pass sums of h^2, without the cache only
  if constexpr (kCache) {
    VIn r[R][kIters];
#pragma unroll
    for (int i = 0; i < R; ++i) fwd_issue_loads(h[i], r[i], xr[i], rr[i], hidden, rank, lane);
#pragma unroll
    for (int i = 0; i < R; ++i)
      fwd_add_residual(h[i], r[i], res != nullptr, hr[i], hidden, rank, lane);
  } else {
    s[0] = fwd_first_pass_uncached(xr[0], rr[0], hr[0], hidden, rank, lane);
  }
  // h again: from registers, or (without the cache) from residual_out or x
  auto get_h = [&](int i, int it, int col) {
    VIn v;
    if constexpr (kCache) {
      v = h[i][it];
    } else {
      load(v, (hr[i] != nullptr ? hr[i] : xr[i]) + col);
    }
    return v;
  };
  float2 stats[R];
#pragma unroll
  for (int i = 0; i < R; ++i) {
    auto get_hi = [&](int it, int col) { return get_h(i, it, col); };
    float shift;
    if constexpr (kLN && kWarpPerRow && kCache) {
      // LayerNorm's shift (row_shift: h's first element) is in the registers of the row's first
      // lane: one shuffle instead of a global load whose latency every row would wait for.
      const int first_lane = static_cast<int>(threadIdx.x % 32) & ~(kTpr - 1);
      shift = __shfl_sync(0xffffffffu, to_float(h[i][0].v[0]), first_lane);
    } else {
      shift = row_shift(xr[i], rr[i]);
    }
    stats[i] = row_statistics<kCache>(red, s[i], shift, get_hi, hidden, rank, lane, eps);
  }
  // Past the last shuffle: rows past the end store nothing from here on. (The FP8 output
  // reduces again: those rows go on, storing nothing.)
  if constexpr (kMayOverrun && !NORM_FP8) {
    if (!active[0]) return;  // nor any later row of this thread
  }
#pragma unroll
  for (int i = 0; i < R; ++i) {
    if (active[i] && lane == 0 && rank == 0 && rstd_out != nullptr) {  // null: none wanted
      rstd_out[row[i]] = stats[i].y;
      if constexpr (kLN) mean_out[row[i]] = stats[i].x;
    }
  }
  Out* yr[R];
#pragma unroll
  for (int i = 0; i < R; ++i) yr[i] = y + row[i] * static_cast<long long>(hidden);
  auto get_w = [&](int, int col) {
    VW v;
    load(v, w + col);
    return v;
  };
#if !NORM_FP8
  auto get_b = [&](int, int col) {
    VW v;
    load(v, b + col);
    return v;
  };
#endif
  // Each weight (and bias) vector is loaded once for all of this thread's rows.
#if NORM_FP8
#pragma unroll
  for (int i = 0; i < R; ++i) yr[i] = y != nullptr ? yr[i] : nullptr;  // null: no y wanted
  write_fp8_rows(yr, active, row, red, get_h, get_w, stats, q_out, q_scale, rows, hidden, rank,
                 lane);
#else
  write_normalized_rows(yr, active, get_h, get_w, get_b, stats, hidden, rank, lane);
#endif
}

#endif  // NORM_HAS_PART(0)

#if NORM_HAS_PART(1)
// ---------------------------------------------------------------------------------------------
// Backward
// ---------------------------------------------------------------------------------------------
// (the formulas are in norm_layout.cuh)

static_assert(!kSubWarpRows && kRowsPerThread == 1,
              "the backward pass takes a whole warp (or more) per row, one row per thread");

__global__ void __launch_bounds__(kThreads) norm_bwd(
    const In* __restrict__ x, const Out* __restrict__ dy, const In* __restrict__ dres,
    const W* __restrict__ w, const float* __restrict__ mean, const float* __restrict__ rstd,
    In* __restrict__ dx, float* __restrict__ dw_part, float* __restrict__ db_part, long long rows,
    int hidden, long long x_stride, long long dy_stride, long long dres_stride) {
  extern __shared__ float partial_smem[];  // a warp per row: kRowsPerBlock * hidden floats
  __shared__ __align__(16) RedT red_smem[RowReducer<RedT>::kSlots];
  const int lane = kWarpPerRow ? threadIdx.x % 32 : threadIdx.x;
  const int rank = cluster_rank();
  long long unit, units;
  if constexpr (kWarpPerRow) {
    unit = static_cast<long long>(blockIdx.x) * kRowsPerBlock + threadIdx.x / 32;
    units = static_cast<long long>(gridDim.x) * kRowsPerBlock;
  } else {
    unit = blockIdx.x / kCluster;
    units = gridDim.x / kCluster;
  }
  float acc[kAccRows][kIters][kVec];
  zero_accumulators(acc);

  RowReducer<RedT> red(red_smem);
  const float inv_n = 1.0f / static_cast<float>(hidden);
  for (long long row = unit; row < rows; row += units) {
    const float m = kLN ? mean[row] : 0.0f;
    const float rs = rstd[row];
    const In* xr = x + row * x_stride;
    const Out* dyr = dy + row * dy_stride;
    // Pass 1 reads the row from global memory (keeping it in registers when it fits), pass 2
    // reads it from there or again from global memory (mostly L2).
    VIn xc[kCache ? kIters : 1];
    VOut dyc[kCache ? kIters : 1];
    auto load_x = [&](int it, int col) {
      VIn v;
      load(v, xr + col);
      if constexpr (kCache) xc[it] = v;
      return v;
    };
    auto load_dy = [&](int it, int col) {
      VOut v;
      load(v, dyr + col);
      if constexpr (kCache) dyc[it] = v;
      return v;
    };
    auto get_x = [&](int it, int col) {
      VIn v;
      if constexpr (kCache) {
        v = xc[it];
      } else {
        load(v, xr + col);
      }
      return v;
    };
    auto get_dy = [&](int it, int col) {
      VOut v;
      if constexpr (kCache) {
        v = dyc[it];
      } else {
        load(v, dyr + col);
      }
      return v;
    };
    auto get_w = [&](int, int col) {
      VW v;
      load(v, w + col);
      return v;
    };
    const In* drr = dres != nullptr ? dres + row * dres_stride : nullptr;
    auto get_dres = [&](int, int col) {
      VIn v;
      load(v, drr + col);
      return v;
    };
    const float2 sums = accumulate_row(acc, load_x, load_dy, get_w, m, rs, hidden, rank, lane);
    float c1, c2;
    row_sums(red, sums.x, sums.y, c1, c2);
    write_dx_row(dx + row * static_cast<long long>(hidden), get_x, get_dy, get_w, drr != nullptr,
                 get_dres, m, rs, c1 * inv_n, c2 * inv_n, hidden, rank, lane);
  }
  if constexpr (kWarpPerRow) {
    write_partials_block(acc[0], dw_part + static_cast<long long>(blockIdx.x) * hidden,
                         partial_smem, hidden, lane);
    if constexpr (kLN)
      write_partials_block(acc[kAccRows - 1], db_part + static_cast<long long>(blockIdx.x) * hidden,
                           partial_smem, hidden, lane);
  } else {
    write_partials_direct(acc[0], dw_part + unit * hidden, hidden, rank, lane);
    if constexpr (kLN)
      write_partials_direct(acc[kAccRows - 1], db_part + unit * hidden, hidden, rank, lane);
  }
}

#endif  // NORM_HAS_PART(1)

#if NORM_HAS_PART(2)
// parts x hidden fp32 partials -> hidden values of W; blockIdx.y 0: dW, 1: dB.
// Block of 1024 threads: 32 columns x 32 slices of the parts, then a fixed-order sum.
__global__ void __launch_bounds__(1024) norm_dw_reduce(const float* __restrict__ part_w,
                                                       W* __restrict__ dw,
                                                       const float* __restrict__ part_b,
                                                       W* __restrict__ db, int parts, int hidden) {
  __shared__ float tile[32][33];
  const float* part = blockIdx.y == 0 ? part_w : part_b;
  W* out = blockIdx.y == 0 ? dw : db;
  const int tx = threadIdx.x % 32;
  const int ty = threadIdx.x / 32;
  const int col = blockIdx.x * 32 + tx;
  float acc = 0.0f;
  if (col < hidden) {
    for (int p = ty; p < parts; p += 32) acc += part[static_cast<long long>(p) * hidden + col];
  }
  tile[ty][tx] = acc;
  __syncthreads();
  if (ty == 0 && col < hidden) {
    float t = 0.0f;
#pragma unroll
    for (int r = 0; r < 32; ++r) t += tile[r][tx];
    out[col] = from_float<W>(t);
  }
}
#endif  // NORM_HAS_PART(2)
