// Mixture-of-experts combine, forward and backward: each token's k expert outputs, read through
// the inverse of the expert sort, summed with the token's routing weights.
//
//   forward   out[t] = sum_j w[t, j] * rows[inv[t, j]]                  (float32, rounded once)
//   backward  d_rows[inv[t, j]] = w[t, j] * dout[t]                      (float32, rounded once)
//             d_w[t, j] = sum_h dout[t, h] * rows[inv[t, j], h]          (float32, rounded once)
//
// rows [P, H] are the experts' outputs in expert-sorted order (P = T * k), inv [T, k] the row
// that holds token t's j-th slot: a permutation of 0 .. P-1, so that every row of d_rows is
// written exactly once (the caller allocates it without zeroing). An entry outside [0, P) is
// neither read nor written (it contributes nothing, its d_w is 0): a broken routing gives a
// wrong result rather than a memory fault, which no host check could catch without a sync.
// This is what `pairs = zeros.index_copy(0, order, rows); (pairs.view(T, k, H).float() *
// w.float()[..., None]).sum(1)` computes, without the zero fill, the copy in pair order and the
// float32 [T, k, H] product; the backward pass replaces its gradient chain the same way.
//
// Layout: rows and dout are addressed through their own row strides (elements; unit last
// stride); out and d_rows are contiguous [., H]; inv and w (and d_w) contiguous [T, k]. A slot is
// VW elements (16 bytes, or one element when H, a row stride or a pointer does not allow 16).
//
// Grid: a token is a team of 1 << shift threads, the smallest power of two covering its slots (at
// most BLOCK), so that short rows put several tokens in a block; a 1-D grid of blocks of teams,
// looping over token groups past the launcher's grid cap. A thread owns the slots lane, lane +
// team, ...: its first NS (the launcher's ceil(slots / team), at most 4) in registers across the
// k pairs, any further ones each in a pass of its own (rows longer than 4 * BLOCK slots only).
//
// The forward pass keeps float accumulators for its slots while it walks the k pairs and writes
// each output once. The backward pass loads its dout slots once, then for each pair reads the
// rows slots (only when d_w is wanted), writes the d_rows slots (only when d_rows is wanted) and
// reduces the per-pair dot product over the team: warp shuffles, then, for teams past a warp,
// each warp's partial in shared memory [warp][j], summed after the pairs with one barrier (not
// one barrier a pair, which would stall the loads of the next pair behind each reduction).
//
// Defines: DTYPE (rows, out, dout, d_rows) and WDTYPE (w, d_w) 0 fp32 / 1 fp16 / 2 bf16;
// INDEX_BITS 32 or 64 (inv); VEC 1 for 16-byte slots; NS slots a thread in registers; BLOCK
// threads; MAX_TOP_K the largest k (the backward pass's shared memory). Scalar parameters are
// 64-bit, as cuda.core packs Python ints.
#include "norm_common.cuh"

#ifndef DTYPE
#define DTYPE 2
#endif
#ifndef WDTYPE
#define WDTYPE 2
#endif
#ifndef INDEX_BITS
#define INDEX_BITS 64
#endif
#ifndef VEC
#define VEC 1
#endif
#ifndef NS
#define NS 1
#endif
#ifndef BLOCK
#define BLOCK 256
#endif
#ifndef MAX_TOP_K
#define MAX_TOP_K 64
#endif
// Blocks an SM must fit: a register ceiling for ptxas (6 blocks: 42 a thread, 5: 51, 3: 85),
// for each NS the tightest at which no variant spills (NVRTC and nvcc 13, sm_90a; at 4 blocks
// the 16-bit forward kernels of 3 and 4 slots a thread spill). Left to itself, ptxas spilt the
// backward kernel of 4 bf16 slots a thread at 64 registers. Gathers want many loads in flight:
// occupancy for one slot a thread, independent loads in each thread for more. Not tuned on a GPU.
#define MIN_BLOCKS (NS == 1 ? 6 : NS == 2 ? 5 : 3)

namespace moe_combine {

using T = typename ck::DType<DTYPE>::type;
using W = typename ck::DType<WDTYPE>::type;
using Index = typename ck::Conditional<INDEX_BITS == 64, long long, int>::type;
constexpr int VW = VEC ? 16 / static_cast<int>(sizeof(T)) : 1;  // elements a slot
using V = ck::Vec<T, VW>;

// A thread's place: its team (one token of the block's group) and its lane in it.
struct Team {
  int size;   // threads a team, 1 << shift
  int lane;
  int count;  // teams a block
  int index;  // this thread's team in the block
};

__device__ __forceinline__ Team team_of(long long shift) {
  Team t;
  t.size = 1 << shift;
  t.lane = threadIdx.x & (t.size - 1);
  t.count = BLOCK >> shift;
  t.index = threadIdx.x >> shift;
  return t;
}

// The row a pair reads, or -1 for an entry outside [0, rows) (see the top).
__device__ __forceinline__ long long pair_row(const Index* inv, long long j, long long rows) {
  const long long p = static_cast<long long>(inv[j]);
  return static_cast<unsigned long long>(p) < static_cast<unsigned long long>(rows) ? p : -1;
}

// acc += w * x, element by element.
__device__ __forceinline__ void accumulate(float (&acc)[VW], float w, const V& x) {
#pragma unroll
  for (int e = 0; e < VW; ++e) acc[e] = fmaf(w, ck::elem_float(x, e), acc[e]);
}

__device__ __forceinline__ void store_rounded(T* p, const float (&acc)[VW]) {
  V out;
#pragma unroll
  for (int e = 0; e < VW; ++e) out.v[e] = ck::from_float<T>(acc[e]);
  ck::store(p, out);
}

// The pair's share of the backward pass for one slot: d_rows slot = w * dout slot (rounded once),
// dot += dout slot . rows slot.
__device__ __forceinline__ void backward_slot(const V& d, float w, const T* src, T* dst,
                                              float& dot) {
  if (dst != nullptr) {
    V g;
#pragma unroll
    for (int e = 0; e < VW; ++e) g.v[e] = ck::from_float<T>(w * ck::elem_float(d, e));
    ck::store(dst, g);
  }
  if (src != nullptr) {
    V x;
    ck::load(x, src);
#pragma unroll
    for (int e = 0; e < VW; ++e) dot = fmaf(ck::elem_float(d, e), ck::elem_float(x, e), dot);
  }
}

}  // namespace moe_combine

using namespace moe_combine;

// out[t] = sum_j w[t, j] * rows[inv[t, j]] (see the top).
extern "C" __global__ void __launch_bounds__(BLOCK, MIN_BLOCKS)
moe_combine_fwd_kernel(const T* __restrict__ rows, const Index* __restrict__ inv,
                       const W* __restrict__ w, T* __restrict__ out, long long tokens,
                       long long top_k, long long hidden, long long ld_rows, long long shift) {
  const Team team = team_of(shift);
  const long long slots = hidden / VW, num_rows = tokens * top_k;
  if (team.lane >= slots) return;  // no barrier or shuffle below: idle lanes may leave
  for (long long t = static_cast<long long>(blockIdx.x) * team.count + team.index; t < tokens;
       t += static_cast<long long>(gridDim.x) * team.count) {
    const Index* idx = inv + t * top_k;
    const W* wt = w + t * top_k;
    T* dst = out + t * hidden;
    float acc[NS][VW];
#pragma unroll
    for (int s = 0; s < NS; ++s)
#pragma unroll
      for (int e = 0; e < VW; ++e) acc[s][e] = 0.0f;
#pragma unroll 2
    for (long long j = 0; j < top_k; ++j) {
      const long long p = pair_row(idx, j, num_rows);
      if (p < 0) continue;
      const float wj = ck::to_float(wt[j]);
      const T* src = rows + p * ld_rows;
#pragma unroll
      for (int s = 0; s < NS; ++s) {
        const long long c = team.lane + static_cast<long long>(s) * team.size;
        if (c < slots) {
          V x;
          ck::load(x, src + c * VW);
          accumulate(acc[s], wj, x);
        }
      }
    }
#pragma unroll
    for (int s = 0; s < NS; ++s) {
      const long long c = team.lane + static_cast<long long>(s) * team.size;
      if (c < slots) store_rounded(dst + c * VW, acc[s]);
    }
    // Slots past NS a thread (rows of more than 4 * BLOCK slots): a pass over the pairs each.
    for (long long c = team.lane + static_cast<long long>(NS) * team.size; c < slots;
         c += team.size) {
      float more[VW];
#pragma unroll
      for (int e = 0; e < VW; ++e) more[e] = 0.0f;
      for (long long j = 0; j < top_k; ++j) {
        const long long p = pair_row(idx, j, num_rows);
        if (p < 0) continue;
        V x;
        ck::load(x, rows + p * ld_rows + c * VW);
        accumulate(more, ck::to_float(wt[j]), x);
      }
      store_rounded(dst + c * VW, more);
    }
  }
}

// d_rows[inv[t, j]] = w[t, j] * dout[t] and d_w[t, j] = dout[t] . rows[inv[t, j]] (see the
// top). d_rows or d_w null: that gradient is not wanted (neither written nor, for d_w, the rows
// read).
extern "C" __global__ void __launch_bounds__(BLOCK, MIN_BLOCKS)
moe_combine_bwd_kernel(const T* __restrict__ dout, const T* __restrict__ rows,
                       const Index* __restrict__ inv, const W* __restrict__ w,
                       T* __restrict__ d_rows, W* __restrict__ d_w, long long tokens,
                       long long top_k, long long hidden, long long ld_dout, long long ld_rows,
                       long long shift) {
  __shared__ float red[BLOCK / 32][MAX_TOP_K];  // each warp's partial dot of each pair
  const Team team = team_of(shift);
  const long long slots = hidden / VW, num_rows = tokens * top_k;
  const bool want_w = d_w != nullptr;
  const int warp = threadIdx.x >> 5, warps = team.size >> 5;
  // The loop bound is uniform over the block: every thread reaches each barrier and shuffle.
  for (long long base = static_cast<long long>(blockIdx.x) * team.count; base < tokens;
       base += static_cast<long long>(gridDim.x) * team.count) {
    const long long t = base + team.index;
    const bool active = t < tokens;
    const T* dy = dout + (active ? t : 0) * ld_dout;
    V keep[NS];
#pragma unroll
    for (int s = 0; s < NS; ++s) {
      const long long c = team.lane + static_cast<long long>(s) * team.size;
      if (active && c < slots) ck::load(keep[s], dy + c * VW);
    }
    if (want_w && warps > 1) __syncthreads();  // the previous group's reads of red are done
    for (long long j = 0; j < top_k; ++j) {
      const long long p = active ? pair_row(inv + t * top_k, j, num_rows) : -1;
      const float wj = p >= 0 ? ck::to_float(w[t * top_k + j]) : 0.0f;
      const T* src = p >= 0 && want_w ? rows + p * ld_rows : nullptr;
      T* dst = p >= 0 && d_rows != nullptr ? d_rows + p * hidden : nullptr;
      float dot = 0.0f;
      if (p >= 0) {
#pragma unroll
        for (int s = 0; s < NS; ++s) {
          const long long c = team.lane + static_cast<long long>(s) * team.size;
          if (c < slots)
            backward_slot(keep[s], wj, src ? src + c * VW : nullptr, dst ? dst + c * VW : nullptr,
                          dot);
        }
        for (long long c = team.lane + static_cast<long long>(NS) * team.size; c < slots;
             c += team.size) {  // past NS slots a thread: dout read again (L1 / L2)
          V d;
          ck::load(d, dy + c * VW);
          backward_slot(d, wj, src ? src + c * VW : nullptr, dst ? dst + c * VW : nullptr, dot);
        }
      }
      if (!want_w) continue;
      for (int off = (team.size < 32 ? team.size : 32) >> 1; off > 0; off >>= 1)
        dot += __shfl_xor_sync(0xffffffffu, dot, off);
      if (warps <= 1) {
        if (active && team.lane == 0) d_w[t * top_k + j] = ck::from_float<W>(dot);
      } else if ((threadIdx.x & 31) == 0) {
        red[warp][j] = dot;
      }
    }
    if (want_w && warps > 1) {
      __syncthreads();
      const int first = warp & ~(warps - 1);  // the team's first warp
      for (long long j = team.lane; active && j < top_k; j += team.size) {
        float dot = 0.0f;
        for (int k = 0; k < warps; ++k) dot += red[first + k][j];
        d_w[t * top_k + j] = ck::from_float<W>(dot);
      }
    }
  }
}
