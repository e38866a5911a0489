// Sum reduction over a group of GROUP blocks that is not a thread block cluster: the blocks
// exchange their block-wide partials through global memory.
//
// Why: a cluster must sit inside one GPC, so on an H100/H200 (132 SMs) at most 15 clusters of 8
// blocks of one block per SM are resident (120 SMs); a long row split over 8 blocks then leaves
// 12 SMs idle. Blocks of a global group can be any co-resident blocks, so every SM takes part.
//
// Protocol, per reduction k of a group (every block of the group makes the same calls):
//   1. the block reduces its threads' values (fixed order) and its lane 0 of warp 0 writes the
//      block partial into slot `rank` of half k % 2 of the group's partials, fences, and adds 1
//      to the group's arrival counter;
//   2. it spins (acquire loads) until the counter reaches GROUP * (k + 1), then sums the GROUP
//      partials of that half in rank order (so every block of the group gets the same bits) and
//      hands the sum to its block through shared memory.
// A block writes half k % 2 again at reduction k + 2 only after it has seen every block arrive
// at k + 1, and each block reads half k % 2 before it arrives at k + 1: two halves suffice.
//
// Requirements: the host zeroes the counters before the launch, and every block of a group is
// resident at once (a persistent grid no larger than one wave): a block waits on the others.
#pragma once

#include "cluster_reduce.cuh"

namespace ck {

__device__ __forceinline__ int load_acquire(const int* p) {
  int v;
  asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ float load_l2(const float* p) { return __ldcg(p); }
__device__ __forceinline__ float2 load_l2(const float2* p) { return __ldcg(p); }
__device__ __forceinline__ float zero_of(float) { return 0.0f; }
__device__ __forceinline__ float2 zero_of(float2) { return make_float2(0.0f, 0.0f); }

template <class T, int NUM_WARPS, int GROUP>
struct GroupSumReducer {
  static_assert(GROUP >= 2, "a group of at least 2 blocks");
  static constexpr int kSlots = 2 * (NUM_WARPS + 1);  // two halves: warp partials + the result

  T* smem;
  int* arrivals;  // this group's counter
  T* partials;    // this group's 2 x GROUP slots
  int rank;
  int phase = 0;
  int target = 0;

  __device__ GroupSumReducer(T* smem_, int* arrivals_, T* partials_, int rank_)
      : smem(smem_), arrivals(arrivals_), partials(partials_), rank(rank_) {}

  __device__ __forceinline__ T sum(T v) {
    const SumOp op;
    v = warp_reduce(v, op);
    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    T* half = smem + phase * (NUM_WARPS + 1);
    if (lane == 0) half[warp] = v;
    __syncthreads();
    if (warp == 0) {
      T acc = half[lane < NUM_WARPS ? lane : 0];
      for (int i = lane + 32; i < NUM_WARPS; i += 32) acc = op(acc, half[i]);
      if (lane >= NUM_WARPS) acc = zero_of(acc);
      acc = warp_reduce(acc, op);
      target += GROUP;  // every lane, so that the count stays uniform in the warp
      if (lane == 0) {
        T* slots = partials + phase * GROUP;
        slots[rank] = acc;
        __threadfence();  // the partial is visible before the arrival that announces it
        atomicAdd(arrivals, 1);
        while (load_acquire(arrivals) < target) {
        }
        T total = load_l2(slots);
#pragma unroll
        for (int g = 1; g < GROUP; ++g) total = op(total, load_l2(slots + g));
        half[NUM_WARPS] = total;
      }
    }
    __syncthreads();
    const T total = half[NUM_WARPS];
    phase ^= 1;
    return total;
  }
};

}  // namespace ck
