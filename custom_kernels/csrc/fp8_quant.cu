// FP8 quantization with dynamic scaling: x (R, C) in T (float, half, bfloat16; rows through their
// stride ld_x, unit last stride) to q (R, C) and / or qt = the quantization of x^T (C, R), both
// row-major contiguous bytes of e4m3 or e5m2, with float32 dequantization scales. The Python side
// (custom_kernels/fp8/fp8_quant.py) documents the rule; per group of elements that share a scale:
//
//   amax  = the largest |v| of the group, as the bits of |v| (sign cleared): unsigned order is
//           float order for non-negative floats, and a NaN's bits sit above inf's, so integer
//           max propagates NaN where fmaxf would drop it (atomicMax works on the same bits);
//   inv   = FP8_MAX / amax (IEEE division, once a group), 1.0f where amax is 0, FLT_MAX where
//           the quotient overflows (NaN stays NaN); scale = 1 / inv (IEEE): the dequantization
//           multiplier (fp8_common.cuh's fp8_factor_of);
//   q     = cvt.rn.satfinite(v * inv) (one rounded product): round to nearest even, saturated
//           to +-FP8_MAX, NaN kept: torch's cast of clamp(v * inv, -FP8_MAX, FP8_MAX), bit for
//           bit. A product an element: a quotient an element kept these kernels issue-bound.
//
// MODE (the granularity): 0 tensor, 1 row, 2 block_1x128, 3 block_128x128 (a group is the
// tensor, a row of the quantized matrix, a row's 128-column chunk, a 128x128 block).
//
// Kernels:
// - fp8_amax_kernel: amaxes that no block can see whole, into zeroed device buffers with
//   atomicMax (AMAX bit 1: the tensor's, bit 2: each row's, bit 4: each column's). A thread owns
//   one slot (EPT consecutive columns) down rows_per_block rows.
// - fp8_quant_rows_kernel: q from x, one read for MODE 1 and 2: a team of 1 << shift threads owns
//   a group (a row, or a row's 128 columns), keeps up to NV slots a thread in registers, reduces
//   the amax across the team (shuffles, then shared memory past a warp), writes the scale and q.
//   Rows longer than team * NV slots are read again past that (from L2). MODE 0 reads the
//   tensor's amax from fp8_amax_kernel's buffer instead of reducing.
// - fp8_quant_tiles_kernel: a block owns a 128x128 tile of x, read once (coalesced, 16-byte
//   accesses where aligned) into shared memory; MODE 2 and 3 reduce their amaxes inside the tile
//   (each tile row's and each tile column's 128 values, or the whole tile), MODE 0 and 1 read
//   fp8_amax_kernel's buffers. WRITE_Q writes q rows from the tile (EPT bytes a thread,
//   coalesced); WRITE_QT writes qt: a lane owns one tile column (one qt row), reads it from shared
//   memory (consecutive lanes, consecutive addresses: no bank conflict) and writes 16 bytes at a
//   time along its qt row. Both from one read of x for quantize_pair.
// - fp8_quant_tiles_once_kernel: MODE 0 and 3 with VEC (one scale covers a tile): a tile's values
//   quantized once, from registers; q stored from them, qt as q's bytes transposed in shared
//   memory (see the kernel).
//
// Scale layouts written (scale: q's, scale_t: qt's): MODE 0 one float; MODE 1 one a row of the
// quantized matrix; MODE 2 (rows, cols / 128) column-major, element (r, g) at g * rows + r;
// MODE 3 (rows / 128, cols / 128) row-major.
//
// Defines: DTYPE 0 fp32 / 1 fp16 / 2 bf16; FP8 3 e4m3 / 4 e5m2 and FP8_MAX its largest value
// (custom_kernels.core.elements' codes, torch.finfo's maximum); MODE; VEC 1 when C, ld_x and x's
// pointer allow 16-byte loads (else one element an access; q's stores follow); BLOCK threads
// (rows and amax kernels; the tile kernel runs TILE_THREADS); NV; AMAX; WRITE_Q / WRITE_QT.
// Scalar parameters are 64-bit, as cuda.core packs Python ints; indices are 64-bit throughout.
#include "fp8_common.cuh"  // the group maxima; norm_common.cuh's vectors and element types
#include <cuda_fp8.h>

#ifndef DTYPE
#define DTYPE 2
#endif
#ifndef FP8
#define FP8 3
#endif
#ifndef FP8_MAX
#define FP8_MAX 448.0f
#endif
#ifndef MODE
#define MODE 1
#endif
#ifndef VEC
#define VEC 1
#endif
#ifndef BLOCK
#define BLOCK 256
#endif
#ifndef NV
#define NV 8
#endif
#ifndef AMAX
#define AMAX 1
#endif
#ifndef WRITE_Q
#define WRITE_Q 1
#endif
#ifndef WRITE_QT
#define WRITE_QT 0
#endif

namespace fp8q {

using T = typename ck::DType<DTYPE>::type;
constexpr int EPT = 16 / static_cast<int>(sizeof(T));  // elements of a slot: one 16-byte vector
using V = ck::Vec<T, EPT>;
constexpr __nv_fp8_interpretation_t KIND = FP8 == 4 ? __NV_E5M2 : __NV_E4M3;
constexpr int TILE = 128;
constexpr int TILE_THREADS = 256;
constexpr int VPR = TILE / EPT;  // slots in a tile row
// Blocks an SM keeps of fp8_quant_tiles_once_kernel: for 16-bit x at most 64 registers a
// thread, still a thread's eight 16-byte loads in flight (unbounded, ptxas spends registers
// down to 2 blocks an SM); float32 x holds sixteen slots a thread and keeps 2 blocks.
constexpr int ONCE_BLOCKS = sizeof(T) == 4 ? 2 : 4;

struct alignas(EPT) Bytes {
  unsigned char b[EPT];
};

using ck::abs_bits;
using ck::lanes_max;
using ck::team_max;

using ck::Fp8Factor;

__device__ __forceinline__ Fp8Factor factor_of(unsigned amax) {
  return ck::fp8_factor_of(amax, FP8_MAX);
}

__device__ __forceinline__ unsigned slot_max(const V& v) {
  unsigned m = 0;
#pragma unroll
  for (int j = 0; j < EPT; ++j) m = max(m, abs_bits(ck::elem_float(v, j)));
  return m;
}

__device__ __forceinline__ void zero(V& v) {
#pragma unroll
  for (int j = 0; j < EPT; ++j) v.v[j] = ck::from_float<T>(0.0f);
}

// The slot of `row` at column c (c % EPT == 0): one 16-byte load with VEC (the caller's extent is
// a multiple of EPT then), else element by element with zeros at and past `extent`.
__device__ __forceinline__ void load_slot(V& v, const T* row, long long c, long long extent) {
  if constexpr (VEC) {
    ck::load(v, row + c);
  } else {
#pragma unroll
    for (int j = 0; j < EPT; ++j) v.v[j] = c + j < extent ? row[c + j] : ck::from_float<T>(0.0f);
  }
}

// EPT values times the group's inv, converted two a cvt (the first in the low byte).
__device__ __forceinline__ Bytes quantize_slot(const V& v, const Fp8Factor& factor) {
  Bytes out;
#pragma unroll
  for (int j = 0; j < EPT; j += 2) {
    const float2 f = make_float2(__fmul_rn(ck::elem_float(v, j), factor.inv),
                                 __fmul_rn(ck::elem_float(v, j + 1), factor.inv));
    const __nv_fp8x2_storage_t pair = __nv_cvt_float2_to_fp8x2(f, __NV_SATFINITE, KIND);
    out.b[j] = static_cast<unsigned char>(pair & 0xff);
    out.b[j + 1] = static_cast<unsigned char>(pair >> 8);
  }
  return out;
}

__device__ __forceinline__ void store_slot(unsigned char* row, long long c, long long extent,
                                           const Bytes& b) {
  if constexpr (VEC) {
    *reinterpret_cast<Bytes*>(row + c) = b;
  } else {
#pragma unroll
    for (int j = 0; j < EPT; ++j)
      if (c + j < extent) row[c + j] = b.b[j];
  }
}

}  // namespace fp8q

using namespace fp8q;

// amax_all[0], amax_rows[r], amax_cols[c]: atomicMax of |x| bits (zeroed buffers; AMAX bits 1,
// 2, 4 choose which). Grid: x over slots of BLOCK threads, y over groups of rows_per_block rows.
extern "C" __global__ void __launch_bounds__(BLOCK)
fp8_amax_kernel(const T* __restrict__ x, unsigned* __restrict__ amax_all,
                unsigned* __restrict__ amax_rows, unsigned* __restrict__ amax_cols,
                long long rows, long long cols, long long ld_x, long long rows_per_block) {
  __shared__ unsigned red[BLOCK / 32];
  const long long c = (static_cast<long long>(blockIdx.x) * BLOCK + threadIdx.x) * EPT;
  const bool in = c < cols;
  unsigned col_m[EPT];
#pragma unroll
  for (int j = 0; j < EPT; ++j) col_m[j] = 0;
  unsigned all_m = 0;
  for (long long r0 = blockIdx.y * rows_per_block; r0 < rows;
       r0 += static_cast<long long>(gridDim.y) * rows_per_block) {
    const long long end = min(r0 + rows_per_block, rows);
#pragma unroll 4
    for (long long r = r0; r < end; ++r) {
      V v;
      if (in) load_slot(v, x + r * ld_x, c, cols); else zero(v);
      unsigned row_m = 0;
#pragma unroll
      for (int j = 0; j < EPT; ++j) {
        const unsigned b = abs_bits(ck::elem_float(v, j));
        if constexpr ((AMAX & 4) != 0) col_m[j] = max(col_m[j], b);
        row_m = max(row_m, b);
      }
      all_m = max(all_m, row_m);
      if constexpr ((AMAX & 2) != 0) {
        row_m = lanes_max(row_m, 32);
        if ((threadIdx.x & 31) == 0 && row_m) atomicMax(amax_rows + r, row_m);
      }
    }
  }
  if constexpr ((AMAX & 4) != 0) {
#pragma unroll
    for (int j = 0; j < EPT; ++j)
      if (in && c + j < cols && col_m[j]) atomicMax(amax_cols + c + j, col_m[j]);
  }
  if constexpr ((AMAX & 1) != 0) {
    all_m = team_max<BLOCK>(all_m, BLOCK, red);
    if (threadIdx.x == 0 && all_m) atomicMax(amax_all, all_m);
  }
}

// q from x a group at a time (MODE 0: rows with the tensor's scale; 1: rows; 2: 128-column
// chunks), a team of 1 << shift threads a group; group_cols: the group's width (cols, or 128).
extern "C" __global__ void __launch_bounds__(BLOCK)
fp8_quant_rows_kernel(const T* __restrict__ x, unsigned char* __restrict__ q,
                      float* __restrict__ scale, const unsigned* __restrict__ amax_all,
                      long long rows, long long cols, long long ld_x, long long group_cols,
                      long long shift) {
  __shared__ unsigned red[BLOCK / 32];
  const int team = 1 << shift;
  const int lane = threadIdx.x & (team - 1);
  const int teams = BLOCK >> shift;
  const long long per_row = cols / group_cols;
  const long long groups = rows * per_row;
  Fp8Factor tensor_factor{1.0f, 1.0f};
  if constexpr (MODE == 0) {
    tensor_factor = factor_of(*amax_all);
    if (blockIdx.x == 0 && threadIdx.x == 0) *scale = tensor_factor.scale;
  }
  for (long long base = static_cast<long long>(blockIdx.x) * teams; base < groups;
       base += static_cast<long long>(gridDim.x) * teams) {  // uniform over the block
    const long long gid = base + (threadIdx.x >> shift);
    const bool active = gid < groups;
    const long long r = active ? gid / per_row : 0, g = active ? gid % per_row : 0;
    const T* src = x + r * ld_x + g * group_cols;
    unsigned char* dst = q + r * cols + g * group_cols;
    const long long step = static_cast<long long>(team) * EPT;
    V keep[NV];
    unsigned m = 0;
#pragma unroll
    for (int k = 0; k < NV; ++k) {
      const long long c = k * step + lane * EPT;
      if (active && c < group_cols) {
        load_slot(keep[k], src, c, group_cols);
        m = max(m, slot_max(keep[k]));
      }
    }
    for (long long c = NV * step + lane * EPT; active && c < group_cols; c += step) {
      V v;
      load_slot(v, src, c, group_cols);
      m = max(m, slot_max(v));
    }
    Fp8Factor s = tensor_factor;
    if constexpr (MODE != 0) {
      s = factor_of(team_max<BLOCK>(m, team, red));
      if (active && lane == 0) scale[MODE == 2 ? g * rows + r : r] = s.scale;
    }
#pragma unroll
    for (int k = 0; k < NV; ++k) {
      const long long c = k * step + lane * EPT;
      if (active && c < group_cols) store_slot(dst, c, group_cols, quantize_slot(keep[k], s));
    }
    for (long long c = NV * step + lane * EPT; active && c < group_cols; c += step) {
      V v;
      load_slot(v, src, c, group_cols);
      store_slot(dst, c, group_cols, quantize_slot(v, s));
    }
  }
}

namespace fp8q {

// A 128x128 tile's scales: what the tile kernel's write phases read.
struct TileScales {
  Fp8Factor all;             // MODE 0 and 3
  const unsigned* row_amax;  // MODE 1: amax_rows + r0; MODE 2: the tile rows' (shared memory)
  const unsigned* col_amax;  // MODE 1: amax_cols + c0 (MODE 2 reduces its columns itself)
};

// Writes q's rows [r0, r0 + nr) x [c0, c0 + nc) from the tile, and their scales.
__device__ __forceinline__ void write_q(const T* tile, const TileScales& ts, unsigned char* q,
                                        float* scale, long long rows, long long cols,
                                        long long r0, long long c0, int nr, int nc,
                                        long long tile_index) {
  for (int i = threadIdx.x; i < TILE * VPR; i += TILE_THREADS) {
    const int rr = i / VPR, cc = (i % VPR) * EPT;
    if (rr >= nr || cc >= nc) continue;
    const Fp8Factor s = MODE == 1 || MODE == 2 ? factor_of(ts.row_amax[rr]) : ts.all;
    V v;
    ck::load(v, tile + rr * TILE + cc);
    store_slot(q + (r0 + rr) * cols + c0, cc, nc, quantize_slot(v, s));
    if (cc == 0) {
      if constexpr (MODE == 1) {
        if (c0 == 0) scale[r0 + rr] = s.scale;
      } else if constexpr (MODE == 2) {
        scale[(c0 / TILE) * rows + r0 + rr] = s.scale;
      }
    }
  }
  if constexpr (MODE == 0 || MODE == 3) {
    if (threadIdx.x == 0 && (MODE == 3 || tile_index == 0)) scale[tile_index] = ts.all.scale;
  }
}

// Writes qt's rows [c0, c0 + nc) x columns [r0, r0 + nr) from the tile, and their scales: a lane
// owns one tile column, a warp 32 columns and half of the tile's rows.
__device__ __forceinline__ void write_qt(const T* tile, const TileScales& ts,
                                         unsigned (*col_half)[TILE], unsigned char* qt, float* scale_t, long long rows,
                                         long long cols, long long r0, long long c0, int nr,
                                         int nc, long long tile_t_index) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int col = (warp & 3) * 32 + lane, half = warp >> 2, rbeg = half * (TILE / 2);
  Fp8Factor s = ts.all;
  if constexpr (MODE == 1) {
    if (col < nc) s = factor_of(ts.col_amax[col]);
  } else if constexpr (MODE == 2) {  // the column's 128 values: both halves' maxima
    unsigned m = 0;
    for (int rr = rbeg; rr < rbeg + TILE / 2; ++rr)
      m = max(m, abs_bits(ck::to_float(tile[rr * TILE + col])));
    col_half[half][col] = m;
    __syncthreads();
    s = factor_of(max(col_half[0][col], col_half[1][col]));
  }
  if (col < nc && half == 0) {
    if constexpr (MODE == 1) {
      if (r0 == 0) scale_t[c0 + col] = s.scale;
    } else if constexpr (MODE == 2) {
      scale_t[(r0 / TILE) * cols + c0 + col] = s.scale;
    }
  }
  if constexpr (MODE == 0 || MODE == 3) {
    if (threadIdx.x == 0 && (MODE == 3 || tile_t_index == 0)) scale_t[tile_t_index] = s.scale;
  }
  if (col >= nc) return;
  unsigned char* dst = qt + (c0 + col) * rows + r0;
  const bool whole = (rows & 15) == 0;  // 16-byte stores stay aligned along qt's rows
  for (int rr = rbeg; rr < rbeg + TILE / 2 && rr < nr; rr += 16) {
    alignas(16) unsigned char b[16];
#pragma unroll
    for (int j = 0; j < 16; j += 2) {
      const float2 f = make_float2(__fmul_rn(ck::to_float(tile[(rr + j) * TILE + col]), s.inv),
                                   __fmul_rn(ck::to_float(tile[(rr + j + 1) * TILE + col]), s.inv));
      const __nv_fp8x2_storage_t pair = __nv_cvt_float2_to_fp8x2(f, __NV_SATFINITE, KIND);
      b[j] = static_cast<unsigned char>(pair & 0xff);
      b[j + 1] = static_cast<unsigned char>(pair >> 8);
    }
    if (whole && rr + 16 <= nr) {
      *reinterpret_cast<uint4*>(dst + rr) = *reinterpret_cast<const uint4*>(b);
    } else {
      for (int j = 0; j < 16 && rr + j < nr; ++j) dst[rr + j] = b[j];
    }
  }
}

}  // namespace fp8q

// q and / or qt a 128x128 tile of x at a time (grid-stride over tiles, TILE * TILE * sizeof(T)
// bytes of dynamic shared memory). amax_all (MODE 0), amax_rows / amax_cols (MODE 1): buffers
// fp8_amax_kernel filled. Tiles at the right and bottom edges are partial (MODE 0 and 1 only).
extern "C" __global__ void __launch_bounds__(TILE_THREADS)
fp8_quant_tiles_kernel(const T* __restrict__ x, unsigned char* __restrict__ q,
                       unsigned char* __restrict__ qt, float* __restrict__ scale,
                       float* __restrict__ scale_t, const unsigned* __restrict__ amax_all,
                       const unsigned* __restrict__ amax_rows,
                       const unsigned* __restrict__ amax_cols, long long rows, long long cols,
                       long long ld_x) {
  extern __shared__ __align__(16) unsigned char smem[];
  T* tile = reinterpret_cast<T*>(smem);
  __shared__ unsigned row_max[TILE];
  __shared__ unsigned col_half[2][TILE];
  __shared__ unsigned red[TILE_THREADS / 32];
  const long long tiles_r = (rows + TILE - 1) / TILE, tiles_c = (cols + TILE - 1) / TILE;
  for (long long t = blockIdx.x; t < tiles_r * tiles_c; t += gridDim.x) {
    const long long tr = t / tiles_c, tc = t % tiles_c, r0 = tr * TILE, c0 = tc * TILE;
    const int nr = static_cast<int>(min(static_cast<long long>(TILE), rows - r0));
    const int nc = static_cast<int>(min(static_cast<long long>(TILE), cols - c0));
    __syncthreads();  // the previous tile's reads of shared memory are done
    unsigned m = 0;
    for (int i = threadIdx.x; i < TILE * VPR; i += TILE_THREADS) {  // the same count per thread
      const int rr = i / VPR, cc = (i % VPR) * EPT;
      V v;
      if (rr < nr && cc < nc) load_slot(v, x + (r0 + rr) * ld_x + c0, cc, nc); else zero(v);
      ck::store(tile + rr * TILE + cc, v);
      unsigned vm = slot_max(v);
      m = max(m, vm);
      if constexpr (MODE == 2 && WRITE_Q) {  // VPR consecutive lanes hold a tile row
        vm = lanes_max(vm, VPR);
        if (cc == 0) row_max[rr] = vm;
      }
    }
    TileScales ts{{1.0f, 1.0f}, nullptr, nullptr};
    if constexpr (MODE == 0) {
      ts.all = factor_of(*amax_all);
    } else if constexpr (MODE == 1) {
      if constexpr (WRITE_Q) ts.row_amax = amax_rows + r0;
      if constexpr (WRITE_QT) ts.col_amax = amax_cols + c0;
    } else if constexpr (MODE == 2) {
      ts.row_amax = row_max;
    } else {
      ts.all = factor_of(team_max<TILE_THREADS>(m, TILE_THREADS, red));
    }
    __syncthreads();  // the tile (and row_max) are in shared memory
    if constexpr (WRITE_Q) write_q(tile, ts, q, scale, rows, cols, r0, c0, nr, nc, t);
    if constexpr (WRITE_QT)
      write_qt(tile, ts, col_half, qt, scale_t, rows, cols, r0, c0, nr, nc, tc * tiles_r + tr);
  }
}

// MODE 0 (the tensor's scale, from fp8_amax_kernel's amax_all) and MODE 3 (each 128x128 tile's
// own), VEC inputs: a block owns a 128x128 tile and quantizes each value once, from registers
// (a thread's slots all loaded before any is used: eight 16-byte loads in flight for 16-bit x).
// WRITE_Q stores q straight from those registers; WRITE_QT stores the tile's FP8 bytes in shared
// memory (16 KB, a quarter of the tile kernel's float32 tile) and writes qt from them: qt is q
// transposed, as one scale covers both. A warp owns 16 tile rows, a lane 4 tile columns: 16
// conflict-free 4-byte reads, a 16x4 byte transpose in registers (byte permutes), four 16-byte
// stores along qt's rows. Half the shared memory and none of the float work of
// fp8_quant_tiles_kernel's qt phase, which quantizes every value a second time.
extern "C" __global__ void __launch_bounds__(TILE_THREADS, ONCE_BLOCKS)
fp8_quant_tiles_once_kernel(const T* __restrict__ x, unsigned char* __restrict__ q,
                            unsigned char* __restrict__ qt, float* __restrict__ scale,
                            float* __restrict__ scale_t, const unsigned* __restrict__ amax_all,
                            long long rows, long long cols, long long ld_x) {
  constexpr int SLOTS = TILE * VPR / TILE_THREADS;  // a thread's slots of a tile
  __shared__ __align__(16) unsigned char tile_bytes[WRITE_QT ? TILE * TILE : 16];
  __shared__ unsigned red[TILE_THREADS / 32];
  const long long tiles_r = (rows + TILE - 1) / TILE, tiles_c = (cols + TILE - 1) / TILE;
  Fp8Factor all{1.0f, 1.0f};
  if constexpr (MODE == 0) all = factor_of(*amax_all);
  for (long long t = blockIdx.x; t < tiles_r * tiles_c; t += gridDim.x) {
    const long long tr = t / tiles_c, tc = t % tiles_c, r0 = tr * TILE, c0 = tc * TILE;
    const int nr = static_cast<int>(min(static_cast<long long>(TILE), rows - r0));
    const int nc = static_cast<int>(min(static_cast<long long>(TILE), cols - c0));
    V v[SLOTS];
    unsigned m = 0;
#pragma unroll
    for (int k = 0; k < SLOTS; ++k) {
      const int i = threadIdx.x + k * TILE_THREADS, rr = i / VPR, cc = (i % VPR) * EPT;
      if (rr < nr && cc < nc) ck::load(v[k], x + (r0 + rr) * ld_x + c0 + cc); else zero(v[k]);
      if constexpr (MODE == 3) m = max(m, slot_max(v[k]));
    }
    Fp8Factor s = all;
    if constexpr (MODE == 3) {
      s = factor_of(team_max<TILE_THREADS>(m, TILE_THREADS, red));  // syncs: tile_bytes free
    } else if constexpr (WRITE_QT != 0) {
      __syncthreads();  // the previous tile's reads of tile_bytes are done
    }
#pragma unroll
    for (int k = 0; k < SLOTS; ++k) {
      const int i = threadIdx.x + k * TILE_THREADS, rr = i / VPR, cc = (i % VPR) * EPT;
      const Bytes b = quantize_slot(v[k], s);
      if constexpr (WRITE_Q) {
        if (rr < nr && cc < nc) *reinterpret_cast<Bytes*>(q + (r0 + rr) * cols + c0 + cc) = b;
      }
      if constexpr (WRITE_QT) *reinterpret_cast<Bytes*>(tile_bytes + rr * TILE + cc) = b;
    }
    if (threadIdx.x == 0) {
      if constexpr (MODE == 3) {
        if constexpr (WRITE_Q) scale[t] = s.scale;
        if constexpr (WRITE_QT) scale_t[tc * tiles_r + tr] = s.scale;
      } else if (t == 0) {
        if constexpr (WRITE_Q) *scale = s.scale;
        if constexpr (WRITE_QT) *scale_t = s.scale;
      }
    }
    if constexpr (WRITE_QT) {
      __syncthreads();  // the tile's bytes are in shared memory
      const int rb = (threadIdx.x >> 5) * 16, cb = (threadIdx.x & 31) * 4;
      if (rb < nr && cb < nc) {
        unsigned w[16];
#pragma unroll
        for (int j = 0; j < 16; ++j)
          w[j] = *reinterpret_cast<const unsigned*>(tile_bytes + (rb + j) * TILE + cb);
        // column c of the 16x4 block: byte c of each row's word, rows in order (low byte first)
        unsigned colw[4][4];
#pragma unroll
        for (int g = 0; g < 4; ++g) {
          const unsigned lo01 = __byte_perm(w[4 * g], w[4 * g + 1], 0x5140);
          const unsigned hi01 = __byte_perm(w[4 * g], w[4 * g + 1], 0x7362);
          const unsigned lo23 = __byte_perm(w[4 * g + 2], w[4 * g + 3], 0x5140);
          const unsigned hi23 = __byte_perm(w[4 * g + 2], w[4 * g + 3], 0x7362);
          colw[0][g] = __byte_perm(lo01, lo23, 0x5410);
          colw[1][g] = __byte_perm(lo01, lo23, 0x7632);
          colw[2][g] = __byte_perm(hi01, hi23, 0x5410);
          colw[3][g] = __byte_perm(hi01, hi23, 0x7632);
        }
        const bool whole = (rows & 15) == 0 && rb + 16 <= nr;
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          if (cb + c >= nc) break;
          unsigned char* dst = qt + (c0 + cb + c) * rows + r0 + rb;
          if (whole) {
            *reinterpret_cast<uint4*>(dst) = make_uint4(colw[c][0], colw[c][1], colw[c][2],
                                                        colw[c][3]);
          } else {
            for (int j = 0; j < 16 && rb + j < nr; ++j)
              dst[j] = static_cast<unsigned char>(colw[c][j >> 2] >> (8 * (j & 3)));
          }
        }
      }
    }
  }
}
