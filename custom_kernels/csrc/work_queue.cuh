// A device-side work queue for persistent kernels: an atomic ticket counter that blocks (or
// warps) pull task indices from until it passes the task count.
//
// The counters live in global memory, zero when a kernel starts, and the kernel leaves them zero
// when it ends: every block, after its last pull, adds one to a `done` counter, and the block
// that brings it to gridDim.x resets the tickets and `done`. No host round trip and no memset
// run between two launches, so a kernel captured in a CUDA graph replays as is.
//
// Layout of the counters (kCounters unsigned ints, one set per stream, see work_queue.py):
//   [0 .. kMaxPhases)  one ticket per phase (a kernel that pulls tasks twice, say before and after
//                      a grid-wide barrier, uses ticket 0 then ticket 1);
//   [kDone]            the number of blocks that have finished.
//
// Rules: counters must be zero at launch (they are after any kernel that ran `finish`, and when
// first allocated); every block of the grid calls `finish` exactly once, after its last pull; a
// kernel that traps midway leaves them dirty (work_queue.py's `reset` clears them).
#pragma once

namespace ck {

constexpr int kMaxPhases = 3;
constexpr int kDone = kMaxPhases;
constexpr int kCounters = kMaxPhases + 1;

// Block-wide pulls: thread 0 takes a ticket and shares it through shared memory. The next ticket
// is taken while the block works on the current one (`prefetch`), so the atomic's latency hides
// behind the work. Two shared slots alternate, so a pull costs one barrier:
//
//   BlockQueue q(counters + phase, slots);
//   for (unsigned t = q.begin(); t < n; t = q.advance()) { q.prefetch(); work(t); }
//
// Thread 0 writes slot p^1 during task i; all threads read it after the barrier in advance();
// slot p is written again only in task i+1, after that barrier, by which every thread has read it.
struct BlockQueue {
  unsigned int* ticket;
  unsigned int* slots;  // two unsigned ints of shared memory
  int p = 0;

  __device__ BlockQueue(unsigned int* ticket_, unsigned int* slots_)
      : ticket(ticket_), slots(slots_) {}

  __device__ __forceinline__ unsigned int begin() {
    if (threadIdx.x == 0) slots[0] = atomicAdd(ticket, 1u);
    __syncthreads();
    p = 0;
    return slots[0];
  }

  __device__ __forceinline__ void prefetch() {
    if (threadIdx.x == 0) slots[p ^ 1] = atomicAdd(ticket, 1u);
  }

  __device__ __forceinline__ unsigned int advance() {
    __syncthreads();
    p ^= 1;
    return slots[p];
  }
};

// Warp-wide pulls (each warp is a consumer): lane 0 takes the ticket, a shuffle shares it.
__device__ __forceinline__ unsigned int warp_pull(unsigned int* ticket) {
  unsigned int t = 0;
  if ((threadIdx.x & 31) == 0) t = atomicAdd(ticket, 1u);
  return __shfl_sync(0xffffffffu, t, 0);
}

// Called once by every block of the grid, by all its threads, after its last pull of every
// phase. The last block to arrive resets the first `phases` tickets and the done counter.
// The fences order every ticket increment of this block (whichever thread made it) before its
// `done` increment, so the reset cannot be overtaken by a late ticket increment.
__device__ __forceinline__ void finish(unsigned int* counters, int phases) {
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) {
    const unsigned int arrived = atomicAdd(counters + kDone, 1u);
    if (arrived == gridDim.x * gridDim.y * gridDim.z - 1) {
      for (int i = 0; i < phases; ++i) atomicExch(counters + i, 0u);
      atomicExch(counters + kDone, 0u);
      __threadfence();
    }
  }
}

}  // namespace ck
