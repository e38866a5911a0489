// Mixture-of-experts routing in three launches forward and one backward: each token's top-k
// experts and weights from its router logits, then the (token, slot) pairs sorted by expert,
// stably and deterministically (no atomic decides an order).
//
//   scores    softmax  p_e = exp(l_e - max l) / sum_e' exp(l_e' - max l)          (float32)
//             sigmoid  p_e = 1 / (1 + exp(-l_e))
//   top-k     v_j, e_j: the k largest p, descending, ties to the lower expert index
//   weights   w_j = normalize ? v_j / sum_i v_i : v_j, rounded once to the logits' dtype
//   sort      the pairs (t, j), flattened as t * k + j, stably by e_j: token_of_row[row] = t,
//             inverse[t, j] = row, offsets[e] = pairs whose expert is <= e (cumulative ends)
//
// Launches (the same token partition for 1 and 3: block b owns tokens [b * chunk, (b + 1) *
// chunk), hence the pairs [b * chunk * k, ...) in flattened order):
//   1. moe_routing_topk_kernel: a warp a token (WARPS tokens a block at a time). Lane l holds
//      experts l, l + 32, ... (NE = ceil(E / 32) of them) in registers, computes their p (warp
//      max and sum for softmax), then k rounds of a warp arg-max over (p, then the lower index)
//      with redux.sync: the winner's lane marks it taken. Lane j writes weights[t, j] and
//      index[t, j] and counts its expert in the block's shared histogram (atomics on counts: the
//      count does not depend on their order), written out as hist[b][e] (every entry, no fill).
//   2. moe_routing_scan_kernel: one block, a thread an expert: its total over blocks, a block
//      scan over experts for its start, then base[b][e] = start[e] + the pairs of expert e in
//      blocks before b; offsets[e] = start[e] + total[e].
//   3. moe_routing_place_kernel: the block walks its pairs BLOCK at a time in flattened order;
//      a pair's rank among the block's pairs of its expert is the count from earlier chunks
//      (before[e]), plus the earlier warps' counts in this chunk (wcount[w][e], written by each
//      warp's leader of each expert found with __match_any_sync), plus the earlier lanes of its
//      own warp with the same expert. row = base[b][e] + rank.
// Backward, moe_routing_bwd_kernel, a warp a token: p recomputed from the logits, v_j read again
// for the selected experts, then in float32
//   dv_j = normalize ? (dw_j - sum_i dw_i w_i) / S : dw_j        (S = sum_i v_i, w_i = v_i / S)
//   dp_e = dv_j where e = e_j, else 0
//   dl_e = softmax ? p_e (dp_e - sum_j dv_j v_j) : dp_e p_e (1 - p_e), rounded once.
//
// Score keys: p >= 0 (or NaN), so the bits of a non-negative float order like the float; a NaN
// counts as the largest (torch.topk's order), and key + 1 leaves 0 for "nothing left".
//
// Defines: DTYPE (logits, weights, d_weights, d_logits) 0 fp32 / 1 fp16 / 2 bf16; NE experts a
// lane (E <= 32 * NE); WARPS warps a block of launches 1, 3 and the backward; SCAN_BLOCK threads
// of launch 2 (at least E). Scalar parameters are 64-bit, as cuda.core packs Python ints.
#include "norm_common.cuh"

#ifndef DTYPE
#define DTYPE 2
#endif
#ifndef NE
#define NE 4
#endif
#ifndef WARPS
#define WARPS 8
#endif
#ifndef SCAN_BLOCK
#define SCAN_BLOCK 1024
#endif

namespace moe_routing {

using T = typename ck::DType<DTYPE>::type;
constexpr int BLOCK = WARPS * 32;
constexpr int EMAX = 32 * NE;  // experts a warp's registers hold
constexpr unsigned FULL = 0xffffffffu;
constexpr unsigned NONE = 0xffffffffu;

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000u); }

__device__ __forceinline__ float warp_sum(float v) {
  // A butterfly: every lane ends with the same bits (each step adds the same two partials).
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(FULL, v, off);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) v = fmaxf(v, __shfl_xor_sync(FULL, v, off));
  return v;
}

// The score of logit l: softmax with the row's max m and sum s of exp(l - m), or sigmoid. The
// backward pass recomputes selected scores with this same function.
__device__ __forceinline__ float score(float l, float m, float s, bool softmax) {
  return softmax ? __fdiv_rn(expf(l - m), s) : __fdiv_rn(1.0f, 1.0f + expf(-l));
}

// The lane's scores p[i] of experts lane + 32 i (0 past E); m and s as score() takes them.
__device__ __forceinline__ void scores(const T* row, long long experts, int lane, bool softmax,
                                       float (&p)[NE], float& m, float& s) {
#pragma unroll
  for (int i = 0; i < NE; ++i) {
    const long long e = lane + 32 * i;
    p[i] = e < experts ? ck::to_float(row[e]) : neg_inf();
  }
  m = 0.0f;
  s = 1.0f;
  if (softmax) {
    float mx = neg_inf();
#pragma unroll
    for (int i = 0; i < NE; ++i) mx = fmaxf(mx, p[i]);
    m = warp_max(mx);
    float sum = 0.0f;
#pragma unroll
    for (int i = 0; i < NE; ++i) sum += lane + 32 * i < experts ? expf(p[i] - m) : 0.0f;
    s = warp_sum(sum);
  }
#pragma unroll
  for (int i = 0; i < NE; ++i)
    p[i] = lane + 32 * i < experts ? score(p[i], m, s, softmax) : 0.0f;
}

// The arg-max key of a score (see the top): larger key, larger score; 0 for none.
__device__ __forceinline__ unsigned key_of(float p) {
  return (p != p ? 0x7fc00000u : __float_as_uint(p)) + 1u;
}

}  // namespace moe_routing

using namespace moe_routing;

// Launch 1 (see the top): weights and index [T, k] (contiguous), hist [blocks][E].
extern "C" __global__ void __launch_bounds__(BLOCK)
moe_routing_topk_kernel(const T* __restrict__ logits, T* __restrict__ weights,
                        long long* __restrict__ index, int* __restrict__ hist, long long tokens,
                        long long experts, long long top_k, long long ld, long long chunk,
                        long long softmax, long long normalize) {
  __shared__ int counts[EMAX];
  for (int e = threadIdx.x; e < EMAX; e += BLOCK) counts[e] = 0;
  __syncthreads();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const long long first = static_cast<long long>(blockIdx.x) * chunk;
  const long long end = first + chunk < tokens ? first + chunk : tokens;
  for (long long t = first + warp; t < end; t += WARPS) {  // uniform over the warp
    float p[NE], m, s;
    scores(logits + t * ld, experts, lane, softmax != 0, p, m, s);
    unsigned taken = 0;  // bit i: expert lane + 32 i is selected
    unsigned mine_key = 1, mine_e = 0;  // lane j: the j-th selection
    for (int r = 0; r < top_k; ++r) {
      unsigned best = 0, best_e = NONE;
#pragma unroll
      for (int i = 0; i < NE; ++i) {  // ascending i: a tie keeps the lower index
        const unsigned k = key_of(p[i]);
        if (lane + 32 * i < experts && !((taken >> i) & 1u) && k > best) {
          best = k;
          best_e = lane + 32 * i;
        }
      }
      const unsigned top = __reduce_max_sync(FULL, best);
      const unsigned e = __reduce_min_sync(FULL, best == top ? best_e : NONE);
      if ((e & 31u) == static_cast<unsigned>(lane)) taken |= 1u << (e >> 5);
      if (lane == r) {
        mine_key = top;
        mine_e = e;
      }
    }
    const bool has = lane < top_k;
    const float v = has ? __uint_as_float(mine_key - 1u) : 0.0f;
    const float total = warp_sum(v);
    if (has) {
      const float w = normalize ? __fdiv_rn(v, total) : v;
      weights[t * top_k + lane] = ck::from_float<T>(w);
      index[t * top_k + lane] = static_cast<long long>(mine_e);
      atomicAdd(&counts[mine_e], 1);
    }
  }
  __syncthreads();
  int* out = hist + static_cast<long long>(blockIdx.x) * experts;
  for (int e = threadIdx.x; e < experts; e += BLOCK) out[e] = counts[e];
}

// Launch 2 (see the top): one block of SCAN_BLOCK >= E threads.
extern "C" __global__ void __launch_bounds__(SCAN_BLOCK)
moe_routing_scan_kernel(const int* __restrict__ hist, int* __restrict__ base,
                        int* __restrict__ offsets, long long blocks, long long experts) {
  __shared__ int warp_total[SCAN_BLOCK / 32];
  const int e = threadIdx.x, lane = e & 31, warp = e >> 5;
  const bool mine = e < experts;
  int total = 0;
  if (mine) {
#pragma unroll 4
    for (long long b = 0; b < blocks; ++b) total += hist[b * experts + e];
  }
  int incl = total;  // inclusive scan over the block: the warp, then the warps' totals
#pragma unroll
  for (int off = 1; off < 32; off <<= 1) {
    const int up = __shfl_up_sync(FULL, incl, off);
    if (lane >= off) incl += up;
  }
  if (lane == 31) warp_total[warp] = incl;
  __syncthreads();
  if (warp == 0) {
    int w = lane < SCAN_BLOCK / 32 ? warp_total[lane] : 0;
#pragma unroll
    for (int off = 1; off < 32; off <<= 1) {
      const int up = __shfl_up_sync(FULL, w, off);
      if (lane >= off) w += up;
    }
    if (lane < SCAN_BLOCK / 32) warp_total[lane] = w;  // inclusive
  }
  __syncthreads();
  if (!mine) return;
  const int start = incl - total + (warp > 0 ? warp_total[warp - 1] : 0);
  offsets[e] = start + total;
  int run = start;
#pragma unroll 4
  for (long long b = 0; b < blocks; ++b) {
    base[b * experts + e] = run;
    run += hist[b * experts + e];
  }
}

// Launch 3 (see the top): token_of_row [T * k] and inverse [T, k] from index and base.
extern "C" __global__ void __launch_bounds__(BLOCK)
moe_routing_place_kernel(const long long* __restrict__ index, const int* __restrict__ base,
                         int* __restrict__ token_of_row, int* __restrict__ inverse,
                         long long tokens, long long experts, long long top_k, long long chunk) {
  __shared__ unsigned char wcount[WARPS][EMAX];  // this chunk's pairs of a warp and expert (<= 32)
  __shared__ int before[EMAX];                   // the block's pairs of an expert in earlier chunks
  for (int i = threadIdx.x; i < WARPS * EMAX; i += BLOCK) (&wcount[0][0])[i] = 0;
  for (int i = threadIdx.x; i < EMAX; i += BLOCK) before[i] = 0;
  __syncthreads();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const long long first_token = static_cast<long long>(blockIdx.x) * chunk;
  const long long end_token = first_token + chunk < tokens ? first_token + chunk : tokens;
  const long long last = end_token * top_k;
  const int* my_base = base + static_cast<long long>(blockIdx.x) * experts;
  for (long long p0 = first_token * top_k; p0 < last; p0 += BLOCK) {  // uniform over the block
    const long long p = p0 + threadIdx.x;
    const bool active = p < last;
    const int e = active ? static_cast<int>(index[p]) : -1;
    const unsigned same = __match_any_sync(FULL, e);
    const unsigned lower = same & ((1u << lane) - 1u);
    const bool leader = active && lower == 0;
    if (leader) wcount[warp][e] = static_cast<unsigned char>(__popc(same));
    __syncthreads();
    if (active) {
      int rank = before[e] + __popc(lower);
      for (int w = 0; w < warp; ++w) rank += wcount[w][e];
      const int row = my_base[e] + rank;
      token_of_row[row] = static_cast<int>(p / top_k);
      inverse[p] = row;
    }
    __syncthreads();
    if (leader) {
      atomicAdd(&before[e], __popc(same));  // a count: its order does not matter
      wcount[warp][e] = 0;
    }
    __syncthreads();
  }
}

// Backward (see the top): d_logits [T, E] contiguous from d_weights [T, k] (contiguous), the
// logits (row stride ld) and index [T, k].
extern "C" __global__ void __launch_bounds__(BLOCK)
moe_routing_bwd_kernel(const T* __restrict__ d_weights, const T* __restrict__ logits,
                       const long long* __restrict__ index, T* __restrict__ d_logits,
                       long long tokens, long long experts, long long top_k, long long ld,
                       long long softmax, long long normalize) {
  __shared__ float dp_row[WARPS][EMAX];  // a warp's dp, zero between tokens
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int i = 0; i < NE; ++i) dp_row[warp][lane + 32 * i] = 0.0f;
  __syncwarp();
  const bool sm = softmax != 0;
  for (long long t = static_cast<long long>(blockIdx.x) * WARPS + warp; t < tokens;
       t += static_cast<long long>(gridDim.x) * WARPS) {  // uniform over the warp
    const T* row = logits + t * ld;
    float p[NE], m, s;
    scores(row, experts, lane, sm, p, m, s);
    const bool has = lane < top_k;
    const int e = has ? static_cast<int>(index[t * top_k + lane]) : 0;
    const float dw = has ? ck::to_float(d_weights[t * top_k + lane]) : 0.0f;
    const float v = has ? score(ck::to_float(row[e]), m, s, sm) : 0.0f;
    float dv = dw;
    if (normalize) {
      const float total = warp_sum(v);
      const float c = warp_sum(dw * __fdiv_rn(v, total));
      dv = __fdiv_rn(dw - c, total);
    }
    const float q = sm ? warp_sum(dv * v) : 0.0f;
    if (has) dp_row[warp][e] = dv;
    __syncwarp();
    T* out = d_logits + t * experts;
#pragma unroll
    for (int i = 0; i < NE; ++i) {
      const int x = lane + 32 * i;
      if (x < experts) {
        const float dp = dp_row[warp][x];
        out[x] = ck::from_float<T>(sm ? p[i] * (dp - q) : dp * p[i] * (1.0f - p[i]));
      }
    }
    __syncwarp();
    if (has) dp_row[warp][e] = 0.0f;
    __syncwarp();
  }
}
