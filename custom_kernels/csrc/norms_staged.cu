// RMSNorm and LayerNorm, forward and backward, with rows staged through shared memory by a
// cp.async pipeline: the fast path of 16-byte-aligned rows. Same math, arguments and outputs as
// norms.cu (whose header states the formulas); norm_layout.cuh says which vectors of a row each
// thread owns.
//
// Why: the direct kernels load a row into registers, reduce it, then write it, so a block's
// loads stop at every reduction; on long rows few blocks fit on an SM and HBM idles during those
// gaps (docs/measurements.md). Here every kernel is persistent: a grid that fills the GPU once
// (one wave) is split into row units (a warp, a block or a thread block cluster), and unit u walks
// rows u, u + units, u + 2 units, ...
// Each thread copies its vectors of the next NORM_STAGES - 1 rows into shared memory with
// cp.async while it reduces and writes the current row, so reads are always in flight.
//
// A thread only reads the shared-memory slots that it filled itself, so the pipeline needs no
// barrier: cp.async.wait_group makes a thread's own copies visible to it, and a slot is refilled
// only after the same thread has read it. Per-row statistics for the backward pass are copied
// by lane 0 of each warp and shared with __syncwarp.
//
// NORM_FP8 (RMSNorm forward; norm_fp8.cuh): the forward also writes y in FP8 and its scales.
//
// Dynamic shared memory (the host computes the same sizes, custom_kernels/norm_config.py):
//   stats:   kStages * kWarps float2s, rounded up to an even count (backward only)
//   streams: kStages * kSlotsPerStage vectors each; forward x (and residual), backward x, dy
//            (and d_residual_out), the residual streams only when compiled with NORM_RESIDUAL
//   params:  forward with NORM_PARAM_SMEM: kIters * kThreads weight vectors unless the weight
//            fits registers, then as many bias vectors (LayerNorm)
//   shifts:  LayerNorm forward: kStages * kThreads 4-byte row starts of x (and of the residual)
// The backward with a warp per row reuses it for the block's dW/dB partials once the rows are done.

#include "norm_rows.cuh"
#include "norm_fp8.cuh"  // NORM_FP8: the FP8 output beside y (nothing without it)

static_assert(kVec * sizeof(In) == 16, "the staged kernels copy 16-byte vectors of x");
static_assert(!kSubWarpRows && kRowsPerThread == 1,
              "the staged kernels take a whole warp (or more) per row, one row per thread");

#ifndef NORM_RESIDUAL
#define NORM_RESIDUAL 0
#endif

constexpr int kStages = NORM_STAGES;
// Whether the residual (forward) or the residual gradient (backward) is staged too: fixed at
// compile time because it sizes the shared memory; the host launches the matching kernel.
constexpr bool kResidual = NORM_RESIDUAL != 0;
constexpr int kWarps = kThreads / 32;
constexpr int kSlotsPerStage = kRowsPerBlock * kIters * kTpr;  // vectors of one stage, one stream
[[maybe_unused]] constexpr int kStatSlots = (kStages * kWarps + 1) / 2 * 2;  // float2s; keeps the streams 16-aligned
static_assert(kStages >= 1 && kStages <= 8, "1 to 8 stages");

// The reduction's static shared memory, padded to a multiple of 128 bytes. Why: dynamic shared
// memory starts where the static ends, and the staging slots take 16-byte cp.async copies of
// whole 32-byte sectors; a region that starts 16 bytes off a 32-byte boundary splits every
// sector over two, which cost 5 to 11% of the copy bandwidth with the same instructions
// (docs/measurements.md, "Staging alignment"). norms_staged.cu's kernels declare no other static
// shared memory, and test_norms.py checks the size ptxas reports.
template <class T>
__host__ __device__ constexpr int padded_slots(int slots) {
  return (slots * static_cast<int>(sizeof(T)) + 127) / 128 * 128 / static_cast<int>(sizeof(T));
}
constexpr int kRedSlots = padded_slots<RedT>(RowReducer<RedT>::kSlots);

// ---------------------------------------------------------------------------------------------
// cp.async (sm_80+): 16-byte copies bypass L1 (.cg); 4- and 8-byte ones must go through it (.ca)
// ---------------------------------------------------------------------------------------------

// Copies take the destination as a .shared window address. Converting a generic pointer costs a
// few instructions (in a cluster kernel, a read of the CTA's id in the cluster among them), which
// ptxas repeated for every 16-byte copy: the staged loops keep their slots' addresses as offsets
// from one conversion made before the row loop.
__device__ __forceinline__ unsigned smem_addr(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

template <int kBytes>
__device__ __forceinline__ void cp_async(unsigned s, const void* gmem) {
  if constexpr (kBytes == 16) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem) : "memory");
  } else {
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2;\n" ::"r"(s), "l"(gmem), "n"(kBytes)
                 : "memory");
  }
}

// A 16-byte copy that reads nothing and writes zeros when `valid` is false (`gmem` must still be
// a valid address): the issue loops copy without a branch per vector.
__device__ __forceinline__ void cp_async16_or_zero(unsigned s, const void* gmem, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem),
               "r"(valid ? 16 : 0) : "memory");
}

template <class V>
__device__ __forceinline__ void cp_async_vec(unsigned s, const void* gmem) {
  constexpr int kBytes = sizeof(V);
  static_assert(kBytes % 16 == 0 || kBytes == 8 || kBytes == 4, "4, 8 or 16n-byte vectors");
  if constexpr (kBytes % 16 == 0) {
#pragma unroll
    for (int i = 0; i < kBytes / 16; ++i)
      cp_async<16>(s + 16 * i, reinterpret_cast<const char*>(gmem) + 16 * i);
  } else {
    cp_async<kBytes>(s, gmem);
  }
}

__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}

template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
}

// ---------------------------------------------------------------------------------------------
// Row units and staging slots
// ---------------------------------------------------------------------------------------------

struct RowUnits {
  long long first;  // this thread's unit: its first row
  long long stride;  // number of units: the distance between its rows
  int in_block;      // which of the block's rows (warp per row), else 0
};

__device__ __forceinline__ RowUnits row_units() {
  if constexpr (kWarpPerRow) {
    const int warp = threadIdx.x / 32;
    return {static_cast<long long>(blockIdx.x) * kRowsPerBlock + warp,
            static_cast<long long>(gridDim.x) * kRowsPerBlock, warp};
  } else {
    return {static_cast<long long>(blockIdx.x / kCluster),
            static_cast<long long>(gridDim.x / kCluster), 0};
  }
}

// One stream of staged vectors: this thread's slot of iteration `it` in stage `stage`.
template <class V>
struct Stream {
  V* mine;  // slot (stage 0, it 0) of this thread
  unsigned mine_s;  // its .shared address, for cp.async
  __device__ Stream(void* base, int in_block, int lane)
      : mine(reinterpret_cast<V*>(base) + in_block * kIters * kTpr + lane),
        mine_s(smem_addr(mine)) {}
  __device__ __forceinline__ static int offset(int stage, int it) {
    return (stage * kRowsPerBlock * kIters + it) * kTpr;
  }
  __device__ __forceinline__ V* slot(int stage, int it) const { return mine + offset(stage, it); }
  __device__ __forceinline__ unsigned slot_s(int stage, int it) const {
    return mine_s + offset(stage, it) * static_cast<unsigned>(sizeof(V));
  }
  __device__ __forceinline__ void* end_of_region(void* base) const {
    return reinterpret_cast<V*>(base) + kStages * kSlotsPerStage;
  }
};

__device__ __forceinline__ int next_stage(int stage) { return stage + 1 == kStages ? 0 : stage + 1; }

// The stage that row k + kStages - 1 goes to while row k (in `stage`) is processed.
__device__ __forceinline__ int prefetch_stage(int stage) {
  return stage == 0 ? kStages - 1 : stage - 1;
}

// Where a kernel keeps this thread's weight (and bias) vectors across the rows it walks: in
// registers, when they fit beside everything else (a thread has 65536 / kThreads of them, at most
// 255); in shared memory (NORM_PARAM_SMEM, the forward with a block or cluster per row), copied
// once per block, each thread its own slots, so no barrier; or in global memory, read again for
// every row (from L2).
// Why shared memory: LayerNorm's weight and bias of a long row take 64 registers at 8 vectors a
// thread. Read from L2 for every row they are twice the bytes of x, and the speed then depends on
// where the two tensors happen to sit in memory (docs/measurements.md, "Placement of w and b").
enum class Home { kRegisters, kShared, kGlobal };

constexpr int kMaxRegs = 65536 / kThreads < 255 ? 65536 / kThreads : 255;
constexpr int kBaseRegs = 40;  // addresses, loop state, the current vectors (measured: ptxas -v)
constexpr int kWeightRegs = kIters * static_cast<int>(sizeof(VW)) / 4;
// NORM_WEIGHT_REGS: -1 (default) the rule below, 0 never, 1 whenever they fit (tuning sweeps).
// The rule, from sweeps on an H200: RMSNorm keeps up to 32 registers of weights (they save an
// L2 read per element in the output loop); LayerNorm, whose weight and bias double that, keeps
// them only when they take at most 8 (one vector each): beyond, the registers cost occupancy
// that its one-stage configs need more (docs/measurements.md).
#ifndef NORM_WEIGHT_REGS
#define NORM_WEIGHT_REGS -1
#endif
#ifndef NORM_PARAM_SMEM
#define NORM_PARAM_SMEM 0
#endif
// LayerNorm's shift (the row's first element, row_shift) comes with the row's copies into
// shared memory (1, the default) or from a global load per row and block (0, for comparison):
// a load issued when the row is needed waits a full memory round trip every row.
#ifndef NORM_STAGED_SHIFT
#define NORM_STAGED_SHIFT 1
#endif
[[maybe_unused]] constexpr bool kStagedShift = kLN && NORM_STAGED_SHIFT != 0;
constexpr bool kParamSmem = NORM_PARAM_SMEM != 0;
static_assert(!kParamSmem || !kWarpPerRow, "parameters in shared memory: a block per row");
constexpr int kFwdWeightRegs = kWeightRegs * (kLN ? 2 : 1);
[[maybe_unused]] constexpr bool kFwdWeightInRegs =
    NORM_WEIGHT_REGS == 0 ? false
    : NORM_WEIGHT_REGS == 1 ? kBaseRegs + kFwdWeightRegs <= kMaxRegs
                             : kFwdWeightRegs <= (kLN ? 8 : 32) &&
                                   kBaseRegs + kFwdWeightRegs <= kMaxRegs;
// With NORM_PARAM_SMEM the weight alone takes RMSNorm's rule and the bias shared memory
// (norm_config.py's NormConfig.params_in_smem counts the same).
[[maybe_unused]] constexpr bool kWeightAloneInRegs =
    kWeightRegs <= 32 && kBaseRegs + kWeightRegs <= kMaxRegs;
[[maybe_unused]] constexpr Home kFwdWeightHome =
    kParamSmem         ? (kWeightAloneInRegs ? Home::kRegisters : Home::kShared)
    : kFwdWeightInRegs ? Home::kRegisters
                       : Home::kGlobal;
[[maybe_unused]] constexpr Home kFwdBiasHome = !kLN               ? Home::kGlobal  // no bias
                                               : kParamSmem       ? Home::kShared
                                               : kFwdWeightInRegs ? Home::kRegisters
                                                                  : Home::kGlobal;
constexpr int kAccRegs = kAccRows * kIters * kVec;  // the backward's dW (and dB) accumulators
[[maybe_unused]] constexpr bool kBwdWeightInRegs =
    kWeightRegs <= 32 && kBaseRegs + kAccRegs + kWeightRegs <= kMaxRegs;

// One parameter vector per iteration of this thread (weight or bias), kept at `kHome`.
// Shared slots: `slots` holds kIters * kTpr vectors, slot it of this thread at it * kTpr + lane.
// Their copies join the caller's next cp.async group.
template <Home kHome>
struct ParamVectors {
  VW regs[kHome == Home::kRegisters ? kIters : 1];
  VW* mine;
  const W* global;

  __device__ ParamVectors(const W* g, VW* slots, int hidden, int rank, int lane)
      : mine(kHome == Home::kShared ? slots + lane : nullptr), global(g) {
    if (g == nullptr || kHome == Home::kGlobal) return;  // no bias, or read for every row
#pragma unroll
    for (int it = 0; it < kIters; ++it) {
      const int col = vec_col(it, rank, lane);
      if (col < hidden) {
        if constexpr (kHome == Home::kRegisters) {
          load(regs[it], g + col);
        } else {
          cp_async_vec<VW>(smem_addr(mine + it * kTpr), g + col);
        }
      }
    }
  }
  __device__ __forceinline__ VW get(int it, int col) const {
    VW v;
    if constexpr (kHome == Home::kRegisters) {
      v = regs[it];
    } else if constexpr (kHome == Home::kShared) {
      v = mine[it * kTpr];
    } else {
      load(v, global + col);
    }
    return v;
  }
};

// ---------------------------------------------------------------------------------------------
// Forward
// ---------------------------------------------------------------------------------------------

#if NORM_HAS_PART(0)
__global__ void __launch_bounds__(kThreads) norm_fwd_staged(
    const In* __restrict__ x, const In* __restrict__ res, const W* __restrict__ w,
    const W* __restrict__ b, Out* __restrict__ y, In* res_out, float* __restrict__ mean_out,
    float* __restrict__ rstd_out, long long rows, int hidden, long long x_stride,
    long long res_stride, float eps NORM_FP8_PARAMS) {
  extern __shared__ __align__(128) unsigned char staging[];
  // LayerNorm reduces (sum, sum of squares)
  __shared__ __align__(128) RedT red_smem[kRedSlots];
  const int lane = kWarpPerRow ? threadIdx.x % 32 : threadIdx.x;
  const int rank = cluster_rank();
  const RowUnits units = row_units();
  const Stream<VIn> xs(staging, units.in_block, lane);
  const Stream<VIn> rs(xs.end_of_region(staging), units.in_block, lane);
  // Shared parameter slots (NORM_PARAM_SMEM) follow the streams: the weight's, then the bias'.
  VW* param_slots = reinterpret_cast<VW*>(kResidual ? rs.end_of_region(xs.end_of_region(staging))
                                                    : xs.end_of_region(staging));
  VW* weight_slots = param_slots;
  VW* bias_slots = param_slots + (kFwdWeightHome == Home::kShared ? kIters * kTpr : 0);
  // LayerNorm's shift slots follow: 4 bytes of each row's start (its first element) per stage
  // and thread, then the same of the residual.
  unsigned* shift_slots = reinterpret_cast<unsigned*>(
      bias_slots + (kFwdBiasHome == Home::kShared ? kIters * kTpr : 0));
  auto shift_slot = [&](int stage) { return shift_slots + stage * kThreads + threadIdx.x; };
  const unsigned shift_slots_s = smem_addr(shift_slot(0));
  auto shift_slot_s = [&](int stage) { return shift_slots_s + stage * kThreads * 4u; };
  // Before the first cp.async group is committed: shared copies complete with row 0's.
  const ParamVectors<kFwdWeightHome> weight(w, weight_slots, hidden, rank, lane);
  const ParamVectors<kFwdBiasHome> bias(b, bias_slots, hidden, rank, lane);

  auto issue = [&](long long row, int stage) {
    if (row < rows) {
      const In* xr = x + row * x_stride;
      const In* rr = kResidual ? res + row * res_stride : nullptr;
#pragma unroll
      for (int it = 0; it < kIters; ++it) {
        // Only the last vector can lie past the row's end (NORM_ITERS rounds up): the others
        // copy from the row's base plus a constant, without a bounds check.
        const int col = vec_col(it, rank, lane);
        const bool valid = it + 1 < kIters || col < hidden;
        const int src = valid ? col : 0;  // a readable address for the zero-fill copy
        cp_async16_or_zero(xs.slot_s(stage, it), xr + src, valid);
        if constexpr (kResidual) cp_async16_or_zero(rs.slot_s(stage, it), rr + src, valid);
      }
      if constexpr (kStagedShift) {  // rows are 16-byte aligned: a 4-byte copy of the start
        cp_async<4>(shift_slot_s(stage), xr);
        if constexpr (kResidual) cp_async<4>(shift_slot_s(stage) + kStages * kThreads * 4u, rr);
      }
    }
    cp_async_commit();  // an empty group past the last row keeps the group count uniform
  };

  for (int s = 0; s + 1 < kStages; ++s) issue(units.first + s * units.stride, s);
  RowReducer<RedT> red(red_smem);
  int stage = 0;
  for (long long row = units.first; row < rows; row += units.stride) {
    issue(row + (kStages - 1) * units.stride, prefetch_stage(stage));
    cp_async_wait<kStages - 1>();
    float shift = 0.0f;  // RMSNorm has none
    if constexpr (kStagedShift) {
      shift = to_float(*reinterpret_cast<const In*>(shift_slot(stage)));
      if constexpr (kResidual)  // as row_shift: h's first element, rounded to In
        shift = to_float(from_float<In>(shift + to_float(*reinterpret_cast<const In*>(
                                                    shift_slot(stage) + kStages * kThreads))));
    } else if constexpr (kLN) {
      shift = row_shift(x + row * x_stride, kResidual ? res + row * res_stride : nullptr);
    }
    In* hr = kResidual ? res_out + row * static_cast<long long>(hidden) : nullptr;
    float s = 0.0f;
#pragma unroll
    for (int it = 0; it < kIters; ++it) {
      const int col = vec_col(it, rank, lane);
      if (col < hidden) {
        VIn v = *xs.slot(stage, it);
        if constexpr (kResidual) {
          const VIn r = *rs.slot(stage, it);
          add_residual(v, r);
          store(hr + col, v);
          *xs.slot(stage, it) = v;  // h, read again below
        }
        accumulate_first_pass(s, v);
      }
    }
    auto get_h = [&](int it, int) { return *xs.slot(stage, it); };
    const float2 stats = row_statistics(red, s, shift, get_h, hidden, rank, lane, eps);
    if (lane == 0 && rank == 0 && rstd_out != nullptr) {  // null: no statistics wanted
      rstd_out[row] = stats.y;
      if constexpr (kLN) mean_out[row] = stats.x;
    }
    auto get_w = [&](int it, int col) { return weight.get(it, col); };
#if NORM_FP8
    Out* const yr[1] = {y != nullptr ? y + row * static_cast<long long>(hidden) : nullptr};
    const bool active[1] = {true};
    const long long rows_here[1] = {row};
    const float2 row_stats[1] = {stats};
    write_fp8_rows(yr, active, rows_here, red, [&](int, int it, int col) { return get_h(it, col); },
                   get_w, row_stats, q_out, q_scale, rows, hidden, rank, lane);
#else
    auto get_b = [&](int it, int col) { return bias.get(it, col); };
    write_normalized_row(y + row * static_cast<long long>(hidden), get_h, get_w, get_b, stats,
                         hidden, rank, lane);
#endif
    stage = next_stage(stage);
  }
  cp_async_wait<0>();
}
#endif  // NORM_HAS_PART(0)

// ---------------------------------------------------------------------------------------------
// Backward
// ---------------------------------------------------------------------------------------------

#if NORM_HAS_PART(1)
__global__ void __launch_bounds__(kThreads) norm_bwd_staged(
    const In* __restrict__ x, const Out* __restrict__ dy, const In* __restrict__ dres,
    const W* __restrict__ w, const float* __restrict__ mean, const float* __restrict__ rstd,
    In* __restrict__ dx, float* __restrict__ dw_part, float* __restrict__ db_part, long long rows,
    int hidden, long long x_stride, long long dy_stride, long long dres_stride) {
  extern __shared__ __align__(128) unsigned char staging[];
  __shared__ __align__(128) RedT red_smem[kRedSlots];
  const int lane = kWarpPerRow ? threadIdx.x % 32 : threadIdx.x;
  const int warp = threadIdx.x / 32;
  const int rank = cluster_rank();
  const RowUnits units = row_units();
  // stats[stage][warp] = (mean, rstd) of the stage's row, copied by the warp's lane 0.
  float2* stats = reinterpret_cast<float2*>(staging);
  void* streams = stats + kStatSlots;
  const Stream<VIn> xs(streams, units.in_block, lane);
  const Stream<VOut> dys(xs.end_of_region(streams), units.in_block, lane);
  const Stream<VIn> drs(dys.end_of_region(xs.end_of_region(streams)), units.in_block, lane);

  auto issue = [&](long long row, int stage) {
    if (row < rows) {
      const In* xr = x + row * x_stride;
      const Out* dyr = dy + row * dy_stride;
      const In* drr = kResidual ? dres + row * dres_stride : nullptr;
#pragma unroll
      for (int it = 0; it < kIters; ++it) {
        const int col = vec_col(it, rank, lane);
        if (col < hidden) {
          cp_async_vec<VIn>(xs.slot_s(stage, it), xr + col);
          cp_async_vec<VOut>(dys.slot_s(stage, it), dyr + col);
          if constexpr (kResidual) cp_async_vec<VIn>(drs.slot_s(stage, it), drr + col);
        }
      }
      if (threadIdx.x % 32 == 0) {
        float2* st = stats + stage * kWarps + warp;
        if constexpr (kLN) cp_async<4>(smem_addr(&st->x), mean + row);
        cp_async<4>(smem_addr(&st->y), rstd + row);
      }
    }
    cp_async_commit();
  };

  for (int s = 0; s + 1 < kStages; ++s) issue(units.first + s * units.stride, s);
  float acc[kAccRows][kIters][kVec];
  zero_accumulators(acc);
  RowReducer<RedT> red(red_smem);
  const ParamVectors<kBwdWeightInRegs ? Home::kRegisters : Home::kGlobal> weight(
      w, nullptr, hidden, rank, lane);
  const float inv_n = 1.0f / static_cast<float>(hidden);
  int stage = 0;
  for (long long row = units.first; row < rows; row += units.stride) {
    issue(row + (kStages - 1) * units.stride, prefetch_stage(stage));
    cp_async_wait<kStages - 1>();
    __syncwarp();  // lane 0's copy of the statistics is visible to the warp
    const float2 st = stats[stage * kWarps + warp];
    const float m = kLN ? st.x : 0.0f;
    const float rs = st.y;
    auto get_x = [&](int it, int) { return *xs.slot(stage, it); };
    auto get_dy = [&](int it, int) { return *dys.slot(stage, it); };
    auto get_dres = [&](int it, int) { return *drs.slot(stage, it); };
    auto get_w = [&](int it, int col) { return weight.get(it, col); };
    const float2 sums = accumulate_row(acc, get_x, get_dy, get_w, m, rs, hidden, rank, lane);
    float c1, c2;
    row_sums(red, sums.x, sums.y, c1, c2);
    write_dx_row(dx + row * static_cast<long long>(hidden), get_x, get_dy, get_w, kResidual,
                 get_dres, m, rs, c1 * inv_n, c2 * inv_n, hidden, rank, lane);
    // Lane 0 refills this statistics slot in the next iteration: the whole warp has read it.
    __syncwarp();
    stage = next_stage(stage);
  }
  cp_async_wait<0>();
  if constexpr (kWarpPerRow) {
    __syncthreads();  // every warp is done with its staged rows: the memory holds partials now
    float* partials = reinterpret_cast<float*>(staging);
    write_partials_block(acc[0], dw_part + static_cast<long long>(blockIdx.x) * hidden, partials,
                         hidden, lane);
    if constexpr (kLN)
      write_partials_block(acc[kAccRows - 1], db_part + static_cast<long long>(blockIdx.x) * hidden,
                           partials, hidden, lane);
  } else {
    write_partials_direct(acc[0], dw_part + units.first * hidden, hidden, rank, lane);
    if constexpr (kLN)
      write_partials_direct(acc[kAccRows - 1], db_part + units.first * hidden, hidden, rank, lane);
  }
}
#endif  // NORM_HAS_PART(1)
