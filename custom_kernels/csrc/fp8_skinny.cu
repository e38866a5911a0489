// FP8 scaled GEMM for few rows (M <= 128: decode, small batches), split along K over a thread
// block cluster: out = (a * scale_a) @ (b * scale_b) [+ bias], torch._scaled_mm's meaning.
//
// Why a kernel of its own: at M <= 128 the GEMM streams the weight b (N x K bytes) and little
// else, so its floor is HBM bandwidth (a 4096 x 14336 FP8 weight is 59 MB: 12 us on an H200).
// cuBLAS and the CUTLASS warp-specialized kernels tile N only (M fills one tile): 32 tiles of 128
// columns for N = 4096 occupy a quarter of the SMs, each streaming a whole K, and run near
// 2 TB/s (docs/measurements.md, "FP8 GEMMs"). Here every output tile is cut along K into S slices
// (S <= 8 blocks of one cluster), so N/128 * S blocks stream b at once, and the cluster sums its
// S partial tiles through distributed shared memory: no workspace, no semaphores, no second
// launch, and the same sum order on every run (rank 0's slice first), so results are
// deterministic.
//
// Layout: a (M, K) row-major with row stride lda; b given as its (N, K) rows (torch's column-major
// (K, N) b), row stride ldb; both K-major, as FP8 tensor cores read them. out (M, N) row-major,
// contiguous. K and N multiples of 128 (the launcher checks).
//
// Scales (float32, read on the device: no host sync):
//   RECIPE 0 tensorwise: scale_a[0] * scale_b[0] times the sum;
//   RECIPE 1 rowwise:    scale_a[m * sa_stride] * scale_b[n * sb_stride];
//   RECIPE 2 blockwise:  scale_a[kb * sa_stride + m] (1 x 128 blocks, column-major (M, K/128)),
//                        scale_b[nb * sb_stride + kb] (128 x 128 blocks), applied to each 128-deep
//                        block's partial sum before it is added (promotion, as DeepSeek's recipe).
// Every recipe adds each 128-deep block's tensor-core sum into a float32 accumulator with a
// CUDA-core add (FP8 tensor cores accumulate with fewer mantissa bits than float32), so the
// result never depends on torch's use_fast_accum flag.
//
// Mainloop (per block: a BM x 128 output tile, a K slice): a STAGES-deep cp.async pipeline of
// 128-deep k-blocks of a (BM rows) and b (128 rows), 16-byte chunks XOR-swizzled by row so that
// ldmatrix reads are free of bank conflicts, and mma.sync m16n8k32 (FP8 in, float32 out: the
// legacy warp-level MMA, which needs no warpgroup and keeps 16-row tiles whole; at these shapes
// the kernel waits on memory, not on the tensor cores). Warps: 1 x 4 (BM <= 32) or 2 x 4, each
// owning a (BM / WARPS_M) x 32 tile.
//
// Defines: BM (16, 32, 64, 128), STAGES (>= 2), RECIPE (0, 1, 2), ELEM_A / ELEM_B (3 e4m3,
// 4 e5m2: custom_kernels.core.elements' codes), OUT_F32 (1: float32 out, else bf16), HAS_BIAS
// (a bias (N,) of the output's dtype).
#include <cooperative_groups.h>
#include <cuda_bf16.h>

#ifndef BM
#define BM 16
#endif
#ifndef STAGES
#define STAGES 4
#endif
#ifndef RECIPE
#define RECIPE 0
#endif
#ifndef ELEM_A
#define ELEM_A 3
#endif
#ifndef ELEM_B
#define ELEM_B 3
#endif
#ifndef OUT_F32
#define OUT_F32 0
#endif
#ifndef HAS_BIAS
#define HAS_BIAS 0
#endif

namespace cg = cooperative_groups;

namespace {

constexpr int kBN = 128;                      // output columns a block (one blockwise scale block)
constexpr int kBK = 128;                      // k-block depth (one blockwise scale block)
constexpr int kWarpsM = BM >= 64 ? 2 : 1;
constexpr int kWarpsN = 4;
constexpr int kThreads = 32 * kWarpsM * kWarpsN;
constexpr int kWarpRows = BM / kWarpsM;       // 16, 32, 32, 64
constexpr int kMT = kWarpRows / 16;           // m16 tiles a warp
constexpr int kNT = kBN / kWarpsN / 8;        // n8 tiles a warp (4)
constexpr int kTileA = BM * kBK;              // bytes a stage
constexpr int kTileB = kBN * kBK;
constexpr int kStageBytes = kTileA + kTileB;
constexpr int kRedLd = kBN + 8;               // partial-tile row stride (floats): no bank conflict
static_assert(BM == 16 || BM == 32 || BM == 64 || BM == 128, "BM is 16, 32, 64 or 128");
static_assert(STAGES >= 2, "a pipeline needs two stages");
static_assert(STAGES * kStageBytes >= BM * kRedLd * 4, "the partial tile reuses the pipeline");

// 16-byte chunk `chunk` (0..7) of row `row` of a 128-byte-row tile.
__device__ __forceinline__ unsigned swizzled(unsigned base, int row, int chunk) {
  return base + row * kBK + ((chunk ^ (row & 7)) << 4);
}

__device__ __forceinline__ void cp_async16(unsigned dst, const void* src, bool valid) {
  const int bytes = valid ? 16 : 0;  // 0: zero-fill, nothing read
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(bytes)
               : "memory");
}

__device__ __forceinline__ void cp_async4(unsigned dst, const void* src, bool valid) {
  const int bytes = valid ? 4 : 0;
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(bytes)
               : "memory");
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n"); }

template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

__device__ __forceinline__ void ldmatrix_x4(unsigned addr, unsigned (&r)[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

#define CK_FP8_NAME_3 "e4m3"
#define CK_FP8_NAME_4 "e5m2"
#define CK_STR2(x) CK_FP8_NAME_##x
#define CK_STR(x) CK_STR2(x)

// d += a * b for one m16n8k32 tile.
__device__ __forceinline__ void mma_fp8(float (&d)[4], const unsigned (&a)[4], unsigned b0,
                                        unsigned b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.f32." CK_STR(ELEM_A) "." CK_STR(ELEM_B) ".f32 "
      "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

#if OUT_F32
using Out = float;
#else
using Out = __nv_bfloat16;
#endif

}  // namespace

extern "C" __global__ void __launch_bounds__(kThreads, 1) fp8_skinny_gemm(
    const unsigned char* __restrict__ a, long long lda, const unsigned char* __restrict__ b,
    long long ldb, const float* __restrict__ scale_a, long long sa_stride,
    const float* __restrict__ scale_b, long long sb_stride, const Out* __restrict__ bias,
    Out* __restrict__ out, long long m_total, long long n_total, long long k_total) {
  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ float sa_stage[STAGES][BM];  // blockwise: scale_a of the stage's rows
  __shared__ float sb_stage[STAGES];      // blockwise: scale_b of the stage's block

  cg::cluster_group cluster = cg::this_cluster();
  const int splits = static_cast<int>(gridDim.x);  // the cluster spans the grid's x
  const int split = static_cast<int>(blockIdx.x);
  const int n0 = static_cast<int>(blockIdx.y) * kBN;
  const long long m0 = static_cast<long long>(blockIdx.z) * BM;
  const int tid = threadIdx.x;
  const int warp = tid >> 5, lane = tid & 31;
  const int warp_m = warp / kWarpsN, warp_n = warp % kWarpsN;
  const int blocks_k = static_cast<int>(k_total / kBK);
  const int kb_begin = split * blocks_k / splits;
  const int kb_count = (split + 1) * blocks_k / splits - kb_begin;

  const unsigned smem_base = static_cast<unsigned>(__cvta_generic_to_shared(smem));

  auto load_stage = [&](int stage, int kb) {
    const unsigned sa = smem_base + stage * kStageBytes;
    const unsigned sb = sa + kTileA;
    const long long k0 = static_cast<long long>(kb) * kBK;
#pragma unroll
    for (int c = tid; c < BM * 8; c += kThreads) {
      const int row = c >> 3, chunk = c & 7;
      const bool valid = m0 + row < m_total;
      const unsigned char* src = a + (valid ? (m0 + row) * lda : 0) + k0 + chunk * 16;
      cp_async16(swizzled(sa, row, chunk), src, valid);
    }
#pragma unroll
    for (int c = tid; c < kBN * 8; c += kThreads) {
      const int row = c >> 3, chunk = c & 7;
      cp_async16(swizzled(sb, row, chunk), b + (n0 + row) * ldb + k0 + chunk * 16, true);
    }
#if RECIPE == 2
    if (tid < BM) {
      const bool valid = m0 + tid < m_total;
      const float* src = scale_a + kb * sa_stride + (valid ? m0 + tid : 0);
      cp_async4(static_cast<unsigned>(__cvta_generic_to_shared(&sa_stage[stage][tid])), src,
                valid);
    } else if (tid == kThreads - 1) {
      cp_async4(static_cast<unsigned>(__cvta_generic_to_shared(&sb_stage[stage])),
                scale_b + (n0 / kBN) * sb_stride + kb, true);
    }
#endif
  };

  float acc[kMT][kNT][4];
#pragma unroll
  for (int i = 0; i < kMT; ++i)
#pragma unroll
    for (int j = 0; j < kNT; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.0f;

  const int group = lane >> 2, quad = lane & 3;
  const int mat = lane >> 3, mat_row = lane & 7;  // ldmatrix: which 8x16-byte matrix, which row
  const int warp_row0 = warp_m * kWarpRows, warp_col0 = warp_n * (kBN / kWarpsN);

#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < kb_count) load_stage(s, kb_begin + s);
    cp_async_commit();
  }

  for (int i = 0; i < kb_count; ++i) {
    cp_async_wait<STAGES - 2>();
    __syncthreads();  // the stage is complete for every thread; stage i-1 is free to refill
    const int next = i + STAGES - 1;
    if (next < kb_count) load_stage(next % STAGES, kb_begin + next);
    cp_async_commit();

    const int stage = i % STAGES;
    const unsigned sa = smem_base + stage * kStageBytes;
    const unsigned sb = sa + kTileA;
    float part[kMT][kNT][4];
#pragma unroll
    for (int mi = 0; mi < kMT; ++mi)
#pragma unroll
      for (int nj = 0; nj < kNT; ++nj)
#pragma unroll
        for (int e = 0; e < 4; ++e) part[mi][nj][e] = 0.0f;
#pragma unroll
    for (int kk = 0; kk < kBK / 32; ++kk) {
      unsigned af[kMT][4];
#pragma unroll
      for (int mi = 0; mi < kMT; ++mi) {
        const int row = warp_row0 + mi * 16 + (mat & 1) * 8 + mat_row;
        ldmatrix_x4(swizzled(sa, row, 2 * kk + (mat >> 1)), af[mi]);
      }
      unsigned bf[kNT][2];
#pragma unroll
      for (int nj = 0; nj < kNT; nj += 2) {
        const int row = warp_col0 + (nj + (mat >> 1)) * 8 + mat_row;
        unsigned r[4];
        ldmatrix_x4(swizzled(sb, row, 2 * kk + (mat & 1)), r);
        bf[nj][0] = r[0];
        bf[nj][1] = r[1];
        bf[nj + 1][0] = r[2];
        bf[nj + 1][1] = r[3];
      }
#pragma unroll
      for (int mi = 0; mi < kMT; ++mi)
#pragma unroll
        for (int nj = 0; nj < kNT; ++nj) mma_fp8(part[mi][nj], af[mi], bf[nj][0], bf[nj][1]);
    }
    // Promotion: the block's tensor-core sum joins the float32 accumulator.
#pragma unroll
    for (int mi = 0; mi < kMT; ++mi) {
#if RECIPE == 2
      const int r0 = warp_row0 + mi * 16 + group;
      const float f0 = sa_stage[stage][r0] * sb_stage[stage];
      const float f1 = sa_stage[stage][r0 + 8] * sb_stage[stage];
#else
      const float f0 = 1.0f, f1 = 1.0f;
#endif
#pragma unroll
      for (int nj = 0; nj < kNT; ++nj) {
        acc[mi][nj][0] = fmaf(part[mi][nj][0], f0, acc[mi][nj][0]);
        acc[mi][nj][1] = fmaf(part[mi][nj][1], f0, acc[mi][nj][1]);
        acc[mi][nj][2] = fmaf(part[mi][nj][2], f1, acc[mi][nj][2]);
        acc[mi][nj][3] = fmaf(part[mi][nj][3], f1, acc[mi][nj][3]);
      }
    }
  }
  cp_async_wait<0>();
  __syncthreads();  // the pipeline's memory becomes this block's partial tile

  float* partial = reinterpret_cast<float*>(smem);
#pragma unroll
  for (int mi = 0; mi < kMT; ++mi)
#pragma unroll
    for (int nj = 0; nj < kNT; ++nj) {
      const int row = warp_row0 + mi * 16 + group, col = warp_col0 + nj * 8 + quad * 2;
      *reinterpret_cast<float2*>(&partial[row * kRedLd + col]) =
          make_float2(acc[mi][nj][0], acc[mi][nj][1]);
      *reinterpret_cast<float2*>(&partial[(row + 8) * kRedLd + col]) =
          make_float2(acc[mi][nj][2], acc[mi][nj][3]);
    }
  if (splits > 1) {
    cluster.sync();  // every rank's partial tile is written
  } else {
    __syncthreads();
  }

  // Rank r sums its share of the tile's float4 groups over the S partials, in rank order.
#if RECIPE == 0
  const float alpha = scale_a[0] * scale_b[0];
#endif
  constexpr int kGroups = BM * kBN / 4;
  const int share = kGroups / splits;  // BM * 32 groups: a multiple of 8 >= S
  for (int g = split * share + tid; g < (split + 1) * share; g += kThreads) {
    const int row = g / (kBN / 4), col = (g % (kBN / 4)) * 4;
    const long long m = m0 + row;
    if (m >= m_total) continue;
    float4* mine = reinterpret_cast<float4*>(&partial[row * kRedLd + col]);
    float4 sum = splits > 1 ? *cluster.map_shared_rank(mine, 0) : *mine;
    for (int r = 1; r < splits; ++r) {
      const float4 v = *cluster.map_shared_rank(mine, r);
      sum.x += v.x;
      sum.y += v.y;
      sum.z += v.z;
      sum.w += v.w;
    }
    float vals[4] = {sum.x, sum.y, sum.z, sum.w};
    const long long n = n0 + col;
#pragma unroll
    for (int e = 0; e < 4; ++e) {
#if RECIPE == 0
      vals[e] *= alpha;
#elif RECIPE == 1
      vals[e] = vals[e] * scale_a[m * sa_stride] * scale_b[(n + e) * sb_stride];
#endif
#if HAS_BIAS
#if OUT_F32
      vals[e] += bias[n + e];
#else
      vals[e] += __bfloat162float(bias[n + e]);
#endif
#endif
    }
#if OUT_F32
    *reinterpret_cast<float4*>(&out[m * n_total + n]) = make_float4(vals[0], vals[1], vals[2],
                                                                     vals[3]);
#else
    __nv_bfloat162 lo = __floats2bfloat162_rn(vals[0], vals[1]);
    __nv_bfloat162 hi = __floats2bfloat162_rn(vals[2], vals[3]);
    uint2 packed;
    packed.x = *reinterpret_cast<unsigned*>(&lo);
    packed.y = *reinterpret_cast<unsigned*>(&hi);
    *reinterpret_cast<uint2*>(&out[m * n_total + n]) = packed;
#endif
  }
  if (splits > 1) cluster.sync();  // no rank leaves while another still reads its partial tile
}
