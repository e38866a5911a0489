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
// Mainloop (per block: a 128-column output tile, a K slice): a STAGES-deep cp.async pipeline of
// 128-deep k-blocks of a (BM rows) and b (128 rows), each row's 16-byte chunks XOR-swizzled by
// row: the 128-byte swizzle of a K-major wgmma operand, so the tensor cores read the stages
// in place. Hopper runs FP8 only through wgmma (mma.sync on FP8 converts to FP16 first and ran
// at an eighth of the rate: docs/measurements.md), and a wgmma tile has 64 rows, so the kernel
// computes D^T = b^T a^T: the weight's 128 rows fill two warpgroups' m64 tiles, the few rows of a
// are the wgmma's N (16 to 128).
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
constexpr int kThreads = 256;                 // two warpgroups, 64 weight rows each
constexpr int kAcc = BM / 2;                  // accumulators a thread: m64 x BM over 128 threads
constexpr int kTileX = BM * kBK;              // bytes a stage: a's rows, then b's
constexpr int kTileW = kBN * kBK;
constexpr int kStageBytes = kTileX + kTileW;  // a multiple of 1024: every tile keeps the swizzle
constexpr int kRedLd = kBN + 4;               // partial-tile row stride (floats): no bank conflict
static_assert(BM == 16 || BM == 32 || BM == 64 || BM == 128, "BM is 16, 32, 64 or 128");
static_assert(STAGES >= 2, "a pipeline needs two stages");
static_assert(STAGES * kStageBytes >= BM * kRedLd * 4, "the partial tile reuses the pipeline");

// 16-byte chunk `chunk` (0..7) of row `row` of a 1024-byte-aligned tile of 128-byte rows: the
// 128-byte swizzle (chunk ^ row % 8).
__device__ __forceinline__ unsigned swizzled(unsigned base, int row, int chunk) {
  return base + row * kBK + ((chunk ^ (row & 7)) << 4);
}

// A wgmma shared-memory descriptor of a K-major operand in that layout: 8-row groups 1024 bytes
// apart (stride byte offset), 128-byte swizzle; the leading byte offset is unused by it.
__device__ __forceinline__ unsigned long long smem_desc(unsigned addr) {
  return static_cast<unsigned long long>((addr & 0x3ffff) >> 4) | (1ull << 16) |
         (64ull << 32) | (1ull << 62);
}

__device__ __forceinline__ void cp_async16(unsigned dst, const void* src, bool valid) {
  const int bytes = valid ? 16 : 0;  // 0: zero-fill, nothing read
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(bytes)
               : "memory");
}

#if RECIPE == 2
__device__ __forceinline__ void cp_async4(unsigned dst, const void* src, bool valid) {
  const int bytes = valid ? 4 : 0;
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(bytes)
               : "memory");
}
#endif

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n"); }

template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// The copies this thread completed become visible to the tensor cores' (async proxy) reads.
__device__ __forceinline__ void fence_proxy_async() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n"); }
__device__ __forceinline__ void wgmma_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n");
}
__device__ __forceinline__ void wgmma_wait_all() {
  asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
}

// Reads of the accumulators stay after the wait (the compiler sees the wgmma's outputs at its
// issue, not at its completion).
__device__ __forceinline__ void fence_operands(float (&d)[kAcc]) {
#pragma unroll
  for (int i = 0; i < kAcc; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

#define CK_FP8_NAME_3 "e4m3"
#define CK_FP8_NAME_4 "e5m2"
#define CK_FP8_NAME(x) CK_FP8_NAME_##x
#define CK_FP8(x) CK_FP8_NAME(x)

// d (m64 x BM, float32) = or += w-tile (64 x 32, K-major) x x-tile (BM x 32, K-major)^T.
#if BM == 16
__device__ __forceinline__ void wgmma_k32(float (&d)[BM / 2], unsigned long long desc_w,
                                          unsigned long long desc_x, int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %10, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n16k32.f32." CK_FP8(ELEM_B) "." CK_FP8(ELEM_A) " "
      "{%0, %1, %2, %3, %4, %5, %6, %7}, %8, %9, p, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]),
        "+f"(d[6]), "+f"(d[7])
      : "l"(desc_w), "l"(desc_x), "r"(accumulate));
}
#elif BM == 32
__device__ __forceinline__ void wgmma_k32(float (&d)[BM / 2], unsigned long long desc_w,
                                          unsigned long long desc_x, int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n32k32.f32." CK_FP8(ELEM_B) "." CK_FP8(ELEM_A) " "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, %16, %17, p, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]),
        "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]),
        "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
      : "l"(desc_w), "l"(desc_x), "r"(accumulate));
}
#elif BM == 64
__device__ __forceinline__ void wgmma_k32(float (&d)[BM / 2], unsigned long long desc_w,
                                          unsigned long long desc_x, int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k32.f32." CK_FP8(ELEM_B) "." CK_FP8(ELEM_A) " "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]),
        "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]),
        "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]),
        "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]),
        "+f"(d[30]), "+f"(d[31])
      : "l"(desc_w), "l"(desc_x), "r"(accumulate));
}
#elif BM == 128
__device__ __forceinline__ void wgmma_k32(float (&d)[BM / 2], unsigned long long desc_w,
                                          unsigned long long desc_x, int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k32.f32." CK_FP8(ELEM_B) "." CK_FP8(ELEM_A) " "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]),
        "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]),
        "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]),
        "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]),
        "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]),
        "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]),
        "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
        "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]),
        "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]),
        "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "l"(desc_w), "l"(desc_x), "r"(accumulate));
}
#endif

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
  extern __shared__ unsigned char smem_raw[];
#if RECIPE == 2
  __shared__ float sa_stage[STAGES][BM];  // scale_a of the stage's rows
  __shared__ float sb_stage[STAGES];      // scale_b of the stage's block
#endif

  cg::cluster_group cluster = cg::this_cluster();
  const int splits = static_cast<int>(gridDim.x);  // the cluster spans the grid's x
  const int split = static_cast<int>(blockIdx.x);
  const int n0 = static_cast<int>(blockIdx.y) * kBN;
  const long long m0 = static_cast<long long>(blockIdx.z) * BM;
  const int tid = threadIdx.x;
  const int half = tid >> 7;  // this warpgroup's 64 weight rows
  const int warp = (tid >> 5) & 3, lane = tid & 31;
  const int group = lane >> 2, quad = lane & 3;
  const int blocks_k = static_cast<int>(k_total / kBK);
  const int kb_begin = split * blocks_k / splits;
  const int kb_count = (split + 1) * blocks_k / splits - kb_begin;

  // The swizzle is a function of the address: tiles start on 1024-byte boundaries (the launcher
  // adds 1024 bytes of slack).
  const unsigned raw = static_cast<unsigned>(__cvta_generic_to_shared(smem_raw));
  const unsigned smem_base = (raw + 1023u) & ~1023u;
  unsigned char* smem = smem_raw + (smem_base - raw);

  auto load_stage = [&](int stage, int kb) {
    const unsigned sx = smem_base + stage * kStageBytes;
    const unsigned sw = sx + kTileX;
    const long long k0 = static_cast<long long>(kb) * kBK;
#pragma unroll
    for (int c = tid; c < BM * 8; c += kThreads) {
      const int row = c >> 3, chunk = c & 7;
      const bool valid = m0 + row < m_total;
      const unsigned char* src = a + (valid ? (m0 + row) * lda : 0) + k0 + chunk * 16;
      cp_async16(swizzled(sx, row, chunk), src, valid);
    }
#pragma unroll
    for (int c = tid; c < kBN * 8; c += kThreads) {
      const int row = c >> 3, chunk = c & 7;
      cp_async16(swizzled(sw, row, chunk), b + (n0 + row) * ldb + k0 + chunk * 16, true);
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

  float acc[kAcc], part[kAcc];
#pragma unroll
  for (int i = 0; i < kAcc; ++i) acc[i] = 0.0f;

#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < kb_count) load_stage(s, kb_begin + s);
    cp_async_commit();
  }

  for (int i = 0; i < kb_count; ++i) {
    cp_async_wait<STAGES - 2>();
    fence_proxy_async();
    __syncthreads();  // the stage is complete for every thread; stage i-1 is free to refill
    const int next = i + STAGES - 1;
    if (next < kb_count) load_stage(next % STAGES, kb_begin + next);
    cp_async_commit();

    const int stage = i % STAGES;
    const unsigned sx = smem_base + stage * kStageBytes;
    const unsigned sw = sx + kTileX + half * (kTileW / 2);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kBK / 32; ++kk)
      wgmma_k32(part, smem_desc(sw + kk * 32), smem_desc(sx + kk * 32), kk);
    wgmma_commit();
    wgmma_wait_all();
    fence_operands(part);
    // Promotion: the block's tensor-core sum joins the float32 accumulator. part[4j + e] is
    // weight row 16 * warp + group (+ 8 for e >= 2), token 8j + 2 * quad + (e & 1).
#pragma unroll
    for (int j = 0; j < kAcc / 4; ++j) {
#if RECIPE == 2
      const float f0 = sa_stage[stage][8 * j + 2 * quad] * sb_stage[stage];
      const float f1 = sa_stage[stage][8 * j + 2 * quad + 1] * sb_stage[stage];
#else
      const float f0 = 1.0f, f1 = 1.0f;
#endif
      acc[4 * j] = fmaf(part[4 * j], f0, acc[4 * j]);
      acc[4 * j + 1] = fmaf(part[4 * j + 1], f1, acc[4 * j + 1]);
      acc[4 * j + 2] = fmaf(part[4 * j + 2], f0, acc[4 * j + 2]);
      acc[4 * j + 3] = fmaf(part[4 * j + 3], f1, acc[4 * j + 3]);
    }
  }
  cp_async_wait<0>();
  __syncthreads();  // the pipeline's memory becomes this block's partial tile, token-major

  float* partial = reinterpret_cast<float*>(smem);
  {
    const int row = half * 64 + warp * 16 + group;
#pragma unroll
    for (int j = 0; j < kAcc / 4; ++j) {
      const int token = 8 * j + 2 * quad;
      partial[token * kRedLd + row] = acc[4 * j];
      partial[(token + 1) * kRedLd + row] = acc[4 * j + 1];
      partial[token * kRedLd + row + 8] = acc[4 * j + 2];
      partial[(token + 1) * kRedLd + row + 8] = acc[4 * j + 3];
    }
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
  const int first = split * kGroups / splits, last = (split + 1) * kGroups / splits;
  for (int g = first + tid; g < last; g += kThreads) {
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
