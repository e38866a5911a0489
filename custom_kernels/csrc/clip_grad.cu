// Gradient clipping by total norm (torch.nn.utils.clip_grad_norm_) for a list of tensors of
// mixed sizes and dtypes (fp32 / fp16 / bf16), in one persistent cooperative launch:
//
//   phase 1: blocks pull tasks from a work queue; a task is a fixed-size range of the tensors'
//            elements laid end to end (small tensors share a task, large ones span many), and
//            its norm contribution (sum of squares, sum of |x|, or max |x|) goes to partials[t];
//   one grid-wide barrier;
//   every block combines partials[0 .. n_tasks) in the same fixed order (so all blocks get the
//            same total, bit for bit, and the total does not depend on which block ran which
//            task), block 0 stores the total norm;
//   phase 2: clip_coef = min(1, max_norm / (norm + 1e-6)), computed as torch computes it in fp32;
//            unless it is exactly 1 (a multiplication by 1 changes nothing, so it is skipped),
//            blocks pull the tasks again and scale the gradients in place.
//
// Without cooperative launch the same pieces run as two kernels: clip_grad_partials (phase 1)
// then clip_grad_finish (combine, store, phase 2).
//
// Task table (int64, built on the host): starts[n + 1] (element offset of each tensor in the
// concatenation, starts[n] = total), ptrs[n], dtypes[n] (0 fp32, 1 fp16, 2 bf16).
// Defines: NORM_TYPE 2, 1 or 0 (= inf); BLOCK threads per block.
// All scalar parameters are 64-bit (long long or double), as cuda.core packs Python numbers.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cooperative_groups.h>

#include "cluster_reduce.cuh"
#include "work_queue.cuh"

#ifndef NORM_TYPE
#define NORM_TYPE 2
#endif
#ifndef BLOCK
#define BLOCK 256
#endif

namespace clip {

constexpr int kWarps = BLOCK / 32;
enum : int { kF32 = 0, kF16 = 1, kBF16 = 2 };

#if NORM_TYPE == 0
using RedT = float2;  // (max |x| over non-NaN values, 1 if a NaN was seen): fmaxf drops NaNs
#else
using RedT = float;   // sum of x^2 (NORM_TYPE 2) or of |x| (NORM_TYPE 1)
#endif
using Reducer = ck::Reducer<RedT, kWarps>;

struct Acc {
#if NORM_TYPE == 0
  float2 v = make_float2(0.0f, 0.0f);
  __device__ __forceinline__ void add(float x) {
    v.x = fmaxf(v.x, fabsf(x));
    if (x != x) v.y = 1.0f;
  }
  // A task's (or the total's) value: NaN if any element was NaN, as torch's max |x| gives.
  __device__ __forceinline__ static float value(float2 r) {
    return r.y > 0.0f ? __int_as_float(0x7fffffff) : r.x;
  }
  __device__ __forceinline__ void merge(float p) { add(p); }
  __device__ __forceinline__ float reduce(Reducer& red) { return value(red.max(v)); }
#else
  float v = 0.0f;
  __device__ __forceinline__ void add(float x) {
#if NORM_TYPE == 2
    v = fmaf(x, x, v);
#else
    v += fabsf(x);
#endif
  }
  __device__ __forceinline__ void merge(float p) { v += p; }
  __device__ __forceinline__ float reduce(Reducer& red) { return red.sum(v); }
#endif
};

__device__ __forceinline__ float total_from(float reduced) {
#if NORM_TYPE == 2
  return sqrtf(reduced);
#else
  return reduced;
#endif
}

// ---- element conversions, one 32-bit word at a time ----------------------------------------

template <int DT> struct Elem;
template <> struct Elem<kF32> {
  static constexpr int kSize = 4;
  __device__ static float load(const char* p) { return *reinterpret_cast<const float*>(p); }
  __device__ static void store(char* p, float x) { *reinterpret_cast<float*>(p) = x; }
  __device__ static void add_word(Acc& acc, unsigned w) { acc.add(__uint_as_float(w)); }
  __device__ static unsigned scale_word(unsigned w, float c) {
    return __float_as_uint(__uint_as_float(w) * c);
  }
};
// fp16 and bf16 differ only in their conversion intrinsics; overloads pick them by type.
__device__ __forceinline__ float to_f32(__half h) { return __half2float(h); }
__device__ __forceinline__ float to_f32(__nv_bfloat16 h) { return __bfloat162float(h); }
__device__ __forceinline__ float2 to_f32x2(__half2 h) { return __half22float2(h); }
__device__ __forceinline__ float2 to_f32x2(__nv_bfloat162 h) { return __bfloat1622float2(h); }
__device__ __forceinline__ void from_f32(__half* p, float x) { *p = __float2half_rn(x); }
__device__ __forceinline__ void from_f32(__nv_bfloat16* p, float x) { *p = __float2bfloat16_rn(x); }
__device__ __forceinline__ void from_f32x2(__half2* p, float a, float b) {
  *p = __floats2half2_rn(a, b);
}
__device__ __forceinline__ void from_f32x2(__nv_bfloat162* p, float a, float b) {
  *p = __floats2bfloat162_rn(a, b);
}

template <class H, class H2>
struct Elem16 {
  static constexpr int kSize = 2;
  __device__ static float load(const char* p) { return to_f32(*reinterpret_cast<const H*>(p)); }
  __device__ static void store(char* p, float x) { from_f32(reinterpret_cast<H*>(p), x); }
  __device__ static void add_word(Acc& acc, unsigned w) {
    const float2 f = to_f32x2(*reinterpret_cast<const H2*>(&w));
    acc.add(f.x);
    acc.add(f.y);
  }
  __device__ static unsigned scale_word(unsigned w, float c) {
    const float2 f = to_f32x2(*reinterpret_cast<const H2*>(&w));
    H2 h;
    from_f32x2(&h, f.x * c, f.y * c);
    return *reinterpret_cast<const unsigned*>(&h);
  }
};
template <> struct Elem<kF16> : Elem16<__half, __half2> {};
template <> struct Elem<kBF16> : Elem16<__nv_bfloat16, __nv_bfloat162> {};

template <int DT>
__device__ __forceinline__ void add_vec(Acc& acc, const uint4& u) {
  Elem<DT>::add_word(acc, u.x);
  Elem<DT>::add_word(acc, u.y);
  Elem<DT>::add_word(acc, u.z);
  Elem<DT>::add_word(acc, u.w);
}

template <int DT>
__device__ __forceinline__ uint4 scale_vec(const uint4& u, float c) {
  return make_uint4(Elem<DT>::scale_word(u.x, c), Elem<DT>::scale_word(u.y, c),
                    Elem<DT>::scale_word(u.z, c), Elem<DT>::scale_word(u.w, c));
}

// Elements [lo, hi) of one tensor: a scalar head up to 16-byte alignment, 16-byte vectors (four
// in flight per thread), a scalar tail. SCALE: x *= coef in place; otherwise accumulate into acc.
template <int DT, bool SCALE>
__device__ void piece(char* base, long long lo, long long hi, Acc& acc, float coef) {
  constexpr int E = Elem<DT>::kSize;
  constexpr int V = 16 / E;
  char* p = base + lo * E;
  const long long n = hi - lo;
  long long head = static_cast<long long>((16 - (reinterpret_cast<size_t>(p) & 15)) & 15) / E;
  if (head > n) head = n;
  for (long long i = threadIdx.x; i < head; i += BLOCK) {
    if (SCALE) Elem<DT>::store(p + i * E, Elem<DT>::load(p + i * E) * coef);
    else acc.add(Elem<DT>::load(p + i * E));
  }
  uint4* vp = reinterpret_cast<uint4*>(p + head * E);
  const long long nvec = (n - head) / V;
  long long v = threadIdx.x;
  for (; v + 3 * BLOCK < nvec; v += 4 * BLOCK) {
    const uint4 a = vp[v], b = vp[v + BLOCK], c = vp[v + 2 * BLOCK], d = vp[v + 3 * BLOCK];
    if (SCALE) {
      vp[v] = scale_vec<DT>(a, coef);
      vp[v + BLOCK] = scale_vec<DT>(b, coef);
      vp[v + 2 * BLOCK] = scale_vec<DT>(c, coef);
      vp[v + 3 * BLOCK] = scale_vec<DT>(d, coef);
    } else {
      add_vec<DT>(acc, a);
      add_vec<DT>(acc, b);
      add_vec<DT>(acc, c);
      add_vec<DT>(acc, d);
    }
  }
  for (; v < nvec; v += BLOCK) {
    const uint4 a = vp[v];
    if (SCALE) vp[v] = scale_vec<DT>(a, coef);
    else add_vec<DT>(acc, a);
  }
  for (long long i = head + nvec * V + threadIdx.x; i < n; i += BLOCK) {
    if (SCALE) Elem<DT>::store(p + i * E, Elem<DT>::load(p + i * E) * coef);
    else acc.add(Elem<DT>::load(p + i * E));
  }
}

struct Table {
  const long long* starts;  // n + 1
  const long long* ptrs;    // n
  const long long* dtypes;  // n
  int n;

  __device__ Table(const long long* t, long long n_) : starts(t), ptrs(t + n_ + 1),
                                                        dtypes(t + 2 * n_ + 1), n(int(n_)) {}

  // The last tensor whose range starts at or before element e (so it holds e: empty tensors
  // before it start at e too, and the search skips them).
  __device__ int find(long long e) const {
    int lo = 0, hi = n;  // starts[lo] <= e < starts[hi]
    while (hi - lo > 1) {
      const int mid = (lo + hi) >> 1;
      if (__ldg(starts + mid) <= e) lo = mid;
      else hi = mid;
    }
    return lo;
  }
};

// Task t covers elements [t * chunk, (t + 1) * chunk) of the concatenation.
template <bool SCALE>
__device__ void task(const Table& tab, long long total, long long chunk, unsigned t, Acc& acc,
                     float coef) {
  const long long a = static_cast<long long>(t) * chunk;
  const long long b = a + chunk < total ? a + chunk : total;
  for (int i = tab.find(a); i < tab.n; ++i) {
    const long long s = __ldg(tab.starts + i);
    if (s >= b) break;
    const long long e = __ldg(tab.starts + i + 1);
    const long long lo = (s > a ? s : a) - s;
    const long long hi = (e < b ? e : b) - s;
    if (hi <= lo) continue;
    char* base = reinterpret_cast<char*>(__ldg(tab.ptrs + i));
    switch (static_cast<int>(__ldg(tab.dtypes + i))) {
      case kF32: piece<kF32, SCALE>(base, lo, hi, acc, coef); break;
      case kF16: piece<kF16, SCALE>(base, lo, hi, acc, coef); break;
      default: piece<kBF16, SCALE>(base, lo, hi, acc, coef); break;
    }
  }
}

__device__ void norm_phase(const Table& tab, long long total, long long chunk, unsigned n_tasks,
                           float* partials, unsigned* ticket, unsigned* slots, Reducer& red) {
  ck::BlockQueue q(ticket, slots);
  for (unsigned t = q.begin(); t < n_tasks; t = q.advance()) {
    q.prefetch();
    Acc acc;
    task<false>(tab, total, chunk, t, acc, 0.0f);
    const float v = acc.reduce(red);
    if (threadIdx.x == 0) partials[t] = v;
  }
}

__device__ void scale_phase(const Table& tab, long long total, long long chunk, unsigned n_tasks,
                            float coef, unsigned* ticket, unsigned* slots) {
  ck::BlockQueue q(ticket, slots);
  Acc unused;
  for (unsigned t = q.begin(); t < n_tasks; t = q.advance()) {
    q.prefetch();
    task<true>(tab, total, chunk, t, unused, coef);
  }
}

// The total norm from the per-task partials, in a fixed order: the same in every block.
__device__ float combine(const float* partials, unsigned n_tasks, Reducer& red) {
  Acc acc;
  for (unsigned j = threadIdx.x; j < n_tasks; j += BLOCK) acc.merge(__ldcg(partials + j));
  return total_from(acc.reduce(red));
}

// torch: clip_coef = max_norm / (total_norm + 1e-6), where Tensor.__rtruediv__ is
// reciprocal() * max_norm, then clamp(max=1.0), which keeps a NaN (fminf would drop it).
__device__ __forceinline__ float clip_coef(float norm, double max_norm) {
  const float c = (1.0f / (norm + 1e-6f)) * static_cast<float>(max_norm);
  return c != c ? c : fminf(c, 1.0f);
}

__device__ __forceinline__ void store_norm(void* out, long long dtype, float norm) {
  if (blockIdx.x != 0 || threadIdx.x != 0) return;
  switch (static_cast<int>(dtype)) {
    case kF32: *static_cast<float*>(out) = norm; break;
    case kF16: *static_cast<__half*>(out) = __float2half_rn(norm); break;
    default: *static_cast<__nv_bfloat16*>(out) = __float2bfloat16_rn(norm); break;
  }
}

// Phase 2 and the total, shared by the fused kernel and the second fallback kernel.
__device__ void finish_and_scale(const Table& tab, long long total, long long chunk,
                                 unsigned n_tasks, const float* partials, void* norm_out,
                                 long long out_dtype, double max_norm, bool scale,
                                 unsigned* ticket, unsigned* slots, Reducer& red) {
  const float norm = combine(partials, n_tasks, red);
  store_norm(norm_out, out_dtype, norm);
  const float coef = clip_coef(norm, max_norm);
  if (scale && coef != 1.0f) scale_phase(tab, total, chunk, n_tasks, coef, ticket, slots);
}

}  // namespace clip

using namespace clip;

// One cooperative launch: grid <= what can be co-resident (the host clamps it).
extern "C" __global__ void __launch_bounds__(BLOCK)
clip_grad_fused(const long long* table, long long n_tensors, long long total, long long chunk,
                long long n_tasks, float* partials, unsigned* counters, void* norm_out,
                long long out_dtype, double max_norm) {
  __shared__ unsigned slots[2];
  __shared__ RedT red_smem[Reducer::kSlots];
  Reducer red(red_smem);
  const Table tab(table, n_tensors);
  norm_phase(tab, total, chunk, unsigned(n_tasks), partials, counters + 0, slots, red);
  __threadfence();
  cooperative_groups::this_grid().sync();
  finish_and_scale(tab, total, chunk, unsigned(n_tasks), partials, norm_out, out_dtype, max_norm,
                   true, counters + 1, slots, red);
  ck::finish(counters, 2);
}

// Fallback, kernel 1 of 2: the per-task partials.
extern "C" __global__ void __launch_bounds__(BLOCK)
clip_grad_partials(const long long* table, long long n_tensors, long long total, long long chunk,
                   long long n_tasks, float* partials, unsigned* counters) {
  __shared__ unsigned slots[2];
  __shared__ RedT red_smem[Reducer::kSlots];
  Reducer red(red_smem);
  const Table tab(table, n_tensors);
  norm_phase(tab, total, chunk, unsigned(n_tasks), partials, counters + 0, slots, red);
  ck::finish(counters, 1);
}

// Fallback, kernel 2 of 2: the total norm (block 0 stores it) and, if `scale`, the clipping.
// With scale = 0 and one block it only stores the norm (error_if_nonfinite checks it first).
extern "C" __global__ void __launch_bounds__(BLOCK)
clip_grad_finish(const long long* table, long long n_tensors, long long total, long long chunk,
                 long long n_tasks, const float* partials, unsigned* counters, void* norm_out,
                 long long out_dtype, double max_norm, long long scale) {
  __shared__ unsigned slots[2];
  __shared__ RedT red_smem[Reducer::kSlots];
  Reducer red(red_smem);
  const Table tab(table, n_tensors);
  finish_and_scale(tab, total, chunk, unsigned(n_tasks), partials, norm_out, out_dtype, max_norm,
                   scale != 0, counters + 0, slots, red);
  ck::finish(counters, 1);
}
