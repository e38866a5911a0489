// C ABI launcher of one CUTLASS 3.x sm90 grouped (ptr-array) FP8 GEMM with blockwise scaling, the
// mixture-of-experts forward (issue 53): D[rows of group g] = (A[rows of g] * sA) @ (B_g * sB_g)^T
// for every expert g, in float32 accumulation with the scales applied per K block in the mainloop
// (CUTLASS's FP8 blockwise ptr-array mainloop: KernelPtrArrayTmaWarpSpecialized*FP8Blockwise).
//
// The form is torch._grouped_mm's 2d-3d, the one an MoE layer's forward takes:
//   A   [M_total, K] e4m3, row-major: the tokens, sorted by expert (offs: cumulative int32 ends)
//   B   [E, N, K] e4m3, K contiguous (each expert's nn.Linear weight; CUTLASS's column-major B)
//   D   [M_total, N] bf16, row-major
//   sA  [M_total, K/128] float32, any strides: one scale a row and K block (1x128, DeepSeek-V3's
//       activation recipe)
//   sB  [E, N/128, K/128] float32, N blocks contiguous (strides (N/128*K/128, 1, N/128)): one
//       scale a 128x128 block of each expert's weight
// Rowwise: sA [M_total] float32 contiguous, sB [E, N] float32 contiguous; tile N may be 256.
// CUTLASS 4.2's ptr-array blockwise mainloop reads each group's scales through the packed layout
// of the group's own problem (its load_init rebuilds it from M, N, K and ignores the layouts it
// is given): group g's sA must be an M-contiguous [M_g, K/128] block of its own. So a second
// small kernel copies sA, group by group, into that packed form in the workspace (M_total * K/128
// floats; group g's block at M-offset start_g * K/128). sB's packed layout depends on N and K
// only: each expert's block is read in place. As in grouped_launcher.cu, the group sizes,
// pointers and strides are written from the offsets on the device: no host sync.
//
// Macros (cutlass_ops.gemms.grouped): GROUPED_TILE_M / _N (tile K 128: blockwise, the scale
// block), GROUPED_CLUSTER_M / _N, GROUPED_PINGPONG 0 / 1, GROUPED_ROWWISE 0 / 1,
// GROUPED_FAST_ACCUM 0 / 1 (rowwise only).

#include <cstdint>
#include <cstdio>

#include <cuda_runtime.h>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/detail/blockwise_scale_layout.hpp"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/group_array_problem_shape.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/kernel_hardware_info.h"

#ifndef GROUPED_TILE_M
#define GROUPED_TILE_M 128
#endif
#ifndef GROUPED_TILE_N
#define GROUPED_TILE_N 128
#endif
#ifndef GROUPED_CLUSTER_M
#define GROUPED_CLUSTER_M 1
#endif
#ifndef GROUPED_CLUSTER_N
#define GROUPED_CLUSTER_N 1
#endif
#ifndef GROUPED_PINGPONG
#define GROUPED_PINGPONG 0
#endif
#ifndef GROUPED_ROWWISE
#define GROUPED_ROWWISE 0
#endif
#ifndef GROUPED_FAST_ACCUM
#define GROUPED_FAST_ACCUM 0
#endif

namespace cutlass_ops_grouped_fp8 {

using namespace cute;

constexpr int kAbiVersion = 3;  // 2: sA any strides, packed per group; 3: the rowwise build
constexpr bool kRowwise = GROUPED_ROWWISE != 0;
constexpr int kScaleBlock = 128;  // K (and N for B) elements a scale covers

enum Status : int {
  kOk = 0,
  kCannotImplement = 1,
  kWorkspaceTooSmall = 2,
  kInitializeFailed = 3,
  kLaunchFailed = 4,
  kCudaError = 5,
  kBadArguments = 6,
};

using ElementAB = cutlass::float_e4m3_t;
using ElementD = cutlass::bfloat16_t;
using ElementAccumulator = float;
using LayoutA = cutlass::layout::RowMajor;
using LayoutB = cutlass::layout::ColumnMajor;
using LayoutD = cutlass::layout::RowMajor;
constexpr int kAlignmentAB = 16 / sizeof(ElementAB);
constexpr int kAlignmentD = 16 / sizeof(ElementD);

static_assert(kRowwise || GROUPED_TILE_N == kScaleBlock,
              "one 128-wide scale block of B a tile: CUTLASS's blockwise accumulation takes no "
              "other (at N 256 it fails to compile)");
static_assert(kRowwise || !GROUPED_FAST_ACCUM, "fast accumulation is a rowwise build's");
using TileShape = Shape<Int<GROUPED_TILE_M>, Int<GROUPED_TILE_N>, Int<kScaleBlock>>;
using ClusterShape = Shape<Int<GROUPED_CLUSTER_M>, Int<GROUPED_CLUSTER_N>, _1>;
using ProblemShape = cutlass::gemm::GroupProblemShape<Shape<int, int, int>>;

// Blockwise: 1x128 blocks of A, 128x128 of B; Sm90's mainloop reads both scale tensors M / N
// contiguous.
using ScaleConfig = cutlass::detail::Sm90BlockwiseScaleConfig<1, kScaleBlock, kScaleBlock>;
using LayoutSFA = decltype(ScaleConfig::deduce_layoutSFA());
using LayoutSFB = decltype(ScaleConfig::deduce_layoutSFB());

using BlockwiseSchedule = cute::conditional_t<
    GROUPED_PINGPONG, cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpongFP8Blockwise,
    cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperativeFP8Blockwise>;
using RowwiseSchedule = cute::conditional_t<
    GROUPED_FAST_ACCUM,
    cute::conditional_t<GROUPED_PINGPONG,
                        cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpongFP8FastAccum,
                        cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperativeFP8FastAccum>,
    cute::conditional_t<GROUPED_PINGPONG, cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpong,
                        cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative>>;
using KernelSchedule = cute::conditional_t<kRowwise, RowwiseSchedule, BlockwiseSchedule>;
using EpilogueSchedule = cute::conditional_t<GROUPED_PINGPONG,
                                             cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong,
                                             cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative>;

// Rowwise: D = bf16(sB[col] * (sA[row] * acc)), each scale vector read through a pointer a group
// (the broadcasts' array-of-pointers form: index l of a tile is its group).
namespace fusion = cutlass::epilogue::fusion;
using RowScaleA = fusion::Sm90ColBroadcast<0, TileShape, ElementAccumulator*, ElementAccumulator,
                                           Stride<_1, _0, _0>>;
using ColScaleB = fusion::Sm90RowBroadcast<0, TileShape, ElementAccumulator*, ElementAccumulator,
                                           Stride<_0, _1, _0>>;
using ScaledAcc = fusion::Sm90EVT<
    fusion::Sm90Compute<cutlass::multiplies, ElementAccumulator, ElementAccumulator,
                        cutlass::FloatRoundStyle::round_to_nearest>,
    RowScaleA, fusion::Sm90AccFetch>;
using RowwiseFusion = fusion::Sm90EVT<
    fusion::Sm90Compute<cutlass::multiplies, ElementD, ElementAccumulator,
                        cutlass::FloatRoundStyle::round_to_nearest>,
    ColScaleB, ScaledAcc>;
using Fusion = cute::conditional_t<kRowwise, RowwiseFusion,
                                   fusion::LinearCombination<ElementD, ElementAccumulator, void>>;

using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
    cutlass::epilogue::collective::EpilogueTileAuto, ElementAccumulator, ElementAccumulator,
    void, LayoutD*, kAlignmentD, ElementD, LayoutD*, kAlignmentD, EpilogueSchedule,
    Fusion>::CollectiveOp;

using GmemLayoutA = cute::conditional_t<kRowwise, LayoutA*, cute::tuple<LayoutA*, LayoutSFA*>>;
using GmemLayoutB = cute::conditional_t<kRowwise, LayoutB*, cute::tuple<LayoutB*, LayoutSFB*>>;
using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElementAB, GmemLayoutA, kAlignmentAB,
    ElementAB, GmemLayoutB, kAlignmentAB, ElementAccumulator, TileShape, ClusterShape,
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

}  // namespace cutlass_ops_grouped_fp8

extern "C" {

// Strides in elements, as the header says; the launcher checks the unit ones.
struct CutlassOpsGroupedFp8Args {
  int32_t groups;
  int64_t m_total, n, k;
  const int32_t* offs;  // [groups] cumulative ends of the rows of A (and D)
  const void* a;
  const void* b;
  void* d;
  const float* scale_a;  // blockwise [M_total, K/128], strides scale_a_stride_m / _k; rowwise [M_total]
  const float* scale_b;  // blockwise [E, N/128, K/128], N blocks contiguous; rowwise [E, N]
  int64_t scale_a_stride_m, scale_a_stride_k;
  int64_t a_stride_m;    // A's row stride (K when dense)
  int64_t b_stride_n, b_stride_group;
  int64_t d_stride_m;
  int32_t sm_count;
  int32_t device;
};

}  // extern "C"

namespace cutlass_ops_grouped_fp8 {

// The per-group arrays, carved from the front of the caller's workspace, 256-byte aligned each.
struct Arrays {
  Shape3* shapes;
  const ElementAB** a;
  const ElementAB** b;
  ElementD** d;
  const ElementAccumulator** scale_a;
  const ElementAccumulator** scale_b;
  StrideA* stride_a;
  StrideB* stride_b;
  StrideD* stride_d;
  LayoutSFA* layout_sfa;
  LayoutSFB* layout_sfb;
  float* packed_scale_a;  // [M_total * K/128]: each group's sA as an M-contiguous block
  size_t bytes;
};

size_t round_up(size_t x) { return (x + 255) / 256 * 256; }

Arrays carve(void* base, int groups, int64_t m_total, int64_t k) {
  Arrays arrays{};
  char* p = static_cast<char*>(base);
  size_t offset = 0;
  auto take = [&](size_t bytes) {
    char* here = p ? p + offset : nullptr;
    offset += round_up(bytes);
    return here;
  };
  arrays.shapes = reinterpret_cast<Shape3*>(take(sizeof(Shape3) * groups));
  arrays.a = reinterpret_cast<const ElementAB**>(take(sizeof(void*) * groups));
  arrays.b = reinterpret_cast<const ElementAB**>(take(sizeof(void*) * groups));
  arrays.d = reinterpret_cast<ElementD**>(take(sizeof(void*) * groups));
  arrays.scale_a = reinterpret_cast<const ElementAccumulator**>(take(sizeof(void*) * groups));
  arrays.scale_b = reinterpret_cast<const ElementAccumulator**>(take(sizeof(void*) * groups));
  arrays.stride_a = reinterpret_cast<StrideA*>(take(sizeof(StrideA) * groups));
  arrays.stride_b = reinterpret_cast<StrideB*>(take(sizeof(StrideB) * groups));
  arrays.stride_d = reinterpret_cast<StrideD*>(take(sizeof(StrideD) * groups));
  arrays.layout_sfa = reinterpret_cast<LayoutSFA*>(take(sizeof(LayoutSFA) * groups));
  arrays.layout_sfb = reinterpret_cast<LayoutSFB*>(take(sizeof(LayoutSFB) * groups));
  if (!kRowwise)  // rowwise scales are read in place
    arrays.packed_scale_a =
        reinterpret_cast<float*>(take(sizeof(float) * size_t(m_total) * size_t(k / kScaleBlock)));
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

// One thread per expert: its rows, pointers, strides and scale layouts from the offsets.
__global__ void prepare_groups(CutlassOpsGroupedFp8Args args, Arrays arrays) {
  const int g = blockIdx.x * blockDim.x + threadIdx.x;
  if (g >= args.groups) return;
  // Offsets past M_total end at M_total; decreasing ones make an empty group, never a negative one
  // (pack_scale_a clamps alike).
  const int64_t start = g == 0 ? 0 : min(int64_t(args.offs[g - 1]), args.m_total);
  int64_t rows = min(int64_t(args.offs[g]), args.m_total) - start;
  rows = rows < 0 ? 0 : rows;
  const int n = int(args.n), k = int(args.k);
  arrays.shapes[g] = Shape3{int(rows), n, k};
  arrays.a[g] = static_cast<const ElementAB*>(args.a) + start * args.a_stride_m;
  arrays.b[g] = static_cast<const ElementAB*>(args.b) + g * args.b_stride_group;
  arrays.d[g] = static_cast<ElementD*>(args.d) + start * args.d_stride_m;
  arrays.stride_a[g] = leading<StrideA>(args.a_stride_m);
  arrays.stride_b[g] = leading<StrideB>(args.b_stride_n);
  arrays.stride_d[g] = leading<StrideD>(args.d_stride_m);
  if constexpr (kRowwise) {
    arrays.scale_a[g] = args.scale_a + start;   // the group's rows' scales
    arrays.scale_b[g] = args.scale_b + g * int64_t(n);  // its columns'
  } else {
    // sA: the group's packed block (pack_scale_a), at M-offset start * K/128.
    arrays.scale_a[g] = arrays.packed_scale_a + start * (k / kScaleBlock);
    arrays.layout_sfa[g] = ScaleConfig::tile_atom_to_shape_SFA(make_shape(int(rows), n, k, 1));
    const int64_t b_blocks = int64_t(n / kScaleBlock) * (k / kScaleBlock);
    arrays.scale_b[g] = args.scale_b + g * b_blocks;
    arrays.layout_sfb[g] = ScaleConfig::tile_atom_to_shape_SFB(make_shape(int(rows), n, k, 1));
  }
}

// One thread per (row, K block) of sA: the row's group found by bisecting the offsets, its scale
// written into the group's M-contiguous block (offsets clamped to M_total as prepare_groups clamps
// them). Rows outside every group (past the last offset, or under decreasing offsets) are not
// copied: the GEMM reads none of them.
__global__ void pack_scale_a(CutlassOpsGroupedFp8Args args, Arrays arrays) {
  const int64_t blocks_k = args.k / kScaleBlock;
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= args.m_total * blocks_k) return;
  const int64_t row = i / blocks_k, kb = i % blocks_k;
  int lo = 0, hi = args.groups;  // the first group whose end is past the row
  while (lo < hi) {
    const int mid = (lo + hi) / 2;
    if (args.offs[mid] > row) hi = mid; else lo = mid + 1;
  }
  if (lo == args.groups) return;
  const int64_t start = lo == 0 ? 0 : args.offs[lo - 1];
  const int64_t end = min(int64_t(args.offs[lo]), args.m_total);
  if (row < start) return;
  arrays.packed_scale_a[start * blocks_k + kb * (end - start) + (row - start)] =
      args.scale_a[row * args.scale_a_stride_m + kb * args.scale_a_stride_k];
}

typename Gemm::Arguments gemm_arguments(const CutlassOpsGroupedFp8Args& args,
                                        const Arrays& arrays) {
  cutlass::KernelHardwareInfo hw_info;
  hw_info.device_id = args.device;
  hw_info.sm_count = args.sm_count;
  typename Gemm::Arguments arguments;
  // (#if, not if constexpr: outside a template both branches of an if constexpr must compile,
  // and each build's Arguments has only its own scaling's fields.)
#if GROUPED_ROWWISE
  {
    arguments = typename Gemm::Arguments{
        cutlass::gemm::GemmUniversalMode::kGrouped,
        {args.groups, arrays.shapes, nullptr},
        {arrays.a, arrays.stride_a, arrays.b, arrays.stride_b},
        {{}, nullptr, nullptr, arrays.d, arrays.stride_d},
        hw_info};
    // (column scales of B, (row scales of A, the accumulator, their product), the product)
    arguments.epilogue.thread = {{arrays.scale_b}, {{arrays.scale_a}, {}, {}}, {}};
  }
#else
  {
    arguments = typename Gemm::Arguments{
        cutlass::gemm::GemmUniversalMode::kGrouped,
        {args.groups, arrays.shapes, nullptr},
        {arrays.a, arrays.stride_a, arrays.b, arrays.stride_b, arrays.scale_a, arrays.layout_sfa,
         arrays.scale_b, arrays.layout_sfb},
        {{}, nullptr, nullptr, arrays.d, arrays.stride_d},
        hw_info};
    arguments.epilogue.thread.alpha = 1.0f;
    arguments.epilogue.thread.beta = 0.0f;
  }
#endif
  return arguments;
}

// What the kernel reads as it was compiled: dense K-contiguous rows of A and B, D's unit column
// stride, and extents the scale blocks tile.
const char* why_not(const CutlassOpsGroupedFp8Args& args) {
  if (args.groups < 0) return "a negative group count";
  if (kRowwise ? (args.k % 16 || args.n % 16) : (args.k % kScaleBlock || args.n % kScaleBlock))
    return kRowwise ? "N and K must be multiples of 16" : "N and K must be multiples of 128";
  if (args.a_stride_m < args.k || args.b_stride_n < args.k || args.d_stride_m < args.n)
    return "a row stride shorter than its row";
  if (args.a_stride_m % kAlignmentAB || args.b_stride_n % kAlignmentAB ||
      args.d_stride_m % kAlignmentD)
    return "a row stride that breaks 16-byte alignment";
  if (args.groups > 0 && (args.offs == nullptr || args.a == nullptr || args.b == nullptr ||
                          args.d == nullptr || args.scale_a == nullptr || args.scale_b == nullptr))
    return "a null pointer";
  return nullptr;
}

}  // namespace cutlass_ops_grouped_fp8

using namespace cutlass_ops_grouped_fp8;

extern "C" {

__attribute__((visibility("default"))) int cutlass_ops_grouped_fp8_abi_version() {
  return kAbiVersion;
}

__attribute__((visibility("default"))) const char* cutlass_ops_grouped_fp8_last_error() {
  return g_last_error;
}

// Bytes of workspace a call with these arguments needs (the per-group arrays, then CUTLASS's).
__attribute__((visibility("default"))) int cutlass_ops_grouped_fp8_workspace_size(
    const CutlassOpsGroupedFp8Args* args, size_t* bytes) {
  if (args == nullptr || bytes == nullptr || args->groups < 0) {
    set_error("workspace_size", "null arguments or a negative group count");
    return kBadArguments;
  }
  const Arrays arrays = carve(nullptr, args->groups, args->m_total, args->k);
  *bytes = arrays.bytes + round_up(Gemm::get_workspace_size(gemm_arguments(*args, arrays)));
  return kOk;
}

__attribute__((visibility("default"))) int cutlass_ops_grouped_fp8_run(
    const CutlassOpsGroupedFp8Args* args, void* workspace, size_t workspace_bytes,
    cudaStream_t stream) {
  if (args == nullptr) {
    set_error("run", "null arguments");
    return kBadArguments;
  }
  if (const char* why = why_not(*args)) {
    set_error("run", why);
    return kBadArguments;
  }
  if (args->groups == 0) return kOk;
  const Arrays arrays = carve(workspace, args->groups, args->m_total, args->k);
  auto arguments = gemm_arguments(*args, arrays);
  const size_t needed = arrays.bytes + round_up(Gemm::get_workspace_size(arguments));
  if (workspace == nullptr || workspace_bytes < needed) {
    set_error("run", "workspace too small");
    return kWorkspaceTooSmall;
  }
  prepare_groups<<<(args->groups + 127) / 128, 128, 0, stream>>>(*args, arrays);
  const int64_t scales = kRowwise ? 0 : args->m_total * (args->k / kScaleBlock);
  if (scales > 0)
    pack_scale_a<<<unsigned((scales + 255) / 256), 256, 0, stream>>>(*args, arrays);
  cudaError_t error = cudaGetLastError();
  if (error != cudaSuccess) {
    set_error("prepare_groups", cudaGetErrorString(error));
    return kCudaError;
  }
  Gemm gemm;
  if (gemm.can_implement(arguments) != cutlass::Status::kSuccess) {
    set_error("can_implement", "CUTLASS refused the grouped FP8 problem");
    return kCannotImplement;
  }
  void* gemm_workspace = static_cast<char*>(workspace) + arrays.bytes;
  if (gemm.initialize(arguments, gemm_workspace, stream) != cutlass::Status::kSuccess) {
    set_error("initialize", "CUTLASS could not initialize the grouped FP8 GEMM");
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
