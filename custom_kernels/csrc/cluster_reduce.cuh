// Sum and max reductions at warp, block and thread-block-cluster scope.
//
// Every thread of the group gets the same result, bit for bit: the final combination runs in
// the same order in every warp of every block. Values may be `float` or `float2` (two
// independent reductions for the price of one barrier).
//
// Block and cluster reductions exchange partials through shared memory (distributed shared
// memory across the cluster: each warp pushes its partial into every block of the cluster with
// `map_shared_rank`, then one `cluster.sync()`), using a `Reducer` that owns a buffer of
// `Reducer::kSlots` values of static shared memory and alternates between two halves of it, so
// consecutive reductions need one barrier each and no barrier between them: a block cannot
// write into half h again before every block has passed the barrier of the next reduction,
// which it reaches only after reading half h.
//
// Rules: every thread of the block (cluster) calls each reduction the same number of times
// (the barrier is collective), and the kernel must be launched with a cluster of exactly
// CLUSTER blocks along x when CLUSTER > 1. A cluster Reducer must reduce at least once (its
// constructor's barrier arrival is matched by the first reduction's wait).
#pragma once

#include <cooperative_groups.h>

namespace ck {

namespace cg = cooperative_groups;

struct SumOp {
  __device__ __forceinline__ float operator()(float a, float b) const { return a + b; }
  __device__ __forceinline__ float2 operator()(float2 a, float2 b) const {
    return make_float2(a.x + b.x, a.y + b.y);
  }
};

struct MaxOp {
  __device__ __forceinline__ float operator()(float a, float b) const { return fmaxf(a, b); }
  __device__ __forceinline__ float2 operator()(float2 a, float2 b) const {
    return make_float2(fmaxf(a.x, b.x), fmaxf(a.y, b.y));
  }
};

__device__ __forceinline__ float shfl_xor(float v, int mask) {
  return __shfl_xor_sync(0xffffffffu, v, mask);
}

__device__ __forceinline__ float2 shfl_xor(float2 v, int mask) {
  return make_float2(__shfl_xor_sync(0xffffffffu, v.x, mask),
                     __shfl_xor_sync(0xffffffffu, v.y, mask));
}

// All 32 lanes must be active; every lane gets the result.
template <class T, class Op>
__device__ __forceinline__ T warp_reduce(T v, Op op) {
#pragma unroll
  for (int mask = 16; mask > 0; mask >>= 1) v = op(v, shfl_xor(v, mask));
  return v;
}

template <class T>
__device__ __forceinline__ T warp_sum(T v) { return warp_reduce(v, SumOp{}); }

template <class T>
__device__ __forceinline__ T warp_max(T v) { return warp_reduce(v, MaxOp{}); }

// Reduction within aligned groups of WIDTH lanes (2, 4, 8 or 16) of a warp: several short rows
// per warp, each reduced by its own lanes. All 32 lanes must be active (the shuffles are
// warp-wide); each lane gets its group's result. No shared memory: kSlots exists so that the
// kernels size one buffer whichever reducer they use.
template <class T, int WIDTH>
struct GroupReducer {
  static_assert(WIDTH >= 2 && WIDTH < 32 && (WIDTH & (WIDTH - 1)) == 0,
                "a group is 2 to 16 lanes, a power of two");
  static constexpr int kSlots = 1;

  __device__ explicit GroupReducer(T*) {}

  template <class Op>
  __device__ __forceinline__ T reduce(T v, Op op) {
#pragma unroll
    for (int mask = WIDTH / 2; mask > 0; mask >>= 1) v = op(v, shfl_xor(v, mask));
    return v;
  }

  __device__ __forceinline__ T sum(T v) { return reduce(v, SumOp{}); }
  __device__ __forceinline__ T max(T v) { return reduce(v, MaxOp{}); }
};

// Lanes without a partial contribute the identity: 0 for a sum, a copy of partial 0 for a max
// (max is idempotent, so repeating a partial changes nothing).
__device__ __forceinline__ float zero_like(float) { return 0.0f; }
__device__ __forceinline__ float2 zero_like(float2) { return make_float2(0.0f, 0.0f); }
template <class T>
__device__ __forceinline__ T identity_like(T first, SumOp) { return zero_like(first); }
template <class T>
__device__ __forceinline__ T identity_like(T first, MaxOp) { return first; }

// The combination of a block's kPartials partials (in shared memory, visible to the warp): each
// lane combines a fixed subset in a fixed order, then the warp combines the lanes, so every warp
// of every block computes the same result bit for bit.
template <int kPartials, class T, class Op>
__device__ __forceinline__ T combine_partials(const T* partials, Op op) {
  const int lane = threadIdx.x % 32;
  T acc = partials[lane < kPartials ? lane : 0];
  for (int i = lane + 32; i < kPartials; i += 32) acc = op(acc, partials[i]);
  if (lane >= kPartials) acc = identity_like(partials[0], op);
  return warp_reduce(acc, op);
}

// Reduction over NUM_WARPS warps of a block (threads 0 .. 32*NUM_WARPS-1) and CLUSTER blocks.
// NUM_WARPS == 1 and CLUSTER == 1 is a plain warp reduction (no shared memory, no barrier).
template <class T, int NUM_WARPS, int CLUSTER = 1>
struct Reducer {
  static constexpr int kPartials = NUM_WARPS * CLUSTER;
  static constexpr int kSlots = 2 * kPartials;

  T* smem;  // kSlots values of shared memory, the same address in every block of the cluster
  int phase = 0;
  bool started = CLUSTER == 1;

  // With a cluster, the constructor arrives on the cluster barrier and the first reduction waits
  // on it before writing into another block's shared memory: a block's shared memory may be
  // written only once that block is running. Construct the Reducer early (before the loads) so
  // the wait costs nothing, and reduce at least once.
  __device__ explicit Reducer(T* smem_) : smem(smem_) {
    if constexpr (CLUSTER > 1) cg::this_cluster().barrier_arrive();
  }

  template <class Op>
  __device__ __forceinline__ T reduce(T v, Op op) {
    v = warp_reduce(v, op);
    if constexpr (kPartials == 1) {
      return v;
    } else {
      const int warp = threadIdx.x / 32;
      const int lane = threadIdx.x % 32;
      T* half = smem + phase * kPartials;
      phase ^= 1;
      if constexpr (CLUSTER == 1) {
        if (lane == 0) half[warp] = v;
        __syncthreads();
      } else {
        cg::cluster_group cluster = cg::this_cluster();
        if (!started) {
          cluster.barrier_wait();
          started = true;
        }
        const int slot = static_cast<int>(cluster.block_rank()) * NUM_WARPS + warp;
        // Lane r pushes this warp's partial into block r of the cluster.
        for (int r = lane; r < CLUSTER; r += 32) {
          T* remote = cluster.map_shared_rank(half, r);
          remote[slot] = v;
        }
        cluster.sync();
      }
      return combine_partials<kPartials>(half, op);
    }
  }

  __device__ __forceinline__ T sum(T v) { return reduce(v, SumOp{}); }
  __device__ __forceinline__ T max(T v) { return reduce(v, MaxOp{}); }
};

// Cluster reduction without a cluster-wide barrier per reduction: each warp sends its partial
// into every block of the cluster with st.async, whose bytes complete a transaction on the
// receiving block's mbarrier, and each block waits on its own mbarrier alone. Why: a cluster
// barrier's release is a MEMBAR.ALL.GPU on sm_90 (ptxas emits it for barrier.cluster.arrive
// .release and for fence.acq_rel.cluster alike), which waits for every global store the thread
// still has in flight, the previous row's output among them; and every block waits for the
// slowest one of the cluster, not for the partials alone.
//
// Shared memory: two mbarriers, then two halves of kPartials values (kSlots values in all, the
// buffer 8-byte aligned). Reductions alternate between the halves, each with its mbarrier, armed
// by thread 0 (one arrival plus the expected bytes) when it reaches that reduction; partials sent
// before the arming count against the phase (the transaction count may go below zero), and none
// of the next use of a half can arrive before every block has read it: a block sends its next
// partials only after its own reduction of the other half, which needed every warp's partial,
// each sent after that warp had read this half. Bit-for-bit results as Reducer: the same
// combination order in every warp of every block.
template <class T, int NUM_WARPS, int CLUSTER>
struct AsyncClusterReducer {
  static_assert(CLUSTER > 1, "a cluster reduction");
  static_assert(sizeof(T) == 4 || sizeof(T) == 8, "float or float2");
  static constexpr int kPartials = NUM_WARPS * CLUSTER;
  static constexpr int kBarrierSlots = 16 / sizeof(T);  // two 8-byte mbarriers
  static constexpr int kSlots = kBarrierSlots + 2 * kPartials;

  T* values;            // 2 * kPartials values, after the barriers
  unsigned bars;        // .shared address of mbarrier 0 (1 follows at + 8)
  int phase = 0;        // the half (and mbarrier) of the next reduction
  unsigned parity = 0;  // bit h: the phase parity that mbarrier h completes next
  bool started = false;

  __device__ explicit AsyncClusterReducer(T* smem)
      : values(smem + kBarrierSlots),
        bars(static_cast<unsigned>(__cvta_generic_to_shared(smem))) {
    if (threadIdx.x == 0) {
      asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n"
                   "mbarrier.init.shared::cta.b64 [%1], 1;\n"
                   "fence.mbarrier_init.release.cluster;\n" ::"r"(bars), "r"(bars + 8)
                   : "memory");
    }
    // The first reduction waits: remote mbarriers are initialized and their blocks running.
    cg::this_cluster().barrier_arrive();
  }

  template <class Op>
  __device__ __forceinline__ T reduce(T v, Op op) {
    v = warp_reduce(v, op);
    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    cg::cluster_group cluster = cg::this_cluster();
    if (!started) {
      cluster.barrier_wait();
      started = true;
    }
    const int h = phase;
    phase ^= 1;
    T* half = values + h * kPartials;
    const unsigned bar = bars + 8 * h;
    if (threadIdx.x == 0) {
      asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar),
                   "r"(static_cast<unsigned>(kPartials * sizeof(T)))
                   : "memory");
    }
    const int slot = static_cast<int>(cluster.block_rank()) * NUM_WARPS + warp;
    for (int r = lane; r < CLUSTER; r += 32) send(half + slot, bar, r, v);
    wait(bar, (parity >> h) & 1u);
    parity ^= 1u << h;
    return combine_partials<kPartials>(half, op);
  }

  __device__ __forceinline__ T sum(T v) { return reduce(v, SumOp{}); }
  __device__ __forceinline__ T max(T v) { return reduce(v, MaxOp{}); }

 private:
  __device__ __forceinline__ static unsigned remote(unsigned local, int rank) {
    unsigned out;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(out) : "r"(local), "r"(rank));
    return out;
  }
  __device__ __forceinline__ static void send(T* slot, unsigned bar, int rank, float v) {
    asm volatile(
        "st.async.shared::cluster.mbarrier::complete_tx::bytes.b32 [%0], %1, [%2];\n" ::"r"(
            remote(static_cast<unsigned>(__cvta_generic_to_shared(slot)), rank)),
        "r"(__float_as_uint(v)), "r"(remote(bar, rank))
        : "memory");
  }
  __device__ __forceinline__ static void send(T* slot, unsigned bar, int rank, float2 v) {
    asm volatile(
        "st.async.shared::cluster.mbarrier::complete_tx::bytes.v2.f32 [%0], {%1, %2}, [%3];\n" ::
            "r"(remote(static_cast<unsigned>(__cvta_generic_to_shared(slot)), rank)),
        "f"(v.x), "f"(v.y), "r"(remote(bar, rank))
        : "memory");
  }
  __device__ __forceinline__ static void wait(unsigned bar, unsigned parity) {
    asm volatile(
        "{\n"
        ".reg .pred done;\n"
        "WAIT_%=:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
        "@!done bra WAIT_%=;\n"
        "}\n" ::"r"(bar), "r"(parity)
        : "memory");
  }
};

// One-shot helpers for code that reduces once per kernel: `smem` holds Reducer::kSlots values.
// Two calls on the same buffer without a barrier between them race: use one Reducer instead.
template <int NUM_WARPS, int CLUSTER = 1, class T>
__device__ __forceinline__ T block_or_cluster_sum(T v, T* smem) {
  return Reducer<T, NUM_WARPS, CLUSTER>(smem).sum(v);
}

template <int NUM_WARPS, int CLUSTER = 1, class T>
__device__ __forceinline__ T block_or_cluster_max(T v, T* smem) {
  return Reducer<T, NUM_WARPS, CLUSTER>(smem).max(v);
}

}  // namespace ck
