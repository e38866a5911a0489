// The accumulator values a thread hands to one register-to-shared-memory copy of CUTLASS's sm90
// TMA epilogue (size<0>(tRS_rAcc) in sm90_epilogue_tma_warpspecialized.hpp), by tile, for the
// tiled MMA and copy atoms the sm90 builders pick for bf16: the epilogue's FragmentSize
// (epilogue tile M * N / threads) must divide it, or the kernel fails with "Fragment size does not
// vectorize properly". Host-only, no GPU needed (about 3 minutes); cutlass_ops.kernels builds with
// CuTe's extended wgmma shapes, so pass the same macro:
//
//   I=$(python -c "import cutlass_library, os; print(os.path.dirname(cutlass_library.__file__))")
//   nvcc -std=c++17 --expt-relaxed-constexpr -arch=sm_90a -DCUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED \
//        -I$I/source/include -o /tmp/epi_copy_values devrun/epi_copy_values.cu && /tmp/epi_copy_values
//
// Columns: tile M, tile N, warpgroups, values with the row-major D atom (SM90_U32x4_STSM_N), with
// the column-major D atom (SM90_U16x8_STSM_T). CUTLASS 4.2 with the macro: N / 2 for every tile
// (one wgmma as wide as the tile). Without it: 8 for every N with N / 16 odd (CuTe split those
// tiles into 16-wide wgmmas), which is what config.epilogue_tile_widths once encoded.
#include <cstdio>

#include <utility>

// cute/tensor.hpp first: the atom headers rely on it.
#include "cute/tensor.hpp"
#include "cute/atom/mma_atom.hpp"
#include "cute/atom/copy_atom.hpp"
#include "cutlass/gemm/collective/builders/sm90_common.inl"
#include "cute/atom/copy_traits_sm90.hpp"
#include "cute/atom/mma_traits_sm90_gmma.hpp"

using namespace cute;

template <int M, int N, int WG>
void show() {
  using Tile = Shape<Int<M>, Int<N>, _64>;
  using Op = decltype(GMMA::ss_op_selector<cutlass::bfloat16_t, cutlass::bfloat16_t, float, Tile,
                                           GMMA::Major::K, GMMA::Major::K>());
  auto mma = make_tiled_mma(Op{}, Layout<Shape<Int<WG>, _1, _1>>{});
  auto acc = partition_fragment_C(mma, take<0, 2>(Tile{}));
  // The epilogue builder's CopyAtomC for epilogue tiles whose N is a multiple of 16.
  auto c_atom = make_tiled_copy_C_atom(Copy_Atom<SM90_U32x4_STSM_N, cutlass::half_t>{}, mma);
  auto row = make_tiled_copy_S(Copy_Atom<SM90_U32x4_STSM_N, cutlass::bfloat16_t>{}, c_atom);
  auto col = make_tiled_copy_S(Copy_Atom<SM90_U16x8_STSM_T, cutlass::bfloat16_t>{}, c_atom);
  printf("%d %d %d %d %d\n", M, N, WG, int(size<0>(row.get_slice(0).retile_S(acc))),
         int(size<0>(col.get_slice(0).retile_S(acc))));
}

template <int M, int WG, int... N>
void show_all(std::integer_sequence<int, N...>) {
  (show<M, 16 * (N + 1), WG>(), ...);
}

int main() {
  using Widths = std::make_integer_sequence<int, 16>;  // N = 16, 32, ..., 256
  show_all<128, 2>(Widths{});  // cooperative
  show_all<64, 1>(Widths{});   // pingpong
  show_all<256, 2>(Widths{});  // cooperative, two MMAs along M per warpgroup
}
