// Fused per-chunk cross-entropy: the loss of every row of a chunk of logits and, in place, the
// gradient of that loss with respect to the raw logits. One read and one write of the chunk.
//
// logits[R, V] (row stride ld, last dimension contiguous) come straight out of the LM-head GEMM
// in the model dtype. Per row r, with x = cap * tanh(raw / cap) under a soft-cap (else x = raw),
// eps the label smoothing and y = labels[r]:
//   pass 1 reads the row once: an online max m and sum s of exp(x - m), and the sum of x, per
//     thread in fp32, combined over the block; lse = m + log(s);
//     loss[r] = (1 - eps) * (lse - x[y]) + eps * (lse - sum(x) / V), 0 for an ignored row;
//   pass 2 (WRITE_GRAD) reads the row again and overwrites it with
//     g = softmax(x)_j - eps / V - (1 - eps) * [j == y], times (1 - tanh^2) under a soft-cap,
//     times row_scale[r] when given, in the logits' dtype; an ignored row is written with zeros
//     without being read at all.
// fp32 math throughout (exp through ex2.approx on a log2e-scaled argument, relative error about
// 2^-22; the soft-cap's tanh is tanh.approx.f32 for fp16 / bf16, relative error 2^-11, below their
// own rounding, and the exact tanhf for fp32).
//
// Why one block per row, and the L2: a row of V = 128256 bf16 is 256 KB, more than an SM's shared
// memory, so it is not kept on chip between the passes: pass 2 reads it again. That re-read hits
// L2 as long as the rows in flight (grid x row bytes) fit in it; the launcher sizes a persistent
// grid for that (about two thirds of L2, and at least one block per SM: one 256 KB row per SM on
// an H100, 33 MB of its 50 MB L2), pass 2 loads and all stores are marked evict-first (.cs), so
// the lines of rows still waiting for their second pass are the ones L2 keeps. HBM then sees one
// read and one write of the chunk; the re-read costs L2 bandwidth only. (Rows over ~380 KB, fp32
// at V = 128256, overflow L2 on an H100 and pay part of a second HBM read.) A cluster holding the
// row in registers would make the re-read unnecessary, at the price of a kernel specialised per
// vocabulary size; the L2 gives nearly the same traffic for any V.
//
// Bounds: a label outside [0, V) that is not ignore_index makes its row's loss and gradient NaN,
// and nothing is read outside the row whatever the labels. Checking the labels before the launch
// would read them on the host, a sync in every train step; a NaN loss says as loudly that a label
// was out of range.
//
// Defines: DTYPE 0 fp32 / 1 fp16 / 2 bf16; VEC 1: 16-byte loads and stores on the 16-byte-aligned
// interior of every row, the few elements before and after it taken one by one (so any V, row
// stride and element-aligned pointer is vectorised: V = 50257 too); VEC 0: every element one by
// one. BLOCK: threads per block; SOFTCAP 0/1. Scalar parameters are 64-bit (long long, double), as
// cuda.core packs Python numbers.
#include "norm_common.cuh"

#ifndef DTYPE
#define DTYPE 2
#endif
#ifndef VEC
#define VEC 1
#endif
#ifndef BLOCK
#define BLOCK 1024
#endif
#ifndef SOFTCAP
#define SOFTCAP 0
#endif

namespace xent {

using T = typename ck::DType<DTYPE>::type;

constexpr int kWarps = BLOCK / 32;
constexpr int VPT = VEC ? 16 / static_cast<int>(sizeof(T)) : 1;  // elements per pack
constexpr int UNROLL = VEC ? 4 : 8;                                // packs in flight per thread
constexpr float kLog2e = 1.4426950408889634f;

static_assert(BLOCK % 32 == 0 && BLOCK <= 1024, "BLOCK: whole warps, at most 1024 threads");

struct alignas(VPT * sizeof(T)) Pack {
  T v[VPT];
};

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000u); }

using ck::from_float;
using ck::to_float;

__device__ __forceinline__ float ex2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ float tanh_(float x) {
#if DTYPE == 0
  return tanhf(x);
#else
  float y;
  asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
#endif
}

// Pass 1 reads through the read-only path (L1 and L2 allocate normally); pass 2's reads are the
// last use of the line and its stores are never read back: both evict-first (.cs).
__device__ __forceinline__ Pack load_first(const T* p) {
  Pack q;
#if VEC
  const uint4 u = __ldg(reinterpret_cast<const uint4*>(p));
  q = *reinterpret_cast<const Pack*>(&u);
#else
  q.v[0] = __ldg(p);
#endif
  return q;
}

__device__ __forceinline__ Pack load_last(const T* p) {
  Pack q;
#if VEC
  const uint4 u = __ldcs(reinterpret_cast<const uint4*>(p));
  q = *reinterpret_cast<const Pack*>(&u);
#else
  q.v[0] = __ldcs(p);
#endif
  return q;
}

__device__ __forceinline__ void store(T* p, const Pack& q) {
#if VEC
  __stcs(reinterpret_cast<uint4*>(p), *reinterpret_cast<const uint4*>(&q));
#else
  __stcs(p, q.v[0]);
#endif
}

// A row's layout: `head` single elements up to the first 16-byte boundary, `packs` packs of VPT
// elements, then the tail's single elements; the head and tail ("extras", fewer than 2 * VPT)
// belong to threads 0 .. extras - 1.
struct Layout {
  int head, packs, extras;
  __device__ __forceinline__ int extra_col(int i) const {
    return i < head ? i : head + packs * VPT + (i - head);
  }
};

__device__ __forceinline__ Layout layout(const T* row, int vocab) {
#if VEC
  const unsigned long long misaligned = reinterpret_cast<unsigned long long>(row) & 15ull;
  int head = static_cast<int>(((16ull - misaligned) & 15ull) / sizeof(T));
  head = head < vocab ? head : vocab;
  const int packs = (vocab - head) / VPT;
  return Layout{head, packs, vocab - packs * VPT};
#else
  return Layout{0, vocab, 0};
#endif
}

struct Params {
  float inv_cap, cap;  // soft-cap (SOFTCAP only)
};

__device__ __forceinline__ Params make_params(double softcap) {
  Params p;
  p.cap = static_cast<float>(softcap);
  p.inv_cap = SOFTCAP ? 1.0f / p.cap : 0.0f;
  return p;
}

__device__ __forceinline__ float capped(float raw, const Params& p) {
#if SOFTCAP
  return p.cap * tanh_(raw * p.inv_cap);
#else
  return raw;
#endif
}

// Pass 1 state of a thread: running max m (and m * log2e), sum of exp(x - m), sum of x.
struct Stats {
  float m, ml, s, sx;
};

template <int N>
__device__ __forceinline__ void accumulate(const T* v, const Params& p, Stats& st) {
  float x[N];
#pragma unroll
  for (int e = 0; e < N; ++e) x[e] = capped(to_float(v[e]), p);
  float pm = x[0];
#pragma unroll
  for (int e = 1; e < N; ++e) pm = fmaxf(pm, x[e]);
  if (pm > st.m) {  // rescale the sum (s is 0 while m is -inf: ex2(-inf) = 0 keeps it so)
    st.s *= ex2((st.m - pm) * kLog2e);
    st.m = pm;
    st.ml = pm * kLog2e;
  }
  if (st.m > neg_inf()) {  // else every x so far is -inf: nothing to add (and no inf - inf)
#pragma unroll
    for (int e = 0; e < N; ++e) st.s += ex2(fmaf(x[e], kLog2e, -st.ml));
  }
#pragma unroll
  for (int e = 0; e < N; ++e) st.sx += x[e];
}

// (m, s) of two partials: the larger max, each sum rescaled to it.
__device__ __forceinline__ void merge(float& m, float& s, float m2, float s2) {
  const float mm = fmaxf(m, m2);
  s = mm == neg_inf() ? 0.0f : s * ex2((m - mm) * kLog2e) + s2 * ex2((m2 - mm) * kLog2e);
  m = mm;
}

struct Shared {
  float m[kWarps], s[kWarps], sx[kWarps];
  float lse, sum_x;
};

// Every thread gets the block's lse and sum of x. Two barriers; see the kernel for why the
// shared arrays may be reused by the next row without a third.
__device__ __forceinline__ void block_reduce(Stats st, Shared& sh, float& lse, float& sum_x) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int k = 16; k > 0; k >>= 1) {
    merge(st.m, st.s, __shfl_xor_sync(0xffffffffu, st.m, k),
          __shfl_xor_sync(0xffffffffu, st.s, k));
    st.sx += __shfl_xor_sync(0xffffffffu, st.sx, k);
  }
  if (lane == 0) {
    sh.m[warp] = st.m;
    sh.s[warp] = st.s;
    sh.sx[warp] = st.sx;
  }
  __syncthreads();
  if (warp == 0) {
    float m = lane < kWarps ? sh.m[lane] : neg_inf();
    float s = lane < kWarps ? sh.s[lane] : 0.0f;
    float sx = lane < kWarps ? sh.sx[lane] : 0.0f;
#pragma unroll
    for (int k = 16; k > 0; k >>= 1) {
      merge(m, s, __shfl_xor_sync(0xffffffffu, m, k), __shfl_xor_sync(0xffffffffu, s, k));
      sx += __shfl_xor_sync(0xffffffffu, sx, k);
    }
    if (lane == 0) {
      sh.lse = m + logf(s);
      sh.sum_x = sx;
    }
  }
  __syncthreads();
  lse = sh.lse;
  sum_x = sh.sum_x;
}

// Pass 2 for N elements starting at column col.
struct Grad {
  float lse_l2;     // lse * log2e
  float eps_over_v;
  float one_minus_eps;
  float scale;      // row_scale[r] (1 without)
  int label;
};

template <int N>
__device__ __forceinline__ void gradient(T* v, int col, const Params& p, const Grad& g) {
#pragma unroll
  for (int e = 0; e < N; ++e) {
    const float raw = to_float(v[e]);
#if SOFTCAP
    const float t = tanh_(raw * p.inv_cap);
    const float x = p.cap * t;
#else
    const float x = raw;
#endif
    float d = ex2(fmaf(x, kLog2e, -g.lse_l2)) - g.eps_over_v;
    if (col + e == g.label) d -= g.one_minus_eps;
#if SOFTCAP
    d *= 1.0f - t * t;
#endif
    v[e] = from_float<T>(d * g.scale);
  }
}

__device__ void pass1(const T* row, const Layout& L, const Params& p, Stats& st) {
  for (int base = threadIdx.x; base < L.packs; base += UNROLL * BLOCK) {
    Pack q[UNROLL];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const int k = base + u * BLOCK;
      if (k < L.packs) q[u] = load_first(row + L.head + k * VPT);
    }
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      if (base + u * BLOCK < L.packs) accumulate<VPT>(q[u].v, p, st);
    }
  }
  if (static_cast<int>(threadIdx.x) < L.extras) {
    const T v = __ldg(row + L.extra_col(threadIdx.x));
    accumulate<1>(&v, p, st);
  }
}

__device__ void pass2(T* row, const Layout& L, const Params& p, const Grad& g) {
  for (int base = threadIdx.x; base < L.packs; base += UNROLL * BLOCK) {
    Pack q[UNROLL];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const int k = base + u * BLOCK;
      if (k < L.packs) q[u] = load_last(row + L.head + k * VPT);
    }
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const int k = base + u * BLOCK;
      if (k < L.packs) {
        gradient<VPT>(q[u].v, L.head + k * VPT, p, g);
        store(row + L.head + k * VPT, q[u]);
      }
    }
  }
  if (static_cast<int>(threadIdx.x) < L.extras) {
    const int col = L.extra_col(threadIdx.x);
    T v = __ldcs(row + col);
    gradient<1>(&v, col, p, g);
    __stcs(row + col, v);
  }
}

__device__ void fill_row(T* row, const Layout& L, float value) {
  Pack z;
#pragma unroll
  for (int e = 0; e < VPT; ++e) z.v[e] = from_float<T>(value);
  for (int k = threadIdx.x; k < L.packs; k += BLOCK) store(row + L.head + k * VPT, z);
  if (static_cast<int>(threadIdx.x) < L.extras) __stcs(row + L.extra_col(threadIdx.x), z.v[0]);
}

}  // namespace xent

using namespace xent;

// A persistent grid: block b takes rows b, b + gridDim.x, ... (the launcher sizes the grid so the
// rows in flight fit in L2). Shared memory reuse across rows: a warp writes its partials for the
// next row only after the second barrier of this row, which warp 0 passes only once it has read
// them; warp 0 writes the next row's lse only after that row's first barrier, which every thread
// reaches only once it has read this row's. Ignored rows take no barrier (a block-uniform branch).
extern "C" __global__ void __launch_bounds__(BLOCK)
cross_entropy_chunk(T* logits, const long long* labels, const float* row_scale, float* losses,
                    long long rows, long long ld, long long vocab, long long ignore_index,
                    double smoothing, double softcap, long long write_grad) {
  __shared__ Shared sh;
  const int v = static_cast<int>(vocab);
  const float eps = static_cast<float>(smoothing);
  const Params p = make_params(softcap);
  for (long long r = blockIdx.x; r < rows; r += gridDim.x) {
    T* row = logits + r * ld;
    const Layout L = layout(row, v);
    const long long label = labels[r];
    const bool valid = label != ignore_index && label >= 0 && label < vocab;
    if (!valid) {  // ignored: 0; a label out of range: NaN
      const float fill = label == ignore_index ? 0.0f : __int_as_float(0x7fc00000);
      if (threadIdx.x == 0) losses[r] = fill;
      if (write_grad) fill_row(row, L, fill);
      continue;
    }
    // Read before the barriers, hence before pass 2 overwrites it.
    const float x_label = threadIdx.x == 0 ? capped(to_float(__ldg(row + label)), p) : 0.0f;
    Stats st{neg_inf(), neg_inf(), 0.0f, 0.0f};
    pass1(row, L, p, st);
    float lse, sum_x;
    block_reduce(st, sh, lse, sum_x);
    if (threadIdx.x == 0) {
      float loss = (1.0f - eps) * (lse - x_label);
      if (eps != 0.0f) loss += eps * (lse - sum_x / static_cast<float>(v));
      losses[r] = loss;
    }
    if (write_grad) {
      Grad g;
      g.lse_l2 = lse * kLog2e;
      g.eps_over_v = eps / static_cast<float>(v);
      g.one_minus_eps = 1.0f - eps;
      g.scale = row_scale != nullptr ? row_scale[r] : 1.0f;
      g.label = static_cast<int>(label);
      pass2(row, L, p, g);
    }
  }
}

// In place, data[i] = data[i] * scale[0] for n elements, the fp32 scale read on the device and the
// product rounded once to T. The chunked loss computes its gradients in the forward pass and
// scales them in the backward by the incoming gradient over the row count, both device values
// (reading them on the host would sync); torch's bf16 x fp32-scalar-tensor multiply rounds the
// scale to bf16 first, and an fp32 round trip through torch ops moves five times the bytes. A
// grid-stride loop over 16-byte packs (VEC), the elements before the first 16-byte boundary and
// after the last whole pack taken one by one by the first threads.
extern "C" __global__ void __launch_bounds__(BLOCK)
scale_by_device_scalar(T* data, const float* scale, long long n) {
  const float s = *scale;
  // A scale of 1 changes nothing (x * 1 rounds back to x): no pass over the data. The chunked
  // loss divides by its count in the forward, so after loss.backward() its scale is 1.
  if (s == 1.0f) return;
  const long long first = static_cast<long long>(blockIdx.x) * BLOCK + threadIdx.x;
  const long long stride = static_cast<long long>(gridDim.x) * BLOCK;
#if VEC
  const unsigned long long misaligned = reinterpret_cast<unsigned long long>(data) & 15ull;
  long long head = static_cast<long long>(((16ull - misaligned) & 15ull) / sizeof(T));
  head = head < n ? head : n;
  const long long packs = (n - head) / VPT;
  const long long extras = n - packs * VPT;  // head + tail, fewer than 2 * VPT
  if (first < extras) {
    const long long i = first < head ? first : head + packs * VPT + (first - head);
    data[i] = from_float<T>(to_float(data[i]) * s);
  }
  for (long long k = first; k < packs; k += stride) {
    T* p = data + head + k * VPT;
    Pack q = load_last(p);
#pragma unroll
    for (int e = 0; e < VPT; ++e) q.v[e] = from_float<T>(to_float(q.v[e]) * s);
    store(p, q);
  }
#else
  for (long long i = first; i < n; i += stride) data[i] = from_float<T>(to_float(data[i]) * s);
#endif
}

// ---------------------------------------------------------------------------------------------
// The vocabulary-parallel step (a tensor-parallel LM head: cutlass_ops.parallel.vocab_parallel_
// loss). Each rank holds the logits of its slice [vocab_start, vocab_start + V_local) of the
// vocabulary. A row's loss and gradient need the log-sum-exp over all of V, known only after a
// collective, so the one-launch step above splits in two around it, each one pass over the
// chunk in the logits' dtype (a torch version in float32 moves about nine times the bytes):
//
// cross_entropy_shard_stats: pass 1 of every row: stats[0 * rows + r] = the slice's lse,
//   stats[1 * rows + r] = x[label - vocab_start] where the label falls in the slice (else 0),
//   stats[2 * rows + r] = the sum of x (for label smoothing). A row whose label is ignore_index
//   writes 0, 0, 0 without being read (its loss is masked after the collective).
// cross_entropy_shard_grad: given each row's global lse, pass 2 of every row: overwrites it with
//   g = exp(x - lse) - eps / vocab_total - (1 - eps) [column == label - vocab_start], times
//   (1 - tanh^2) under a soft-cap, times row_scale[r] when given; an ignored row is written with
//   zeros without being read.
// Labels are range-checked by the caller (across the ranks, before the first chunk): a label in
// no rank's slice picks nothing here.
extern "C" __global__ void __launch_bounds__(BLOCK)
cross_entropy_shard_stats(const T* logits, const long long* labels, float* stats, long long rows,
                          long long ld, long long vocab_local, long long vocab_start,
                          long long ignore_index, double softcap) {
  __shared__ Shared sh;
  const int v = static_cast<int>(vocab_local);
  const Params p = make_params(softcap);
  for (long long r = blockIdx.x; r < rows; r += gridDim.x) {
    const long long label = labels[r];
    if (label == ignore_index) {
      if (threadIdx.x == 0) stats[r] = stats[rows + r] = stats[2 * rows + r] = 0.0f;
      continue;
    }
    const T* row = logits + r * ld;
    const Layout L = layout(row, v);
    const long long local = label - vocab_start;
    const bool mine = local >= 0 && local < vocab_local;
    const float x_label =
        threadIdx.x == 0 && mine ? capped(to_float(__ldg(row + local)), p) : 0.0f;
    Stats st{neg_inf(), neg_inf(), 0.0f, 0.0f};
    pass1(row, L, p, st);
    float lse, sum_x;
    block_reduce(st, sh, lse, sum_x);
    if (threadIdx.x == 0) {
      stats[r] = lse;
      stats[rows + r] = x_label;
      stats[2 * rows + r] = sum_x;
    }
  }
}

extern "C" __global__ void __launch_bounds__(BLOCK)
cross_entropy_shard_grad(T* logits, const long long* labels, const float* lse,
                         const float* row_scale, long long rows, long long ld,
                         long long vocab_local, long long vocab_start, long long vocab_total,
                         long long ignore_index, double smoothing, double softcap) {
  const int v = static_cast<int>(vocab_local);
  const float eps = static_cast<float>(smoothing);
  const Params p = make_params(softcap);
  for (long long r = blockIdx.x; r < rows; r += gridDim.x) {
    T* row = logits + r * ld;
    const Layout L = layout(row, v);
    const long long label = labels[r];
    if (label == ignore_index) {
      fill_row(row, L, 0.0f);
      continue;
    }
    const long long local = label - vocab_start;
    Grad g;
    g.lse_l2 = lse[r] * kLog2e;
    g.eps_over_v = eps / static_cast<float>(vocab_total);
    g.one_minus_eps = 1.0f - eps;
    g.scale = row_scale != nullptr ? row_scale[r] : 1.0f;
    g.label = local >= 0 && local < vocab_local ? static_cast<int>(local) : -1;
    pass2(row, L, p, g);
  }
}
