// Per-segment sum (or mean) of ragged rows: values[T, D] holds S segments laid end to end,
// segment s being rows [offsets[s], offsets[s + 1]); out[s, :] = sum (or mean) of its rows.
//
// Load balance through the work queue, whatever the segment lengths: the rows are cut into
// warp chunks of R rows, regardless of where segments start. A block pulls a ticket, which is
// eight consecutive warp chunks of one column tile (32 lanes x VPT columns, 16 bytes a lane);
// each warp walks the segment pieces in its chunk:
//   - a segment that lies inside the chunk is summed and written out at once;
//   - a piece of a segment that crosses chunks is added in fp32 into acc[s, :] with atomics
//     (float4 atomics on sm_90), then counted in count[s]; the warp that adds the last piece
//     (pieces x column tiles arrive in all) writes out[s, :] from acc and zeroes acc[s, :] and
//     count[s], so both are zero again when the kernel ends (graph replays need no memset).
// So one very long segment is spread over every SM, and short ones cost no atomics. Tickets past
// the row tickets fill the outputs of empty segments with zeros (nothing else writes them).
//
// Offsets are clamped into [0, T] when read, so any offsets stay in bounds; they must be
// nondecreasing for a meaningful result (a decreasing pair is an empty segment).
//
// Defines: DTYPE 0 fp32 / 1 fp16 / 2 bf16 (values and out); OFFSET_BITS 32 or 64; VEC 1 when
// D, the row stride and the base address allow 16-byte accesses (else a scalar path); BLOCK.
// Scalar parameters are 64-bit, as cuda.core packs Python numbers.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "work_queue.cuh"

#ifndef DTYPE
#define DTYPE 2
#endif
#ifndef OFFSET_BITS
#define OFFSET_BITS 64
#endif
#ifndef VEC
#define VEC 1
#endif
#ifndef BLOCK
#define BLOCK 256
#endif

namespace ragged {

#if DTYPE == 0
using T = float;
#elif DTYPE == 1
using T = __half;
#else
using T = __nv_bfloat16;
#endif
#if OFFSET_BITS == 32
using OffsetT = int;
#else
using OffsetT = long long;
#endif

constexpr int kWarps = BLOCK / 32;
constexpr int VPT = 16 / sizeof(T);  // columns per lane
constexpr int W = 32 * VPT;          // columns per tile

__device__ __forceinline__ float to_f(float x) { return x; }
__device__ __forceinline__ float to_f(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_f(__nv_bfloat16 x) { return __bfloat162float(x); }
template <class U> __device__ __forceinline__ U from_f(float x);
template <> __device__ __forceinline__ float from_f<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_f<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

struct Args {
  const T* values;
  const OffsetT* offsets;
  T* out;
  float* acc;        // [S, D] fp32, zero between launches
  unsigned* count;   // [S], zero between launches
  long long rows;    // T
  long long ld;      // row stride of values, in elements
  long long d;       // D
  long long segments;
  long long chunk;   // R, rows per warp chunk
  long long tiles;   // column tiles
  long long mean;
};

__device__ __forceinline__ long long seg_bound(const Args& a, long long i) {
  const long long o = static_cast<long long>(__ldg(a.offsets + i));
  return o < 0 ? 0 : (o > a.rows ? a.rows : o);
}

// The last segment starting at or before row r (empty segments before it are skipped).
__device__ long long find_segment(const Args& a, long long r) {
  long long lo = 0, hi = a.segments;  // answer in [lo, hi)
  while (hi - lo > 1) {
    const long long mid = (lo + hi) >> 1;
    if (seg_bound(a, mid) <= r) lo = mid;
    else hi = mid;
  }
  return lo;
}

// acc[j] += rows [r0, r1) at this lane's columns.
__device__ void sum_rows(const Args& a, long long r0, long long r1, long long c0, float* acc) {
  const int lane = threadIdx.x & 31;
#if VEC
  const long long c = c0 + lane * VPT;
  if (c >= a.d) return;
  const T* p = a.values + r0 * a.ld + c;
  long long r = r0;
  for (; r + 4 <= r1; r += 4, p += 4 * a.ld) {
    uint4 u[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) u[k] = __ldg(reinterpret_cast<const uint4*>(p + k * a.ld));
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const T* e = reinterpret_cast<const T*>(&u[k]);
#pragma unroll
      for (int j = 0; j < VPT; ++j) acc[j] += to_f(e[j]);
    }
  }
  for (; r < r1; ++r, p += a.ld) {
    const uint4 u = __ldg(reinterpret_cast<const uint4*>(p));
    const T* e = reinterpret_cast<const T*>(&u);
#pragma unroll
    for (int j = 0; j < VPT; ++j) acc[j] += to_f(e[j]);
  }
#else
  for (long long r = r0; r < r1; ++r) {
    const T* p = a.values + r * a.ld;
#pragma unroll
    for (int j = 0; j < VPT; ++j) {
      const long long c = c0 + lane + 32 * j;
      if (c < a.d) acc[j] += to_f(__ldg(p + c));
    }
  }
#endif
}

__device__ __forceinline__ void write_row(const Args& a, long long s, long long c0,
                                          const float* acc, float scale) {
  const int lane = threadIdx.x & 31;
  T* o = a.out + s * a.d;
#if VEC
  const long long c = c0 + lane * VPT;
  if (c >= a.d) return;
  uint4 u;
  T* e = reinterpret_cast<T*>(&u);
#pragma unroll
  for (int j = 0; j < VPT; ++j) e[j] = from_f<T>(acc[j] * scale);
  *reinterpret_cast<uint4*>(o + c) = u;
#else
#pragma unroll
  for (int j = 0; j < VPT; ++j) {
    const long long c = c0 + lane + 32 * j;
    if (c < a.d) o[c] = from_f<T>(acc[j] * scale);
  }
#endif
}

__device__ __forceinline__ void add_partial(const Args& a, long long s, long long c0,
                                            const float* acc) {
  const int lane = threadIdx.x & 31;
  float* dst = a.acc + s * a.d;
#if VEC && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  const long long c = c0 + lane * VPT;
  if (c >= a.d) return;
#pragma unroll
  for (int j = 0; j < VPT; j += 4) {
    atomicAdd(reinterpret_cast<float4*>(dst + c + j),
              make_float4(acc[j], acc[j + 1], acc[j + 2], acc[j + 3]));
  }
#elif VEC
  const long long c = c0 + lane * VPT;
  if (c >= a.d) return;
#pragma unroll
  for (int j = 0; j < VPT; ++j) atomicAdd(dst + c + j, acc[j]);
#else
#pragma unroll
  for (int j = 0; j < VPT; ++j) {
    const long long c = c0 + lane + 32 * j;
    if (c < a.d) atomicAdd(dst + c, acc[j]);
  }
#endif
}

// The warp that added the last piece of segment s: out[s, :] = acc[s, :] * scale, then zero
// acc[s, :] and count[s]. acc is read at L2 (__ldcg), where the atomics were performed.
__device__ void finalize(const Args& a, long long s, float scale) {
  const int lane = threadIdx.x & 31;
  float* src = a.acc + s * a.d;
  T* o = a.out + s * a.d;
  for (long long c = lane; c < a.d; c += 32) {
    o[c] = from_f<T>(__ldcg(src + c) * scale);
    src[c] = 0.0f;
  }
  if (lane == 0) a.count[s] = 0u;
}

// One warp chunk: rows [r0, r1), column tile ct.
__device__ void warp_chunk(const Args& a, long long r0, long long r1, long long ct) {
  const long long c0 = ct * W;
  for (long long s = find_segment(a, r0); s < a.segments; ++s) {
    const long long lo = seg_bound(a, s);
    if (lo >= r1) break;
    const long long hi = seg_bound(a, s + 1);
    const long long pa = lo > r0 ? lo : r0, pb = hi < r1 ? hi : r1;
    if (pb <= pa) continue;
    float acc[VPT];
#pragma unroll
    for (int j = 0; j < VPT; ++j) acc[j] = 0.0f;
    sum_rows(a, pa, pb, c0, acc);
    const float scale = a.mean ? 1.0f / static_cast<float>(hi - lo) : 1.0f;
    if (lo >= r0 && hi <= r1) {
      write_row(a, s, c0, acc, scale);
      continue;
    }
    add_partial(a, s, c0, acc);
    __threadfence();
    __syncwarp();
    const unsigned expected =
        static_cast<unsigned>(((hi - 1) / a.chunk - lo / a.chunk + 1) * a.tiles);
    unsigned arrived = 0;
    if ((threadIdx.x & 31) == 0) arrived = atomicAdd(a.count + s, 1u);
    arrived = __shfl_sync(0xffffffffu, arrived, 0);
    if (arrived == expected - 1) {
      __threadfence();
      finalize(a, s, scale);
    }
  }
}

// Segments [g * BLOCK, (g + 1) * BLOCK): each warp zero-fills the rows of its empty segments.
__device__ void fill_empty(const Args& a, long long g) {
  const int lane = threadIdx.x & 31;
  const long long first = g * BLOCK + (threadIdx.x / 32) * 32;
  const long long s = first + lane;
  const bool empty = s < a.segments && seg_bound(a, s + 1) <= seg_bound(a, s);
  unsigned mask = __ballot_sync(0xffffffffu, empty);
  while (mask) {
    const int k = __ffs(mask) - 1;
    mask &= mask - 1;
    T* o = a.out + (first + k) * a.d;
    for (long long c = lane; c < a.d; c += 32) o[c] = from_f<T>(0.0f);
  }
}

}  // namespace ragged

using namespace ragged;

extern "C" __global__ void __launch_bounds__(BLOCK)
ragged_segment_reduce(const T* values, const OffsetT* offsets, T* out, float* acc,
                      unsigned* count, unsigned* counters, long long rows, long long ld,
                      long long d, long long segments, long long chunk, long long tiles,
                      long long mean, long long row_tickets, long long fill_tickets) {
  __shared__ unsigned slots[2];
  const Args a{values, offsets, out, acc, count, rows, ld, d, segments, chunk, tiles, mean};
  const long long tickets = row_tickets + fill_tickets;
  ck::BlockQueue q(counters, slots);
  for (unsigned t = q.begin(); t < tickets; t = q.advance()) {
    q.prefetch();
    if (t < row_tickets) {
      const long long ct = t % tiles;
      const long long wc = (t / tiles) * kWarps + threadIdx.x / 32;
      const long long r0 = wc * chunk;
      if (r0 < rows) warp_chunk(a, r0, r0 + chunk < rows ? r0 + chunk : rows, ct);
    } else {
      fill_empty(a, t - row_tickets);
    }
  }
  ck::finish(counters, 1);
}
