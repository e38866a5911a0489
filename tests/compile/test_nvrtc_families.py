"""Compile-only through NVRTC, no GPU: the custom kernel families' own compile functions build
cubins for sm_90a (skipped where libnvrtc cannot be loaded)."""

import re

import pytest

from custom_kernels import jit


def ptxas_report(source_name: str, defines: dict, name_expressions=()) -> str:
    """ptxas's -v report of NVRTC compiling ``csrc/<source_name>`` with ``defines`` (the
    registers, spills and stack of each kernel), as the JIT would compile it."""
    import io

    from cuda.core import Program, ProgramOptions

    options = ProgramOptions(name=source_name, arch=jit.DEFAULT_ARCH,
                             include_path=list(jit.include_dirs()), ptxas_options="-v",
                             define_macro=list(jit._normalize_defines(defines)), **jit._OPTIONS)
    log = io.StringIO()
    program = Program((jit.CSRC / source_name).read_text(), "c++", options)
    try:
        program.compile("cubin", name_expressions=tuple(name_expressions), logs=log)
    finally:
        program.close()
    return log.getvalue()

pytestmark = [pytest.mark.compile,
              pytest.mark.skipif(jit.nvrtc_version() == "unavailable",
                                 reason="libnvrtc not found (pip install nvidia-cuda-nvrtc)")]


@pytest.mark.smoke
def test_norm_family_compiles_forward_and_backward(cache_root):
    from custom_kernels.norms import norm_config as nc
    from custom_kernels.norms import norm_ops as ops

    problems = [nc.NormProblem("rms", direction, 4096, "bfloat16", "bfloat16", "bfloat16",
                               residual=True) for direction in ("fwd", "bwd")]
    ops.precompile(problems, workers=2)
    cubins = list((jit.cubin_path("norms.cu").parent).glob("*.cubin"))
    assert cubins and all(p.stat().st_size > 0 for p in cubins)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_ragged_family_compiles(cache_root, dtype):
    from custom_kernels import ragged

    path = ragged.compile_ragged(dtype, offset_bits=64, vec=True)
    assert path.stat().st_size > 0 and path.with_suffix(".json").is_file()


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("backward", [False, True])
def test_rotary_family_compiles(cache_root, dtype, backward):
    from custom_kernels import rotary

    for head_dim in (128, 6):  # 16-byte vectors; one element an access
        path = rotary.compile_rotary(dtype, head_dim, backward)
        assert path.stat().st_size > 0 and path.with_suffix(".json").is_file()


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("vec", [True, False])
def test_cross_entropy_family_compiles(cache_root, dtype, vec):
    from custom_kernels import cross_entropy

    # 1024-thread blocks (a 128256 vocabulary) with and without the soft-cap; 512 and 256 too
    for vocab, softcap in ((128256, False), (128256, True), (32000, False), (50257, True),
                           (1000, False)):
        path = cross_entropy.compile_cross_entropy(dtype, vocab, vec, softcap)
        assert path.stat().st_size > 0 and path.with_suffix(".json").is_file()
    if dtype != "float32" and vec:  # scale_'s kernel (float32 runs torch's mul_)
        assert cross_entropy.compile_scale(dtype).stat().st_size > 0


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("backward", [False, True])
def test_swiglu_family_compiles(cache_root, dtype, backward):
    from custom_kernels import swiglu

    for vec in (True, False):  # 16-byte accesses; one element an access
        for amax in (False, True):  # the build that also reduces the output's amax
            path = swiglu.compile_swiglu(dtype, vec, backward=backward, amax=amax)
            assert path.stat().st_size > 0 and path.with_suffix(".json").is_file()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("backward", [False, True])
def test_moe_combine_family_compiles(cache_root, dtype, backward):
    from custom_kernels.moe import moe_combine

    for vec in (True, False):  # 16-byte accesses; one element an access
        paths = [moe_combine.compile_moe_combine(dtype, vec, backward)]
        if vec:  # float32 routing weights and int32 indices; 4 slots a thread in registers
            paths.append(moe_combine.compile_moe_combine(
                dtype, vec, backward, weights_dtype="float32", index_bits=32,
                slots_per_thread=moe_combine.MAX_NS))
        assert all(p.stat().st_size > 0 and p.with_suffix(".json").is_file() for p in paths)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_rotary_tables_family_compiles(cache_root, dtype):
    from custom_kernels import rotary_tables

    for freq in ("float32", "bfloat16"):  # a model cast to bf16 casts its inv_freq buffer too
        path = rotary_tables.compile_rotary_tables(dtype, freq)
        assert path.stat().st_size > 0 and path.with_suffix(".json").is_file()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_moe_combine_kernels_do_not_spill(dtype):
    """ptxas's report for every slots-a-thread variant (the register ceilings of
    csrc/moe_combine.cu were set so that none spills; int32 indices were the tightest)."""

    from custom_kernels.moe import moe_combine
    from custom_kernels.core import elements

    code = elements.element(dtype).code
    for ns in range(1, moe_combine.MAX_NS + 1):
        report = ptxas_report(moe_combine.SOURCE, moe_combine._defines(code, code, 32, True, ns))
        assert len(re.findall(r"Used \d+ registers", report)) == 2, report  # both kernels
        assert re.findall(r"(\d+) bytes spill stores", report) == ["0", "0"], report


@pytest.mark.smoke
def test_routing_split_compiles(cache_root):
    from custom_kernels.moe import routing_split

    path = routing_split.compile_routing_split()
    assert path.stat().st_size > 0 and path.with_suffix(".json").is_file()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fp8_quant_family_compiles(cache_root, dtype):
    from custom_kernels.fp8 import fp8_quant as f

    paths = [f.compile_fp8_quant(f.AMAX_KERNEL, dtype, amax=f.AMAX_ROWS | f.AMAX_COLS)]
    for fp8, vec in (("e4m3", True), ("e5m2", False)):  # 16-byte accesses; one element an access
        paths += [f.compile_fp8_quant(f.ROWS_KERNEL, dtype, fp8, vec, "row"),
                  f.compile_fp8_quant(f.TILES_KERNEL, dtype, fp8, vec, "block_1x128",
                                      write_qt=True)]
    for granularity in ("tensor", "block_128x128"):  # one scale a tile: each value quantized once
        paths.append(f.compile_fp8_quant(f.ONCE_KERNEL, dtype, "e4m3", True, granularity,
                                         write_qt=True))
    assert all(p.stat().st_size > 0 and p.with_suffix(".json").is_file() for p in paths)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fused_fp8_outputs_compile(cache_root, dtype):
    """The RMSNorm and SwiGLU kernels that also write FP8 (each granularity, both FP8 types;
    the staged and the direct norm kernels; SwiGLU with and without 16-byte accesses)."""
    from custom_kernels import swiglu
    from custom_kernels.norms import fp8

    paths = [fp8.compile_rms_norm_fp8(4096, dtype, "row", "e4m3", residual=True),
             fp8.compile_rms_norm_fp8(4096, dtype, "block_1x128", "e5m2"),
             fp8.compile_rms_norm_fp8(256, dtype, "block_1x128", config="t64_r8_c1_v"
                                      + ("4" if dtype == "float32" else "8")),
             swiglu.compile_swiglu_fp8(dtype, True, "row", "e4m3"),
             swiglu.compile_swiglu_fp8(dtype, False, "block_1x128", "e5m2")]
    assert all(p.stat().st_size > 0 and p.with_suffix(".json").is_file() for p in paths)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_moe_routing_family_compiles(cache_root, dtype):
    """Each of the four kernels for E of 1, 2, 8 and 32 lanes' worth of experts (8, 64, 256,
    1024; the kernels compile in ceil(E / 32)); the scan depends on neither."""
    from custom_kernels.moe import moe_routing

    paths = [moe_routing.compile_moe_routing("scan", dtype)]
    for experts in (8, 64, 256, 1024):
        paths += [moe_routing.compile_moe_routing(kernel, dtype, experts)
                  for kernel in ("topk", "place", "bwd")]
    assert all(p.stat().st_size > 0 and p.with_suffix(".json").is_file() for p in paths)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_moe_routing_kernels_do_not_spill(dtype):
    """ptxas's report for the kernels at 1, 8 and 32 experts a lane (32 is the most registers:
    the top-k and backward kernels keep a row's scores in them)."""

    from custom_kernels.moe import moe_routing
    from custom_kernels.core import elements

    code = elements.element(dtype).code
    for ne in (1, 8, 32):
        for kernel in ("topk", "scan", "place", "bwd"):
            report = ptxas_report(moe_routing.SOURCE, moe_routing._defines(kernel, code, ne),
                                  (moe_routing.KERNELS[kernel],))
            assert len(re.findall(r"Used \d+ registers", report)) == 4, report  # every kernel
            assert set(re.findall(r"(\d+) bytes spill stores", report)) == {"0"}, report
            assert set(re.findall(r"(\d+) bytes stack frame", report)) == {"0"}, report


@pytest.mark.smoke
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "blockwise"])
def test_fp8_skinny_compiles_per_recipe(cache_root, recipe):
    from custom_kernels.fp8 import fp8_skinny as f

    path = f.compile_fp8_skinny(f.SkinnyConfig(16, 4, 6), recipe)
    assert path.stat().st_size > 0 and path.with_suffix(".json").is_file()


def test_fp8_skinny_builds_never_spill(cache_root):
    """Every block height (its wgmma's N: 16 to 128 float32 accumulators a thread, twice: the
    block's sum and the running one) with the blockwise recipe's scale reads, e5m2 and a
    float32 output with a bias: all in registers."""
    from custom_kernels.fp8 import fp8_skinny as f

    for bm in f.BLOCK_ROWS:
        for recipe, a, out32 in (("blockwise", "e4m3", False), ("rowwise", "e5m2", True)):
            defines = f.defines(f.SkinnyConfig(bm, 2, 4), recipe, a, "e4m3", out32, out32)
            report = ptxas_report(f.SOURCE, defines, (f.KERNEL,))
            assert re.findall(r"(\d+) bytes spill stores", report) == ["0"], report
            assert re.findall(r"(\d+) bytes stack frame", report) == ["0"], report
