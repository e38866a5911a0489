"""Compile-only: the CUTLASS sm90 grouped (ptr-array) GEMM launcher through nvcc, no GPU needed
(about 35 s each). The artifact must load, report its ABI and size its workspace."""

import ctypes

import pytest

from cutlass_ops.gemms.grouped import grouped_build, grouped_runtime

pytestmark = pytest.mark.compile


def test_the_default_kernel_builds_loads_and_sizes_its_workspace(cache_root):
    config = grouped_build.GroupedConfig()  # bf16, A row-major, B column-major (HF weights)
    library = grouped_runtime._library(grouped_build.build(config))
    sizes = []
    for groups in (8, 256):
        args = grouped_runtime._Args(form=0, groups=groups, n=4096, k=4096, alpha=1.0,
                                     sm_count=132, device=0)
        size = ctypes.c_size_t(0)
        assert library.cutlass_ops_grouped_workspace_size(ctypes.byref(args),
                                                          ctypes.byref(size)) == 0
        sizes.append(size.value)
    assert 0 < sizes[0] < sizes[1]  # the per-group arrays grow with the groups


@pytest.mark.parametrize("name", ["grouped-f16-nt-pingpong-t64x128x128-c1x1",
                                  "grouped-bf16-tt-cooperative-t128x128x64-c1x2"])
def test_other_schedules_and_layouts_build(cache_root, name):
    assert grouped_build.build(grouped_build.GroupedConfig.from_name(name)).stat().st_size > 0


def test_the_fp8_blockwise_kernel_builds_loads_and_sizes_its_workspace(cache_root):
    """Issue 53's grouped FP8 kernel (1x128 / 128x128 scales in the mainloop), about 90 s."""
    from cutlass_ops.gemms.grouped import grouped_fp8_runtime

    library = grouped_fp8_runtime.library(grouped_build.build(grouped_build.GroupedFp8Config()))
    sizes = []
    for groups in (8, 256):
        args = grouped_fp8_runtime._Args(groups=groups, m_total=4096, n=4096, k=7168,
                                         sm_count=132, device=0)
        size = ctypes.c_size_t(0)
        assert library.cutlass_ops_grouped_fp8_workspace_size(ctypes.byref(args),
                                                              ctypes.byref(size)) == 0
        sizes.append(size.value)
    assert 0 < sizes[0] < sizes[1]


def test_the_fp8_rowwise_kernel_builds_loads_and_sizes_its_workspace(cache_root):
    """Issue 53's rowwise grouped FP8 kernel (scales in the epilogue, fast accumulation), about
    three minutes on two cores. Its workspace holds no packed scales: smaller than blockwise's at
    the same extents."""
    from cutlass_ops.gemms.grouped import grouped_fp8_runtime

    def workspace(config):
        library = grouped_fp8_runtime.library(grouped_build.build(config))
        args = grouped_fp8_runtime._Args(groups=8, m_total=4096, n=4096, k=7168, sm_count=132,
                                         device=0)
        size = ctypes.c_size_t(0)
        assert library.cutlass_ops_grouped_fp8_workspace_size(ctypes.byref(args),
                                                              ctypes.byref(size)) == 0
        return size.value

    rowwise = grouped_build.GroupedFp8Config(recipe="rowwise", fast_accum=True)
    assert 0 < workspace(rowwise) < workspace(grouped_build.GroupedFp8Config())
