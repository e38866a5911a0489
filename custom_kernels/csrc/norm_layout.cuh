// Compile-time layout of the norm kernels, shared by norms.cu (direct loads) and
// norms_staged.cu (rows staged through shared memory): the -D values chosen by
// custom_kernels/norm_config.py with their defaults, the element and vector types, and where
// each thread's vectors sit in a row.
//
// A row is split among `kTpr` threads of one block (NORM_TPR lanes of a warp when
// NORM_WARP_PER_ROW: the whole warp, or 8 or 16 lanes so that a warp holds several short rows;
// else the whole block) times NORM_CLUSTER blocks of a thread block cluster. Thread `lane` of
// cluster rank `rank` handles the NORM_VEC-element vectors at columns
//   ((it * NORM_CLUSTER + rank) * kTpr + lane) * NORM_VEC,   it = 0 .. NORM_ITERS-1,
// so each iteration is one coalesced sweep of the row by the whole cluster.
#pragma once

#include "cluster_reduce.cuh"
#include "norm_common.cuh"

#ifndef NORM_IN
#define NORM_IN 2
#endif
#ifndef NORM_OUT
#define NORM_OUT NORM_IN
#endif
#ifndef NORM_W
#define NORM_W NORM_IN
#endif
#ifndef NORM_LN
#define NORM_LN 0
#endif
#ifndef NORM_THREADS
#define NORM_THREADS 256
#endif
#ifndef NORM_WARP_PER_ROW
#define NORM_WARP_PER_ROW 0
#endif
// Lanes per row when NORM_WARP_PER_ROW: 32, or fewer for several rows per warp (the direct
// forward kernel only).
#ifndef NORM_TPR
#define NORM_TPR 32
#endif
// Rows per thread when NORM_WARP_PER_ROW (the direct forward kernel only): each thread loads its
// vectors of NORM_RPT rows before it reduces any, and loads each weight vector once for all of
// them (short rows: more bytes in flight per thread, fewer weight loads per row).
#ifndef NORM_RPT
#define NORM_RPT 1
#endif
#ifndef NORM_CLUSTER
#define NORM_CLUSTER 1
#endif
#ifndef NORM_VEC
#define NORM_VEC 1
#endif
#ifndef NORM_ITERS
#define NORM_ITERS 1
#endif
#ifndef NORM_CACHE
#define NORM_CACHE 1
#endif
// norms_staged.cu: rows in flight per row unit (shared-memory stages of the cp.async pipeline).
#ifndef NORM_STAGES
#define NORM_STAGES 2
#endif
// Which kernel this compilation holds: 0 norm_fwd, 1 norm_bwd, 2 norm_dw_reduce, -1 all.
#ifndef NORM_PART
#define NORM_PART -1
#endif
#define NORM_HAS_PART(p) (NORM_PART < 0 || NORM_PART == (p))

using In = ck::DType<NORM_IN>::type;    // x, residual, residual_out, dx
using Out = ck::DType<NORM_OUT>::type;  // y and dy
using W = ck::DType<NORM_W>::type;      // weight, bias, dweight, dbias

constexpr int kThreads = NORM_THREADS;
constexpr bool kWarpPerRow = NORM_WARP_PER_ROW != 0;
constexpr int kCluster = NORM_CLUSTER;
constexpr int kVec = NORM_VEC;
constexpr int kIters = NORM_ITERS;
constexpr bool kCache = NORM_CACHE != 0;
constexpr bool kLN = NORM_LN != 0;
constexpr int kTpr = kWarpPerRow ? NORM_TPR : kThreads;
constexpr int kRowsPerBlock = kWarpPerRow ? kThreads / kTpr : 1;  // rows of one block-wide pass
constexpr int kRowsPerThread = NORM_RPT;
constexpr bool kSubWarpRows = kWarpPerRow && kTpr < 32;  // several rows per warp

static_assert(kThreads % 32 == 0 && kThreads <= 1024, "threads: a multiple of 32, at most 1024");
static_assert(!(kWarpPerRow && kCluster > 1), "a warp per row needs no cluster");
static_assert(!kWarpPerRow || kTpr == 8 || kTpr == 16 || kTpr == 32,
              "a row of a warp takes 8, 16 or 32 lanes");
static_assert(kCluster >= 1 && kCluster <= 16, "cluster of 1 to 16 blocks");
static_assert(kRowsPerThread >= 1 && kRowsPerThread <= 8 && (kRowsPerThread == 1 || kWarpPerRow),
              "several rows per thread: 1 to 8, with a warp (or less) per row");

using ck::from_float;
using ck::load;
using ck::store;
using ck::to_float;
using ck::Vec;
using VIn = Vec<In, kVec>;
using VOut = Vec<Out, kVec>;
using VW = Vec<W, kVec>;

// A row's reduction: within a group of lanes (several rows a warp), a block, or a cluster:
// through st.async and mbarriers (ck::AsyncClusterReducer) for clusters of 8 or more, through
// cluster barriers (ck::Reducer) below: a barrier's release waits for the previous row's stores
// (MEMBAR.ALL.GPU), which costs large clusters, while two blocks meet at a barrier sooner than 512
// threads poll an mbarrier (docs/measurements.md).
// NORM_ASYNC_REDUCE: -1 (default) that rule, 0 never, 1 for every cluster (sweeps).
#ifndef NORM_ASYNC_REDUCE
#define NORM_ASYNC_REDUCE -1
#endif
constexpr bool kAsyncReduce =
    kCluster > 1 && (NORM_ASYNC_REDUCE < 0 ? kCluster >= 8 : NORM_ASYNC_REDUCE != 0);
template <class T>
using RowReducer = typename ck::Conditional<
    kSubWarpRows, ck::GroupReducer<T, kSubWarpRows ? kTpr : 2>,
    typename ck::Conditional<kAsyncReduce,
                             ck::AsyncClusterReducer<T, kTpr / 32, kCluster>,
                             ck::Reducer<T, kSubWarpRows ? 1 : kTpr / 32, kCluster>>::type>::type;

__device__ __forceinline__ int cluster_rank() {
  if constexpr (kCluster > 1) {
    return static_cast<int>(cooperative_groups::this_cluster().block_rank());
  } else {
    return 0;
  }
}

__device__ __forceinline__ int vec_col(int it, int rank, int lane) {
  return ((it * kCluster + rank) * kTpr + lane) * kVec;
}

// ---------------------------------------------------------------------------------------------
// Backward helpers shared by both backward kernels
// ---------------------------------------------------------------------------------------------
//   xhat = (h - mean) * rstd,  g = dy * w
//   dh = rstd * (g - mean(g) - xhat * mean(g * xhat))   (RMSNorm: no mean(g) term, mean = 0)
//   dx = dh + d_residual_out;  dW += dy * xhat;  dB += dy

using RedT = ck::Conditional<kLN, float2, float>::type;
constexpr int kAccRows = kLN ? 2 : 1;  // dW, and dB for LayerNorm

__device__ __forceinline__ void zero_accumulators(float (&acc)[kAccRows][kIters][kVec]) {
#pragma unroll
  for (int a = 0; a < kAccRows; ++a)
#pragma unroll
    for (int it = 0; it < kIters; ++it)
#pragma unroll
      for (int j = 0; j < kVec; ++j) acc[a][it][j] = 0.0f;
}

// The row's sum of g * xhat (and of g, LayerNorm only) over the whole cluster.
__device__ __forceinline__ void row_sums(RowReducer<float>& red, float s1, float, float& c1,
                                         float& c2) {
  c1 = red.sum(s1);
  c2 = 0.0f;
}

__device__ __forceinline__ void row_sums(RowReducer<float2>& red, float s1, float s2, float& c1,
                                         float& c2) {
  const float2 r = red.sum(make_float2(s1, s2));
  c1 = r.x;
  c2 = r.y;
}

__device__ __forceinline__ void write_partials_direct(const float (&acc)[kIters][kVec],
                                                      float* part, int hidden, int rank,
                                                      int lane) {
#pragma unroll
  for (int it = 0; it < kIters; ++it) {
    const int col = vec_col(it, rank, lane);
    if (col < hidden) {
      Vec<float, kVec> v;
#pragma unroll
      for (int j = 0; j < kVec; ++j) v.v[j] = acc[it][j];
      store(part + col, v);
    }
  }
}

// A warp per row: the warps of a block first add their partials in shared memory.
__device__ __forceinline__ void write_partials_block(const float (&acc)[kIters][kVec],
                                                     float* part, float* smem, int hidden,
                                                     int lane) {
  const int warp = threadIdx.x / 32;
#pragma unroll
  for (int it = 0; it < kIters; ++it) {
    const int col = vec_col(it, 0, lane);
    if (col < hidden) {
#pragma unroll
      for (int j = 0; j < kVec; ++j) smem[warp * hidden + col + j] = acc[it][j];
    }
  }
  __syncthreads();
  for (int c = threadIdx.x; c < hidden; c += kThreads) {
    float t = 0.0f;
    for (int r = 0; r < kRowsPerBlock; ++r) t += smem[r * hidden + c];
    part[c] = t;
  }
  __syncthreads();
}

