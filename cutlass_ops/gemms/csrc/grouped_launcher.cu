// C ABI launcher of one CUTLASS 3.x sm90 grouped (ptr-array) GEMM: D_g = alpha * A_g @ B_g for
// every group g, the groups' extents read from the device (cumulative int32 offsets), so that a
// call never waits for the host (no sync) and can be captured in a CUDA graph.
//
// The kernel is built here from CUTLASS's collective builders (a TMA warp-specialized ptr-array
// mainloop and epilogue, pingpong or cooperative), specialised by macros the Python side passes on
// the nvcc command line (cutlass_ops.gemms.grouped_build):
//   GROUPED_ELEMENT   2 bf16, 1 fp16 (A, B and D; float32 accumulation): the element codes of
//                     custom_kernels.core.elements, as every kernel source takes them
//   GROUPED_LAYOUT_A  0 row-major A (M x K, K contiguous), 1 column-major
//   GROUPED_LAYOUT_B  0 row-major B (K x N, N contiguous), 1 column-major (nn.Linear's W as B)
//   GROUPED_TILE_M / _N / _K, GROUPED_CLUSTER_M / _N, GROUPED_PINGPONG 0 / 1
// D is row-major. No C is read (beta = 0).
//
// A call first runs a one-block kernel that writes, from the offsets, each group's problem size,
// its A / B / D pointers and strides into the workspace (the forms of cutlass_ops.grouped:
// grouped along M, K or N, or batched), then the grouped GEMM, whose persistent tile scheduler
// reads those sizes on the device. Every entry point returns a status; the text of the last
// failure on this thread comes from cutlass_ops_grouped_last_error().

#include <cstdint>
#include <cstdio>

#include <cuda_runtime.h>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/group_array_problem_shape.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/kernel_hardware_info.h"

#ifndef GROUPED_ELEMENT
#define GROUPED_ELEMENT 2
#endif
#ifndef GROUPED_LAYOUT_A
#define GROUPED_LAYOUT_A 0
#endif
#ifndef GROUPED_LAYOUT_B
#define GROUPED_LAYOUT_B 1
#endif
#ifndef GROUPED_TILE_M
#define GROUPED_TILE_M 128
#endif
#ifndef GROUPED_TILE_N
#define GROUPED_TILE_N 256
#endif
#ifndef GROUPED_TILE_K
#define GROUPED_TILE_K 64
#endif
#ifndef GROUPED_CLUSTER_M
#define GROUPED_CLUSTER_M 2
#endif
#ifndef GROUPED_CLUSTER_N
#define GROUPED_CLUSTER_N 1
#endif
#ifndef GROUPED_PINGPONG
#define GROUPED_PINGPONG 0
#endif

// A named namespace (not an anonymous one): nvcc's host stub for a __global__ function in an
// anonymous namespace collides with CuTe's own anonymous namespaces.
namespace cutlass_ops_grouped {

using namespace cute;

constexpr int kAbiVersion = 1;

enum Status : int {
  kOk = 0,
  kCannotImplement = 1,
  kWorkspaceTooSmall = 2,
  kInitializeFailed = 3,
  kLaunchFailed = 4,
  kCudaError = 5,
  kBadArguments = 6,
};

static_assert(GROUPED_ELEMENT == 1 || GROUPED_ELEMENT == 2, "GROUPED_ELEMENT: 1 fp16, 2 bf16");
using Element = cute::conditional_t<GROUPED_ELEMENT == 2, cutlass::bfloat16_t, cutlass::half_t>;
using ElementAccumulator = float;
using LayoutA = cute::conditional_t<GROUPED_LAYOUT_A == 0, cutlass::layout::RowMajor,
                                    cutlass::layout::ColumnMajor>;
using LayoutB = cute::conditional_t<GROUPED_LAYOUT_B == 0, cutlass::layout::RowMajor,
                                    cutlass::layout::ColumnMajor>;
using LayoutD = cutlass::layout::RowMajor;
constexpr int kAlignment = 16 / sizeof(Element);

using TileShape = Shape<Int<GROUPED_TILE_M>, Int<GROUPED_TILE_N>, Int<GROUPED_TILE_K>>;
using ClusterShape = Shape<Int<GROUPED_CLUSTER_M>, Int<GROUPED_CLUSTER_N>, _1>;
using ProblemShape = cutlass::gemm::GroupProblemShape<Shape<int, int, int>>;
using KernelSchedule = cute::conditional_t<GROUPED_PINGPONG,
                                           cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpong,
                                           cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative>;
using EpilogueSchedule = cute::conditional_t<GROUPED_PINGPONG,
                                             cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong,
                                             cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative>;

using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
    cutlass::epilogue::collective::EpilogueTileAuto, ElementAccumulator, ElementAccumulator,
    void, LayoutD*, kAlignment, Element, LayoutD*, kAlignment, EpilogueSchedule,
    cutlass::epilogue::fusion::LinearCombination<Element, ElementAccumulator, void>>::CollectiveOp;

using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Element, LayoutA*, kAlignment, Element,
    LayoutB*, kAlignment, ElementAccumulator, TileShape, ClusterShape,
    cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
        sizeof(typename CollectiveEpilogue::SharedStorage))>,
    KernelSchedule>::CollectiveOp;

using GemmKernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, CollectiveMainloop,
                                                        CollectiveEpilogue>;
using Gemm = cutlass::gemm::device::GemmUniversalAdapter<GemmKernel>;
using StrideA = typename GemmKernel::InternalStrideA;
using StrideB = typename GemmKernel::InternalStrideB;
using StrideD = typename GemmKernel::InternalStrideD;
using Shape3 = typename ProblemShape::UnderlyingProblemShape;

thread_local char g_last_error[512] = {0};

void set_error(const char* what, const char* detail) {
  std::snprintf(g_last_error, sizeof(g_last_error), "%s: %s", what, detail);
}

// Which extent the offsets cut (cutlass_ops.grouped's forms): M (2d3d), K (2d2d), N (3d2d), or
// none (3d3d, a batch of equal problems).
enum Form : int { kGroupM = 0, kGroupK = 1, kGroupN = 2, kBatched = 3 };

}  // namespace cutlass_ops_grouped

extern "C" {

// Strides are in elements. For each operand: the strides of its two matrix dimensions (one of
// them must be 1 and match the compiled layout) and between groups (the 3-D operands).
struct CutlassOpsGroupedArgs {
  int32_t form;
  int32_t groups;
  int64_t m, n, k;  // the extents no offsets cut (the cut one: its total, for the checks)
  const int32_t* offs;  // [groups] cumulative ends; unused when batched
  const void* a;
  const void* b;
  void* d;
  int64_t a_stride_m, a_stride_k, a_stride_group;
  int64_t b_stride_k, b_stride_n, b_stride_group;
  int64_t d_stride_m, d_stride_n, d_stride_group;
  float alpha;
  int32_t sm_count;
  int32_t device;
};

}  // extern "C"

namespace cutlass_ops_grouped {

// The per-group arrays, carved from the front of the caller's workspace, 256-byte aligned each.
struct Arrays {
  Shape3* shapes;
  const Element** a;
  const Element** b;
  Element** d;
  StrideA* stride_a;
  StrideB* stride_b;
  StrideD* stride_d;
  size_t bytes;
};

size_t round_up(size_t x) { return (x + 255) / 256 * 256; }

Arrays carve(void* base, int groups) {
  Arrays arrays{};
  char* p = static_cast<char*>(base);
  size_t offset = 0;
  auto take = [&](size_t bytes) {
    char* here = p ? p + offset : nullptr;
    offset += round_up(bytes);
    return here;
  };
  arrays.shapes = reinterpret_cast<Shape3*>(take(sizeof(Shape3) * groups));
  arrays.a = reinterpret_cast<const Element**>(take(sizeof(void*) * groups));
  arrays.b = reinterpret_cast<const Element**>(take(sizeof(void*) * groups));
  arrays.d = reinterpret_cast<Element**>(take(sizeof(void*) * groups));
  arrays.stride_a = reinterpret_cast<StrideA*>(take(sizeof(StrideA) * groups));
  arrays.stride_b = reinterpret_cast<StrideB*>(take(sizeof(StrideB) * groups));
  arrays.stride_d = reinterpret_cast<StrideD*>(take(sizeof(StrideD) * groups));
  arrays.bytes = offset;
  return arrays;
}

// A CuTe stride of (row-like, column-like, batch) modes with one static unit mode among the
// first two: the other takes the leading dimension.
template <class Stride>
__device__ Stride leading(int64_t ld) {
  Stride stride{};
  if constexpr (cute::is_static_v<cute::remove_cvref_t<decltype(get<0>(stride))>>) {
    get<1>(stride) = ld;
  } else {
    get<0>(stride) = ld;
  }
  return stride;
}

// One thread per group: its problem, pointers and strides from the offsets.
__global__ void prepare_groups(CutlassOpsGroupedArgs args, Arrays arrays) {
  const int g = blockIdx.x * blockDim.x + threadIdx.x;
  if (g >= args.groups) return;
  int64_t start = 0, size = 0;
  if (args.form != kBatched) {
    start = g == 0 ? 0 : args.offs[g - 1];
    size = args.offs[g] - start;
    size = size < 0 ? 0 : size;  // decreasing offsets: an empty group, never a negative one
  }
  const Element* a = static_cast<const Element*>(args.a);
  const Element* b = static_cast<const Element*>(args.b);
  Element* d = static_cast<Element*>(args.d);
  int m = int(args.m), n = int(args.n), k = int(args.k);
  switch (args.form) {
    case kGroupM:
      m = int(size);
      a += start * args.a_stride_m;
      b += g * args.b_stride_group;
      d += start * args.d_stride_m;
      break;
    case kGroupK:
      k = int(size);
      a += start * args.a_stride_k;
      b += start * args.b_stride_k;
      d += g * args.d_stride_group;
      break;
    case kGroupN:
      n = int(size);
      a += g * args.a_stride_group;
      b += start * args.b_stride_n;
      d += start * args.d_stride_n;
      break;
    default:
      a += g * args.a_stride_group;
      b += g * args.b_stride_group;
      d += g * args.d_stride_group;
  }
  arrays.shapes[g] = Shape3{m, n, k};
  arrays.a[g] = a;
  arrays.b[g] = b;
  arrays.d[g] = d;
  // CUTLASS views B as N x K: its leading dimension is K's stride when K is contiguous
  // (column-major B), N's otherwise.
  arrays.stride_a[g] = leading<StrideA>(GROUPED_LAYOUT_A == 0 ? args.a_stride_m : args.a_stride_k);
  arrays.stride_b[g] = leading<StrideB>(GROUPED_LAYOUT_B == 0 ? args.b_stride_k : args.b_stride_n);
  arrays.stride_d[g] = leading<StrideD>(args.d_stride_m);
}

typename Gemm::Arguments gemm_arguments(const CutlassOpsGroupedArgs& args, const Arrays& arrays) {
  cutlass::KernelHardwareInfo hw_info;
  hw_info.device_id = args.device;
  hw_info.sm_count = args.sm_count;
  typename Gemm::Arguments arguments{
      cutlass::gemm::GemmUniversalMode::kGrouped,
      {args.groups, arrays.shapes, nullptr},
      {arrays.a, arrays.stride_a, arrays.b, arrays.stride_b},
      {{}, nullptr, nullptr, arrays.d, arrays.stride_d},
      hw_info};
  arguments.epilogue.thread.alpha = args.alpha;
  arguments.epilogue.thread.beta = 0.0f;
  return arguments;
}

bool unit_strides_match(const CutlassOpsGroupedArgs& args) {
  const bool a_ok = GROUPED_LAYOUT_A == 0 ? args.a_stride_k == 1 : args.a_stride_m == 1;
  const bool b_ok = GROUPED_LAYOUT_B == 0 ? args.b_stride_n == 1 : args.b_stride_k == 1;
  return a_ok && b_ok && args.d_stride_n == 1;
}

}  // namespace cutlass_ops_grouped

using namespace cutlass_ops_grouped;

extern "C" {

__attribute__((visibility("default"))) int cutlass_ops_grouped_abi_version() {
  return kAbiVersion;
}

__attribute__((visibility("default"))) const char* cutlass_ops_grouped_last_error() {
  return g_last_error;
}

// Bytes of workspace a call with these arguments needs (the per-group arrays, then CUTLASS's).
__attribute__((visibility("default"))) int cutlass_ops_grouped_workspace_size(
    const CutlassOpsGroupedArgs* args, size_t* bytes) {
  if (args == nullptr || bytes == nullptr || args->groups < 0) {
    set_error("workspace_size", "null arguments or a negative group count");
    return kBadArguments;
  }
  const Arrays arrays = carve(nullptr, args->groups);
  *bytes = arrays.bytes + round_up(Gemm::get_workspace_size(gemm_arguments(*args, arrays)));
  return kOk;
}

__attribute__((visibility("default"))) int cutlass_ops_grouped_run(
    const CutlassOpsGroupedArgs* args, void* workspace, size_t workspace_bytes,
    cudaStream_t stream) {
  if (args == nullptr || args->groups < 0 || args->form < 0 || args->form > kBatched) {
    set_error("run", "null arguments, a negative group count or an unknown form");
    return kBadArguments;
  }
  if (!unit_strides_match(*args)) {
    set_error("run", "an operand's unit stride does not match the compiled layout");
    return kBadArguments;
  }
  if (args->groups == 0) return kOk;
  const Arrays arrays = carve(workspace, args->groups);
  auto arguments = gemm_arguments(*args, arrays);
  const size_t needed = arrays.bytes + round_up(Gemm::get_workspace_size(arguments));
  if (workspace == nullptr || workspace_bytes < needed) {
    set_error("run", "workspace too small");
    return kWorkspaceTooSmall;
  }
  prepare_groups<<<(args->groups + 127) / 128, 128, 0, stream>>>(*args, arrays);
  cudaError_t error = cudaGetLastError();
  if (error != cudaSuccess) {
    set_error("prepare_groups", cudaGetErrorString(error));
    return kCudaError;
  }
  Gemm gemm;
  if (gemm.can_implement(arguments) != cutlass::Status::kSuccess) {
    set_error("can_implement", "CUTLASS refused the grouped problem");
    return kCannotImplement;
  }
  void* gemm_workspace = static_cast<char*>(workspace) + arrays.bytes;
  if (gemm.initialize(arguments, gemm_workspace, stream) != cutlass::Status::kSuccess) {
    set_error("initialize", "CUTLASS could not initialize the grouped GEMM");
    return kInitializeFailed;
  }
  if (gemm.run(stream) != cutlass::Status::kSuccess) {
    error = cudaGetLastError();
    set_error("run", error != cudaSuccess ? cudaGetErrorString(error) : "launch failed");
    return kLaunchFailed;
  }
  return kOk;
}

}  // extern "C"
