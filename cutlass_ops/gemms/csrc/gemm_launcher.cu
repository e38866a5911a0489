// C ABI launcher around one emitted CUTLASS 3.x GEMM kernel.
//
// The kernel type (`DeviceKernel`) comes from "cutlass_ops_kernel.h", which the emit layer writes
// next to the build from cutlass_cppgen's output. This file is the only host code we put around it:
// no torch headers (so an artifact builds without a GPU and does not depend on the torch version),
// problem size, strides, alpha/beta and scheduler knobs at run time, the caller's stream and
// workspace, and the caller's device.
//
// Every entry point returns a CutlassOpsStatus; the text of the last failure on this thread is
// available from cutlass_ops_last_error().

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <type_traits>

#include <cuda_runtime.h>

#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass_ops_kernel.h"

#include "cutlass/kernel_hardware_info.h"
#include "cutlass/util/packed_stride.hpp"

namespace {

// Bump when CutlassOpsGemmArgs or an entry point changes; Python refuses a mismatched artifact.
constexpr int kAbiVersion = 3;  // 3: the FP8 scale pointers

enum CutlassOpsStatus : int {
  kOk = 0,
  kCannotImplement = 1,  // CUTLASS's can_implement rejected the problem (alignment, shape, ...)
  kWorkspaceTooSmall = 2,
  kInitializeFailed = 3,
  kLaunchFailed = 4,
  kCudaError = 5,
};

using GemmKernel = typename DeviceKernel::GemmKernel;
using ElementA = typename GemmKernel::ElementA;
using ElementB = typename GemmKernel::ElementB;
using ElementC = typename GemmKernel::ElementC;
using ElementD = typename GemmKernel::ElementD;
using StrideA = typename GemmKernel::StrideA;
using StrideB = typename GemmKernel::StrideB;
using StrideC = typename GemmKernel::StrideC;
using StrideD = typename GemmKernel::StrideD;

// On sm90 one wgmma spans the whole tile width. CuTe splits widths outside its default set
// (8-32, 64, 96, 128, 192, 256) into narrower wgmmas unless CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED is
// defined (cutlass_ops.kernels.build_defines); such a kernel is correct but runs at about half
// speed, so it must not build: a tuner then records a build failure instead of a slow winner.
template <class Kernel, class = void>
struct full_width_wgmma : std::true_type {};
template <class Kernel>
struct full_width_wgmma<Kernel, std::enable_if_t<std::is_same_v<typename Kernel::ArchTag,
                                                                 cutlass::arch::Sm90>>>
    : std::bool_constant<cute::size<1>(typename Kernel::TiledMma::AtomShape_MNK{}) ==
                         cute::size<1>(typename Kernel::TileShape{})> {};
static_assert(full_width_wgmma<GemmKernel>::value,
              "the wgmma is narrower than the tile: build with CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED");

thread_local char g_last_error[512] = {0};

void set_error(const char* what, const char* detail) {
  std::snprintf(g_last_error, sizeof(g_last_error), "%s: %s", what, detail);
}

// A CUTLASS stride is a cute::Stride of three modes (row-like, column-like, batch); one of the first
// two is usually the static constant 1 chosen by the layout. Fill the dynamic modes from the
// caller's values and check that the static ones agree, so that a tensor whose layout differs from
// the compiled one is refused instead of read wrongly.
template <class ModeRef>
bool set_mode(ModeRef&& mode, int64_t value) {
  using Mode = std::remove_cv_t<std::remove_reference_t<ModeRef>>;
  if constexpr (cute::is_static_v<Mode>) {
    return int64_t(Mode::value) == value;
  } else {
    mode = static_cast<Mode>(value);
    return true;
  }
}

// Only the stream-K schedulers take a split count.
template <class Args, class = void>
struct has_splits : std::false_type {};
template <class Args>
struct has_splits<Args, std::void_t<decltype(std::declval<Args&>().splits)>> : std::true_type {};

template <class SchedulerArgs>
void set_splits(SchedulerArgs& scheduler, int splits) {
  if constexpr (has_splits<SchedulerArgs>::value) scheduler.splits = splits;
}

// The epilogue's arguments. A plain kernel's fusion (LinearCombination) has alpha and beta members.
// A fused kernel's is an epilogue visitor tree traced by cutlass_cppgen from the emitter's
// epilogue function: its arguments nest one level per node (children first, then the node's
// own); fetches and compute nodes take nothing, and each leaf (a scalar, row or column
// broadcast) takes one of the caller's values, its "slot". A kernel header that defines
// CUTLASS_OPS_EPILOGUE_SLOTS lists the slots of its leaves in visit order (the emitter wrote the
// function, so it knows them: the FP8 trees accum * scale_a * scale_b [+ bias]). Without one,
// the alpha/beta/bias trees of D = activation(alpha * accum + bias) + beta * C are filled by
// kind: the first scalar broadcast is alpha, the second beta, a row or column broadcast the bias.
// Member detection for the argument structs below: has_<name><T>::value.
#define CUTLASS_OPS_HAS_MEMBER(name)                                                      \
  template <class T, class = void>                                                        \
  struct has_##name : std::false_type {};                                                 \
  template <class T>                                                                      \
  struct has_##name<T, std::void_t<decltype(std::declval<T&>().name)>> : std::true_type {};
CUTLASS_OPS_HAS_MEMBER(alpha)
CUTLASS_OPS_HAS_MEMBER(scalars)
CUTLASS_OPS_HAS_MEMBER(scalar_ptrs)
CUTLASS_OPS_HAS_MEMBER(ptr_row)
CUTLASS_OPS_HAS_MEMBER(ptr_col)
CUTLASS_OPS_HAS_MEMBER(op_0)
CUTLASS_OPS_HAS_MEMBER(op_1)
CUTLASS_OPS_HAS_MEMBER(op_2)
CUTLASS_OPS_HAS_MEMBER(op_3)
#undef CUTLASS_OPS_HAS_MEMBER

enum EpilogueSlot : int {
  kSlotAlpha = 0,
  kSlotBeta = 1,
  kSlotBias = 2,     // M or N values of D's type
  kSlotScaleA = 3,   // float32 in device memory: one value (scalar leaf) or M (column broadcast)
  kSlotScaleB = 4,   // float32: one value or N (row broadcast)
};

#ifdef CUTLASS_OPS_EPILOGUE_SLOTS
constexpr int kEpilogueSlots[] = {CUTLASS_OPS_EPILOGUE_SLOTS};
constexpr int kEpilogueSlotCount = int(sizeof(kEpilogueSlots) / sizeof(kEpilogueSlots[0]));
#endif

struct EpilogueValues {
  float alpha, beta;
  const void* bias;
  const void* scale_a;
  const void* scale_b;
  int leaves;          // leaves visited
  int scalars_filled;  // scalar leaves given alpha or beta
  int biases_filled;   // broadcasts given the bias
  int scalar_scales;   // scalar leaves given a scale's device pointer
  int vector_scales;   // broadcasts given a scale vector
  bool unmapped;       // a leaf with no slot, or a slot its kind cannot take
};

// The slot of the next leaf, from the header's list, else by kind (see above).
inline int next_slot(EpilogueValues& values, bool scalar) {
  int leaf = values.leaves++;
#ifdef CUTLASS_OPS_EPILOGUE_SLOTS
  (void)scalar;
  return leaf < kEpilogueSlotCount ? kEpilogueSlots[leaf] : -1;
#else
  (void)leaf;
  if (!scalar) return kSlotBias;
  return values.scalars_filled == 0 ? kSlotAlpha : kSlotBeta;
#endif
}

template <class Args>
void fill_scalar_leaf(Args& args, EpilogueValues& values) {
  using Scalar = std::remove_reference_t<decltype(args.scalars[0])>;
  int slot = next_slot(values, true);
  if (slot == kSlotAlpha || slot == kSlotBeta) {
    args.scalars[0] = Scalar(slot == kSlotAlpha ? values.alpha : values.beta);
    ++values.scalars_filled;
    return;
  }
  if constexpr (has_scalar_ptrs<Args>::value) {
    if (slot == kSlotScaleA || slot == kSlotScaleB) {
      // Read on the device when the kernel runs: no host sync, and a graph replay reads the
      // scales' current values.
      args.scalars[0] = Scalar(1);
      args.scalar_ptrs[0] =
          static_cast<Scalar const*>(slot == kSlotScaleA ? values.scale_a : values.scale_b);
      ++values.scalar_scales;
      return;
    }
  }
  values.unmapped = true;
}

template <class Pointer>
Pointer broadcast_pointer(EpilogueValues& values) {
  int slot = next_slot(values, false);
  const void* pointer = nullptr;
  if (slot == kSlotBias) {
    pointer = values.bias;
    ++values.biases_filled;
  } else if (slot == kSlotScaleA || slot == kSlotScaleB) {
    pointer = slot == kSlotScaleA ? values.scale_a : values.scale_b;
    ++values.vector_scales;
  } else {
    values.unmapped = true;
  }
  return static_cast<Pointer>(pointer);
}

// A tree node's arguments hold its children's (then its own): as members op_0 .. op_3 for nodes of
// up to four operations (CUTLASS specializes those), as a cute::tuple beyond.
template <class Args>
void fill_visitor_tree(Args& args, EpilogueValues& values) {
  if constexpr (has_op_0<Args>::value) {
    fill_visitor_tree(args.op_0, values);
    if constexpr (has_op_1<Args>::value) fill_visitor_tree(args.op_1, values);
    if constexpr (has_op_2<Args>::value) fill_visitor_tree(args.op_2, values);
    if constexpr (has_op_3<Args>::value) fill_visitor_tree(args.op_3, values);
  } else if constexpr (cute::is_tuple<Args>::value) {
    cute::for_each(args, [&](auto& child) { fill_visitor_tree(child, values); });
  } else if constexpr (has_scalars<Args>::value) {
    fill_scalar_leaf(args, values);
  } else if constexpr (has_ptr_row<Args>::value) {
    args.ptr_row = broadcast_pointer<decltype(args.ptr_row)>(values);
  } else if constexpr (has_ptr_col<Args>::value) {
    args.ptr_col = broadcast_pointer<decltype(args.ptr_col)>(values);
  }
}

EpilogueValues epilogue_values(float alpha, float beta, const void* bias, const void* scale_a,
                               const void* scale_b) {
  return EpilogueValues{alpha, beta, bias, scale_a, scale_b, 0, 0, 0, 0, 0, false};
}

// A template, so that only the branch for this kernel's epilogue is instantiated.
template <class ThreadArgs>
bool set_epilogue_arguments(ThreadArgs& thread, EpilogueValues values) {
  if constexpr (has_alpha<ThreadArgs>::value) {
    thread.alpha = values.alpha;
    thread.beta = values.beta;
    return true;
  } else {
    fill_visitor_tree(thread, values);
    if (values.unmapped) {
      set_error("epilogue", "a leaf of the visitor tree has no slot the launcher can fill");
      return false;
    }
    if (values.biases_filled && values.bias == nullptr) {
      set_error("epilogue", "this kernel adds a bias, and no bias pointer was given");
      return false;
    }
    if ((values.scalar_scales || values.vector_scales) &&
        (values.scale_a == nullptr || values.scale_b == nullptr)) {
      set_error("epilogue", "this kernel reads scale_a and scale_b, and one was not given");
      return false;
    }
    return true;
  }
}

// Blockwise FP8 kernels take their scales in the mainloop: the emitted header defines
// CUTLASS_OPS_BLOCKWISE_SCALES and names its Sm90BlockwiseScaleConfig CutlassOpsScaleConfig,
// whose layouts are compact (scale_a (M, K/128) column-major, scale_b the K-major (N/128, K/128)
// buffer; the Python side checks the tensors' strides).
template <class MainloopArgs>
bool set_mainloop_scales(MainloopArgs& mainloop, const void* scale_a, const void* scale_b,
                         int m, int n, int k, int l) {
#ifdef CUTLASS_OPS_BLOCKWISE_SCALES
  if (scale_a == nullptr || scale_b == nullptr) {
    set_error("mainloop", "this blockwise kernel reads scale_a and scale_b, and one was not given");
    return false;
  }
  auto shape = cute::make_shape(m, n, k, l);
  mainloop.ptr_SFA = static_cast<decltype(mainloop.ptr_SFA)>(scale_a);
  mainloop.layout_SFA = CutlassOpsScaleConfig::tile_atom_to_shape_SFA(shape);
  mainloop.ptr_SFB = static_cast<decltype(mainloop.ptr_SFB)>(scale_b);
  mainloop.layout_SFB = CutlassOpsScaleConfig::tile_atom_to_shape_SFB(shape);
#else
  (void)mainloop, (void)scale_a, (void)scale_b, (void)m, (void)n, (void)k, (void)l;
#endif
  return true;
}

template <class Stride>
bool make_stride(Stride& stride, int64_t s0, int64_t s1, int64_t s_batch) {
  return set_mode(cute::get<0>(stride), s0) && set_mode(cute::get<1>(stride), s1) &&
         set_mode(cute::get<2>(stride), s_batch);
}

}  // namespace

extern "C" {

// Strides are in elements. A is M x K, B is N x K (CUTLASS's view of the K x N operand), C and D
// are M x N; each with a batch stride. The struct is read by ctypes: keep it plain and append only.
struct CutlassOpsGemmArgs {
  int32_t m, n, k, l;
  const void* a;
  int64_t a_stride_m, a_stride_k, a_stride_l;
  const void* b;
  int64_t b_stride_n, b_stride_k, b_stride_l;
  const void* c;
  int64_t c_stride_m, c_stride_n, c_stride_l;
  void* d;
  int64_t d_stride_m, d_stride_n, d_stride_l;
  float alpha, beta;
  int32_t device_id, sm_count;
  int32_t raster_order;  // 0 heuristic, 1 along M, 2 along N
  int32_t swizzle;       // max swizzle size: 1, 2, 4 or 8
  int32_t splits;        // stream-K schedulers only: 1 lets CUTLASS decide, >1 forces split-K
  const void* bias;      // fused-bias kernels: M or N contiguous elements of D's type (ABI 2)
  const void* scale_a;   // FP8 kernels (ABI 3): float32 in device memory: 1 value (tensorwise),
  const void* scale_b;   // M / N (rowwise), or the blockwise scales (M, K/128) / (N/128, K/128)
};

__attribute__((visibility("default"))) int cutlass_ops_abi_version() { return kAbiVersion; }

__attribute__((visibility("default"))) const char* cutlass_ops_last_error() { return g_last_error; }

__attribute__((visibility("default"))) int cutlass_ops_shared_storage_bytes() {
  return int(GemmKernel::SharedStorageSize);
}

// How many scalars (alpha, beta) and bias pointers the epilogue's arguments take, as the launcher
// fills them: a plain kernel reports 2 and 0. Python checks these against the kernel's declared
// epilogue when it loads the artifact, so that a tree the filler misreads is refused, not run.
__attribute__((visibility("default"))) void cutlass_ops_epilogue_slots(int* scalars,
                                                                       int* biases);

// The FP8 scales the kernel reads: as device scalars in the epilogue (tensorwise), as vectors in
// the epilogue (rowwise), or in the mainloop (blockwise). Python checks these at load too.
__attribute__((visibility("default"))) void cutlass_ops_scale_slots(int* scalar_scales,
                                                                    int* vector_scales,
                                                                    int* mainloop_scales);

}  // extern "C"

namespace {

EpilogueValues filled_slots() {
  static const char kNotNull = 0;
  typename DeviceKernel::Arguments arguments{};
  EpilogueValues values = epilogue_values(1.0f, 1.0f, &kNotNull, &kNotNull, &kNotNull);
  using ThreadArgs = std::remove_reference_t<decltype(arguments.epilogue.thread)>;
  if constexpr (has_alpha<ThreadArgs>::value) {
    values.scalars_filled = 2;
  } else {
    fill_visitor_tree(arguments.epilogue.thread, values);
  }
  return values;
}

}  // namespace

void cutlass_ops_epilogue_slots(int* scalars, int* biases) {
  EpilogueValues values = filled_slots();
  // A leaf the launcher cannot fill makes the counts disagree with every expectation.
  *scalars = values.unmapped ? -1 : values.scalars_filled;
  *biases = values.unmapped ? -1 : values.biases_filled;
}

void cutlass_ops_scale_slots(int* scalar_scales, int* vector_scales, int* mainloop_scales) {
  EpilogueValues values = filled_slots();
  *scalar_scales = values.scalar_scales;
  *vector_scales = values.vector_scales;
#ifdef CUTLASS_OPS_BLOCKWISE_SCALES
  *mainloop_scales = 2;
#else
  *mainloop_scales = 0;
#endif
}

namespace {

bool to_arguments(const CutlassOpsGemmArgs& in, typename DeviceKernel::Arguments& out) {
  StrideA stride_a{};
  StrideB stride_b{};
  StrideC stride_c{};
  StrideD stride_d{};
  if (!make_stride(stride_a, in.a_stride_m, in.a_stride_k, in.a_stride_l) ||
      !make_stride(stride_b, in.b_stride_n, in.b_stride_k, in.b_stride_l) ||
      !make_stride(stride_c, in.c_stride_m, in.c_stride_n, in.c_stride_l) ||
      !make_stride(stride_d, in.d_stride_m, in.d_stride_n, in.d_stride_l)) {
    set_error("layout mismatch", "a unit stride of the compiled layout is not 1 in the tensor");
    return false;
  }

  out.mode = in.l > 1 ? cutlass::gemm::GemmUniversalMode::kBatched
                      : cutlass::gemm::GemmUniversalMode::kGemm;
  out.problem_shape = {in.m, in.n, in.k, in.l};
  out.mainloop.ptr_A = static_cast<const ElementA*>(in.a);
  out.mainloop.dA = stride_a;
  out.mainloop.ptr_B = static_cast<const ElementB*>(in.b);
  out.mainloop.dB = stride_b;
  // A fused kernel without a residual has no C at all (ElementC is void).
  out.epilogue.ptr_C = std::is_void_v<ElementC> ? nullptr : static_cast<const ElementC*>(in.c);
  out.epilogue.dC = stride_c;
  out.epilogue.ptr_D = static_cast<ElementD*>(in.d);
  out.epilogue.dD = stride_d;
  if (!set_epilogue_arguments(out.epilogue.thread, epilogue_values(in.alpha, in.beta, in.bias,
                                                                    in.scale_a, in.scale_b)) ||
      !set_mainloop_scales(out.mainloop, in.scale_a, in.scale_b, in.m, in.n, in.k, in.l)) {
    return false;
  }

  out.hw_info.device_id = in.device_id;
  out.hw_info.sm_count = in.sm_count;

  using RasterOrder = decltype(out.scheduler.raster_order);
  out.scheduler.raster_order = in.raster_order == 1   ? RasterOrder::AlongM
                               : in.raster_order == 2 ? RasterOrder::AlongN
                                                      : RasterOrder::Heuristic;
  out.scheduler.max_swizzle_size = in.swizzle;
  set_splits(out.scheduler, in.splits);
  return true;
}

// Runs `body` with the caller's device current, then restores the previous one: the tensors may
// live on another GPU than the thread's current device in a multi-GPU process.
template <class Body>
int on_device(int device_id, Body&& body) {
  int previous = -1;
  cudaError_t err = cudaGetDevice(&previous);
  if (err == cudaSuccess && previous != device_id) err = cudaSetDevice(device_id);
  if (err != cudaSuccess) {
    set_error("cudaSetDevice", cudaGetErrorString(err));
    return kCudaError;
  }
  int status = body();
  if (previous != device_id && previous >= 0) cudaSetDevice(previous);
  return status;
}

}  // namespace

extern "C" {

// Checks the problem against the kernel and reports the workspace it needs. Launches nothing.
__attribute__((visibility("default"))) int cutlass_ops_gemm_check(const CutlassOpsGemmArgs* args,
                                                                  size_t* workspace_bytes) {
  typename DeviceKernel::Arguments arguments{};
  if (!to_arguments(*args, arguments)) return kCannotImplement;
  cutlass::Status status = DeviceKernel::can_implement(arguments);
  if (status != cutlass::Status::kSuccess) {
    set_error("can_implement", cutlass::cutlassGetStatusString(status));
    return kCannotImplement;
  }
  *workspace_bytes = DeviceKernel::get_workspace_size(arguments);
  return kOk;
}

}  // extern "C"

namespace {

// The launch itself; `checked` skips can_implement and the workspace query, for callers that ran
// cutlass_ops_gemm_check on arguments differing only in pointers of the same 16-byte alignment.
int run_gemm(const CutlassOpsGemmArgs* args, void* workspace, size_t workspace_bytes,
             void* stream, bool checked) {
  return on_device(args->device_id, [&]() -> int {
    typename DeviceKernel::Arguments arguments{};
    if (!to_arguments(*args, arguments)) return kCannotImplement;
    if (!checked) {
      cutlass::Status status = DeviceKernel::can_implement(arguments);
      if (status != cutlass::Status::kSuccess) {
        set_error("can_implement", cutlass::cutlassGetStatusString(status));
        return kCannotImplement;
      }
      if (DeviceKernel::get_workspace_size(arguments) > workspace_bytes) {
        set_error("workspace", "the workspace given is smaller than get_workspace_size()");
        return kWorkspaceTooSmall;
      }
    }
    cutlass::Status status;
    auto cuda_stream = static_cast<cudaStream_t>(stream);
    DeviceKernel gemm;
    status = gemm.initialize(arguments, workspace, cuda_stream);
    if (status != cutlass::Status::kSuccess) {
      set_error("initialize", cutlass::cutlassGetStatusString(status));
      return kInitializeFailed;
    }
    status = gemm.run(cuda_stream);
    if (status != cutlass::Status::kSuccess) {
      cudaError_t err = cudaGetLastError();
      set_error("launch", err != cudaSuccess ? cudaGetErrorString(err)
                                             : cutlass::cutlassGetStatusString(status));
      return kLaunchFailed;
    }
    cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) {
      set_error("launch", cudaGetErrorString(err));
      return kCudaError;
    }
    return kOk;
  });
}

}  // namespace

extern "C" {

// Runs the GEMM on `stream` (a cudaStream_t) with a caller-owned workspace.
__attribute__((visibility("default"))) int cutlass_ops_gemm_run(const CutlassOpsGemmArgs* args,
                                                                void* workspace,
                                                                size_t workspace_bytes,
                                                                void* stream) {
  return run_gemm(args, workspace, workspace_bytes, stream, false);
}

// The same without can_implement and the workspace query: the per-call path of a problem already
// checked with these sizes, strides and alignments (dispatch's memoized routes).
__attribute__((visibility("default"))) int cutlass_ops_gemm_run_checked(
    const CutlassOpsGemmArgs* args, void* workspace, size_t workspace_bytes, void* stream) {
  return run_gemm(args, workspace, workspace_bytes, stream, true);
}

}  // extern "C"
