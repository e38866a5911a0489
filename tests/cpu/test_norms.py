"""Fused norms without a GPU: config heuristics and space, input validation (before anything is
launched), fake-impl shapes, kernel specs, the modules' torch fallback and state_dict, and (marker
compile) nvcc checks of norms.cu and norms_staged.cu with the -D values Python passes: they
compile, without warnings and without register spills."""

import concurrent.futures
import dataclasses
import os
import re
import subprocess

import pytest
import torch
from torch._subclasses import FakeTensorMode

from custom_kernels import jit
from custom_kernels.norms import modules
from custom_kernels.norms import norm_ops as norms
from custom_kernels.norms import norm_config as nc
from custom_kernels.core.errors import UnsupportedInputError

ISSUE_HIDDEN = [256, 1000, 4096, 8192, 32768, 65536, 262144]
DTYPES = ["float32", "float16", "bfloat16"]


def problem(hidden, dtype="bfloat16", direction="fwd", kind="rms", aligned=True, out=None,
            weight=None):
    aligned = aligned and hidden % (16 // nc.DTYPE_SIZES[dtype]) == 0
    return nc.NormProblem(kind, direction, hidden, dtype, out or dtype, weight or dtype, aligned)


# --- configs -----------------------------------------------------------------------------------

@pytest.mark.parametrize("direction", nc.DIRECTIONS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", ISSUE_HIDDEN + [1, 7, 4097, 131072])
def test_heuristic_is_valid_and_covers_the_row(hidden, dtype, direction):
    p = problem(hidden, dtype, direction)
    cfg = nc.heuristic(p)
    assert cfg.why_invalid(p) is None
    assert cfg.iters(hidden) * cfg.threads_per_row * cfg.cluster * cfg.vec >= hidden
    defines = cfg.defines(p)
    assert defines["NORM_PART"] == (0 if direction == "fwd" else 1)
    assert defines["NORM_VEC"] == (16 // nc.DTYPE_SIZES[dtype] if p.aligned else 1)


def test_heuristic_splits_rows_as_documented():
    # Aligned short forward rows: the direct kernel, 16 lanes a row up to half a vector a lane,
    # then a warp a row, in small blocks that are not persistent.
    short = nc.heuristic(problem(256))
    assert short == nc.NormConfig(128, 8, 1, 8, 0) and short.threads_per_row == 16
    assert short.defines(problem(256))["NORM_TPR"] == 16
    assert nc.heuristic(problem(1000)) == nc.NormConfig(64, 2, 1, 8, 0)
    assert "NORM_TPR" not in nc.heuristic(problem(1000)).defines(problem(1000))
    assert nc.heuristic(problem(256, kind="ln")) == short
    # The 16-lanes split runs with 32 registers (measured faster, no spill); mixed-width
    # operands' does not (LayerNorm's would spill), nor does a warp a row.
    assert short.defines(problem(256, kind="ln"))["NORM_MAX_REGS"] == 32
    assert short.defines(problem(256))["NORM_MAX_REGS"] == 32
    assert "NORM_MAX_REGS" not in short.defines(problem(256, kind="ln", out="float32"))
    assert "NORM_MAX_REGS" not in nc.heuristic(problem(1000)).defines(problem(1000))
    assert nc.heuristic(problem(1000, kind="ln")) == nc.NormConfig(64, 2, 1, 8, 0)
    # Rows of up to 1024 vectors: a block each, one stage, not persistent.
    assert nc.heuristic(problem(4096)) == nc.NormConfig(256, 1, 1, 8, 1)
    assert nc.heuristic(problem(32768)) == nc.NormConfig(1024, 1, 1, 8, 2)
    # Longer rows: clusters of 512-thread blocks, 8 vectors a thread (4 in the backward pass).
    assert nc.heuristic(problem(65536)).cluster == 2
    assert nc.heuristic(problem(262144)).cluster == 8
    assert nc.heuristic(problem(262144, direction="bwd")) == nc.NormConfig(512, 1, 16, 8, 3)
    # LayerNorm forward (two reductions a row): one stage, not persistent, at every length.
    assert nc.heuristic(problem(8192, kind="ln")) == nc.NormConfig(256, 1, 1, 8, 1)
    assert nc.heuristic(problem(262144, kind="ln", dtype="float32")) == \
        nc.NormConfig(512, 1, 16, 4, 1)
    # but rows of more than 2048 vectors: persistent, the bias in shared memory, where it fits.
    assert nc.heuristic(problem(32768, kind="ln")).name == "t1024_r1_c1_v8_s2_m"
    assert nc.heuristic(problem(65536, kind="ln")).name == "t512_r1_c2_v8_s2_m"
    assert nc.heuristic(problem(262144, kind="ln")).name == "t512_r1_c8_v8_s2_m"
    assert nc.heuristic(problem(16384, kind="ln")) == nc.NormConfig(512, 1, 1, 8, 1)
    ln_residual = dataclasses.replace(problem(32768, kind="ln"), residual=True)
    assert nc.heuristic(ln_residual) == nc.NormConfig(512, 1, 1, 8, 1)
    # A residual stream doubles the staged bytes: the same row takes a larger cluster.
    with_residual = dataclasses.replace(problem(32768), residual=True)
    assert nc.heuristic(with_residual).cluster == 2
    assert nc.heuristic(problem(4096)).cache(problem(4096))


def test_staged_configs_fit_shared_memory_and_registers():
    p = problem(262144, "float32", "bwd")
    assert nc.NormConfig(512, 1, 8, 4, 1).why_invalid(p).startswith("needs")
    assert nc.heuristic(p).stages == 1  # the only staged split that fits at fp32
    assert "spill" in nc.NormConfig(1024, 1, 1, 8, 2).why_invalid(problem(32768, direction="bwd"))
    assert "16-byte" in nc.NormConfig(256, 1, 1, 1, 2).why_invalid(problem(4097))
    assert "stages" in nc.NormConfig(256, 1, 1, 8, 9).why_invalid(problem(4096))
    assert nc.NormConfig.from_name("t256_r8_c1_v8_s3") == nc.NormConfig(256, 8, 1, 8, 3)
    for bad in ("t256_r8_c1_v8_x3", "t64_r2_c1_v8_p2_s1", "t64_r2_c1_v8_p2_p2", "t64_r2_c1"):
        with pytest.raises(ValueError, match="not a norm config"):
            nc.NormConfig.from_name(bad)


def test_several_rows_per_thread():
    # The direct forward kernel with a warp or less per row: a block covers
    # rows_per_block x rows_per_thread rows, and the kernel gets NORM_RPT.
    cfg = nc.NormConfig.from_name("t64_r2_c1_v8_p4")
    assert cfg == nc.NormConfig(64, 2, 1, 8, 0, 4) and cfg.name == "t64_r2_c1_v8_p4"
    assert cfg.rows_per_launch_unit == 8 and cfg.warp_per_row
    plan = norms._NormPlan(cfg, kernel=None, persistent=False, max_units=0, shared_mem=0)
    assert plan.blocks(8) == 1 and plan.blocks(9) == 2
    assert cfg.defines(problem(256))["NORM_RPT"] == 4
    assert "NORM_RPT" not in nc.NormConfig(64, 2, 1, 8).defines(problem(256))
    # Not in the backward pass, the staged kernel, a block per row, or rows past the registers.
    reason = "several rows per thread"
    assert reason in cfg.why_invalid(problem(256, direction="bwd"))
    assert reason in nc.NormConfig(256, 8, 1, 8, 3, 2).why_invalid(problem(256))
    assert reason in nc.NormConfig(256, 1, 1, 8, 0, 2).why_invalid(problem(4096))
    assert reason in cfg.why_invalid(problem(1000))  # 4 rows x 4 vectors a thread: no cache
    assert "rows per thread 3" in nc.NormConfig(64, 2, 1, 8, 0, 3).why_invalid(problem(256))
    # The space offers them for short rows only, each round-tripping through its name.
    short = [c for c in nc.space(problem(256)) if c.rows_per_thread > 1]
    assert short and all(nc.NormConfig.from_name(c.name) == c for c in short)
    assert not [c for c in nc.space(problem(4096)) if c.rows_per_thread > 1]


def test_parameters_in_shared_memory():
    # The persistent staged forward with a block per row: the bias, and the weight unless it
    # fits registers (RMSNorm's rule: 32 at most, beside 40 base), take shared memory once a
    # block. The name says so (_m), the kernel gets NORM_PARAM_SMEM, the host counts the bytes.
    cfg = nc.NormConfig.from_name("t1024_r1_c1_v8_s2_m")
    assert cfg == nc.NormConfig(1024, 1, 1, 8, 2, param_smem=True)
    assert cfg.name == "t1024_r1_c1_v8_s2_m"
    ln, rms = problem(32768, kind="ln"), problem(32768)
    assert cfg.params_in_smem(ln) == 1  # 4 vectors: 16 weight registers fit beside 40 of 64
    # 2 stages of x, the bias, LayerNorm's shift slots (4 bytes a row start, stage and thread)
    assert cfg.shared_mem(ln) == 2 * 1024 * 4 * 16 + 1024 * 4 * 16 + 2 * 1024 * 4
    assert cfg.defines(ln)["NORM_PARAM_SMEM"] == 1
    assert "NORM_PARAM_SMEM" not in nc.NormConfig(1024, 1, 1, 8, 2).defines(ln)
    assert "none to put there" in cfg.why_invalid(rms)  # RMSNorm: the weight fits registers
    wide = nc.NormConfig(256, 1, 1, 8, 2, param_smem=True)  # 16 vectors: 64 weight registers
    assert wide.params_in_smem(rms) == 1 and wide.params_in_smem(ln) == 2
    fp32_weight = problem(32768, weight="float32")  # 32 registers + 40 > 64 at 1024 threads
    assert cfg.params_in_smem(fp32_weight) == 1
    # Only where blocks are persistent (2+ stages), forward, a block per row; within the memory.
    reason = "parameters in shared memory only"
    assert reason in nc.NormConfig(1024, 1, 1, 8, 1, param_smem=True).why_invalid(ln)
    assert reason in nc.NormConfig(1024, 1, 1, 8, 0, param_smem=True).why_invalid(ln)
    assert reason in cfg.why_invalid(problem(32768, kind="ln", direction="bwd"))
    assert reason in nc.NormConfig(256, 8, 1, 8, 2, param_smem=True).why_invalid(
        problem(1024, kind="ln"))
    assert "shared memory (max" in nc.NormConfig(512, 1, 1, 8, 3, param_smem=True).why_invalid(
        problem(32768, kind="ln"))
    with pytest.raises(ValueError, match="not a norm config"):
        nc.NormConfig.from_name("t1024_r1_c1_v8_s2_m2")
    assert nc.NormConfig.from_name("t1024_r1_c1_v8_s2_m_p2").param_smem  # parses; invalid later
    long_ln = [c for c in nc.space(problem(262144, kind="ln")) if c.param_smem]
    assert long_ln and all(nc.NormConfig.from_name(c.name) == c for c in long_ln)


def test_a_parameters_in_shared_memory_override_is_checked():
    # An override that cannot hold here is refused with the reason; on the scalar path (no
    # 16-byte vectors) it runs as the direct kernel of the same split.
    rms = problem(32768)
    with pytest.raises(ValueError, match="none to put there"):
        norms._choose(rms, "t1024_r1_c1_v8_s2_m")
    with pytest.raises(ValueError, match="only in the persistent staged forward"):
        norms._choose(problem(32768, kind="ln"), "t1024_r1_c1_v8_s1_m")
    with pytest.raises(ValueError, match="not a norm config"):
        norms._choose(rms, "t1024_r1_c1_v8_s2_mm")
    scalar = problem(32768, kind="ln", aligned=False)
    assert norms._choose(scalar, "t1024_r1_c1_v8_s2_m") == nc.NormConfig(1024, 1, 1, 1)


def test_unaligned_problems_take_the_scalar_path():
    p = problem(4097)
    assert not p.aligned and p.vec == 1 and nc.heuristic(p).vec == 1
    p = problem(4096, aligned=False)
    assert nc.heuristic(p).defines(p)["NORM_VEC"] == 1


@pytest.mark.parametrize("hidden", [256, 1000, 4097, 65536, 262144])
def test_space_is_valid_heuristic_first_and_named(hidden):
    for direction in nc.DIRECTIONS:
        p = problem(hidden, direction=direction, kind="ln")
        configs = list(nc.space(p))
        assert configs[0] == nc.heuristic(p)
        assert len(set(configs)) == len(configs) > 3
        for cfg in configs:
            assert cfg.why_invalid(p) is None
            assert nc.NormConfig.from_name(cfg.name) == cfg


def test_invalid_configs_are_refused_with_a_reason():
    p = problem(4096)
    assert "cluster" in nc.NormConfig(256, 8, 2, 8).why_invalid(p)
    assert "threads" in nc.NormConfig(96, 1, 1, 8).why_invalid(p)
    assert "vector" in nc.NormConfig(256, 1, 1, 4).why_invalid(p)
    assert "idle" in nc.NormConfig(1024, 1, 8, 8).why_invalid(p)
    # Several rows per warp: 8 or 16 lanes a row, the direct forward kernel only.
    assert "rows per block" in nc.NormConfig(256, 64, 1, 8).why_invalid(p)
    assert "rows per block" in nc.NormConfig(256, 3, 1, 8).why_invalid(p)
    assert "direct forward" in nc.NormConfig(256, 16, 1, 8, 3).why_invalid(problem(256))
    assert "direct forward" in nc.NormConfig(256, 16, 1, 8).why_invalid(
        problem(256, direction="bwd"))
    assert nc.NormConfig(256, 16, 1, 8).why_invalid(problem(256)) is None
    with pytest.raises(ValueError, match="invalid"):
        nc.NormConfig(256, 8, 2, 8).defines(p)
    with pytest.raises(ValueError, match="not a norm config"):
        nc.NormConfig.from_name("fast")
    with pytest.raises(ValueError, match="hidden"):
        problem(262145)
    with pytest.raises(ValueError, match="dtype"):
        nc.NormProblem("rms", "fwd", 8, "int8", "int8", "int8")


def test_kernel_specs_name_each_kernel():
    fwd = norms.kernel_specs(problem(4096))
    assert [(src, name) for src, name, _ in fwd] == [("norms_staged.cu", "norm_fwd_staged")]
    bwd = norms.kernel_specs(problem(4096, direction="bwd", kind="ln", weight="float32"))
    assert [name for _, name, _ in bwd] == ["norm_bwd_staged", "norm_dw_reduce"]
    assert bwd[1][2] == {"NORM_W": 0, "NORM_PART": 2}
    scalar = norms.kernel_specs(problem(4097, direction="bwd"))
    assert [(src, name) for src, name, _ in scalar] == [("norms.cu", "norm_bwd"),
                                                        ("norms.cu", "norm_dw_reduce")]


def test_compile_cache_key_changes_with_the_config(monkeypatch):
    # The key hashes the toolkit's include paths with everything else; fixed paths make the
    # test need no toolkit (it used to skip on any exception, hiding a broken key).
    monkeypatch.setattr(jit, "include_dirs", lambda: ("/cuda/include", "/cuda/include/cccl"))
    p = problem(4096)
    a = norms.kernel_specs(p, nc.NormConfig(128, 1, 1, 8))[0]
    b = norms.kernel_specs(p, nc.NormConfig(256, 1, 1, 8))[0]
    assert jit.cache_key(a[0], a[2], (a[1],)) != jit.cache_key(b[0], b[2], (b[1],))


# --- validation --------------------------------------------------------------------------------

def meta(*shape, dtype=torch.bfloat16):
    return torch.empty(shape, dtype=dtype, device="meta")


@pytest.mark.parametrize("case, match", [
    ("non_contiguous", "non-contiguous last dimension"),
    ("weight_shape", "weight has shape"),
    ("mixed_weight", "mixed dtypes: weight"),
    ("mixed_residual", "mixed dtypes: residual"),
    ("residual_shape", "residual has shape"),
    ("int_dtype", "x has dtype torch.int32"),
    ("out_dtype", "out_dtype"),
    ("hidden_too_large", "outside the supported"),
    ("hidden_zero", "outside the supported"),
    ("scalar", "at least one dimension"),
    ("mixed_devices", "different devices"),
])
def test_bad_input_gets_a_clear_error(case, match):
    x, w, res, out = meta(8, 64), meta(64), None, None
    if case == "non_contiguous":
        x = meta(64, 8).t()
    elif case == "weight_shape":
        w = meta(63)
    elif case == "mixed_weight":
        w = meta(64, dtype=torch.float16)
    elif case == "mixed_residual":
        res = meta(8, 64, dtype=torch.float32)
    elif case == "residual_shape":
        res = meta(4, 64)
    elif case == "int_dtype":
        x = torch.empty(8, 64, dtype=torch.int32, device="meta")
    elif case == "out_dtype":
        out = torch.int8
    elif case == "hidden_too_large":
        x, w = meta(2, 262145), meta(262145)
    elif case == "hidden_zero":
        x, w = meta(2, 0), meta(0)
    elif case == "scalar":
        x = meta()
    elif case == "mixed_devices":  # CPU tensors alone run the reference (tests/cpu/test_cpu_rule)
        x = torch.randn(8, 64, dtype=torch.bfloat16)
    with pytest.raises(UnsupportedInputError, match=match):
        norms.rms_norm(x, w, residual=res, out_dtype=out)
    bias = torch.zeros_like(w) if case != "weight_shape" else meta(64)
    with pytest.raises(UnsupportedInputError, match=match):
        norms.layer_norm(x, w, bias, residual=res, out_dtype=out)


def test_layer_norm_bias_rules():
    x, w = meta(8, 64), meta(64)
    with pytest.raises(UnsupportedInputError, match="bias is required"):
        norms.layer_norm(x, w, None)
    with pytest.raises(UnsupportedInputError, match="mixed dtypes: bias"):
        norms.layer_norm(x, w, meta(64, dtype=torch.float32))
    with pytest.raises(UnsupportedInputError, match="bias has shape"):
        norms.layer_norm(x, w, meta(65))


def test_float32_weight_with_half_input_is_accepted():
    x, w = meta(8, 64), meta(64, dtype=torch.float32)
    assert norms.why_unsupported("ln", x, w, w, None, None) == (
        "layer_norm: the tensors are on meta, not a CUDA device")


# --- fake impls --------------------------------------------------------------------------------

def test_fake_impls_give_the_real_shapes():
    with FakeTensorMode():
        x = torch.empty(3, 5, 1000, dtype=torch.bfloat16, device="cuda")
        w = torch.empty(1000, dtype=torch.float32, device="cuda")
        y, h = norms.rms_norm(x, w, residual=torch.empty_like(x))
        assert y.shape == h.shape == x.shape and y.dtype == h.dtype == torch.bfloat16
        y = norms.layer_norm(x, w, w, out_dtype=torch.float32)
        assert y.shape == x.shape and y.dtype == torch.float32
        y, res, rstd = torch.ops.custom_kernels.rms_norm_fwd(x, w, None, 1e-6, x.dtype, None)
        assert res.numel() == 0 and rstd.shape == (3, 5) and rstd.dtype == torch.float32
        _, _, mean, rstd = torch.ops.custom_kernels.layer_norm_fwd(x, w, w, x, 1e-5, x.dtype,
                                                                   "t128_r1_c1_v8")
        assert mean.shape == rstd.shape == (3, 5)
        dx, dw = torch.ops.custom_kernels.rms_norm_bwd(x, x, w, rstd, None, None)
        assert dx.shape == x.shape and dx.dtype == x.dtype and dw.dtype == torch.float32
        dx, dw, db = torch.ops.custom_kernels.layer_norm_bwd(x, x, w, mean, rstd, x, None)
        assert db.shape == (1000,) and db.dtype == torch.float32


# --- modules -----------------------------------------------------------------------------------

def test_modules_share_state_dict_with_torch_and_fall_back_on_cpu():
    torch.manual_seed(0)
    ref = torch.nn.RMSNorm(64, eps=1e-6)
    with torch.no_grad():
        ref.weight.uniform_(0.5, 1.5)
    ours = modules.RMSNorm(64, eps=1e-6)
    ours.load_state_dict(ref.state_dict())
    assert ours.state_dict().keys() == ref.state_dict().keys()
    x = torch.randn(4, 64)
    torch.testing.assert_close(ours(x), ref(x))
    res = torch.randn(4, 64)
    y, h = ours(x, res)
    torch.testing.assert_close(h, x + res)
    torch.testing.assert_close(y, ref(x + res))

    ref_ln = torch.nn.LayerNorm(64)
    ours_ln = modules.LayerNorm.from_module(ref_ln)
    assert ours_ln.weight is ref_ln.weight and ours_ln.bias is ref_ln.bias
    torch.testing.assert_close(ours_ln(x), ref_ln(x))
    ref.load_state_dict(modules.RMSNorm.from_module(ref).state_dict())


def test_modules_fall_back_without_weight_or_bias():
    x = torch.randn(2, 16)
    torch.testing.assert_close(modules.LayerNorm(16, bias=False)(x),
                               torch.nn.LayerNorm(16, bias=False)(x))
    torch.testing.assert_close(modules.RMSNorm(16, elementwise_affine=False)(x),
                               torch.nn.RMSNorm(16, elementwise_affine=False)(x))


def test_references_match_torch():
    x, res, w, b = torch.randn(4, 32), torch.randn(4, 32), torch.rand(32), torch.randn(32)
    y, h = norms.rms_norm_reference(x, w, 1e-6, residual=res)
    torch.testing.assert_close(y, torch.nn.functional.rms_norm(x + res, (32,), w, 1e-6))
    torch.testing.assert_close(norms.layer_norm_reference(x, w, b),
                               torch.nn.functional.layer_norm(x, (32,), w, b))


# --- nvcc syntax check of every kernel shape Python asks for (marker compile) ----------------

def _variants():
    """(source, defines) of one of each kernel shape: warp per row, block per row, cluster,
    uncached cluster, scalar path, mixed dtypes, with and without a residual, the staged kernel
    and the direct one of each problem, several rows per thread, the three dW reductions.
    CUTLASS_OPS_FULL_COMPILE_CHECK=1: every issue size with three dtype mixes, aligned and not
    (a few hundred compiles)."""
    if os.environ.get("CUTLASS_OPS_FULL_COMPILE_CHECK"):
        cases = [(h, dt, out, w, aligned) for h in ISSUE_HIDDEN + [4097]
                 for dt, out, w in [("bfloat16",) * 3, ("float16", "float32", "float32"),
                                    ("float32",) * 3] for aligned in (True, False)]
    else:
        cases = [(256, "bfloat16", "bfloat16", "bfloat16", True),
                 (4096, "float16", "float32", "float32", True),
                 (65536, "bfloat16", "bfloat16", "bfloat16", True),
                 (262144, "float32", "float32", "float32", True),
                 (4097, "bfloat16", "bfloat16", "bfloat16", False)]
    seen = {}
    for kind in nc.KINDS:
        for direction in nc.DIRECTIONS:
            for hidden, dtype, out, weight, aligned in cases:
                p = problem(hidden, dtype, direction, kind, aligned, out, weight)
                for residual in (False, True):
                    p = dataclasses.replace(p, residual=residual)
                    for source, _, defines in norms.kernel_specs(p):
                        seen[(source, *sorted(defines.items()))] = (source, defines)
                    # and the direct kernel of the same problem (the scalar path's kernel)
                    direct = nc._direct_heuristic(p)
                    seen[("norms.cu", direct.name, p)] = ("norms.cu", direct.defines(p))
                    # and several rows per thread where the direct forward kernel allows them
                    per_thread = nc.NormConfig(64, 2, 1, p.vec, 0, 4)
                    if per_thread.why_invalid(p) is None:
                        seen[("norms.cu", per_thread.name, p)] = ("norms.cu",
                                                                  per_thread.defines(p))
                    # and the parameters in shared memory, the first split that takes them
                    for threads, cluster in ((1024, 1), (512, 2), (512, 8), (256, 1)):
                        smem = nc.NormConfig(threads, 1, cluster, p.vec, 2, param_smem=True)
                        if smem.why_invalid(p) is None:
                            seen[("norms_staged.cu", smem.name, p)] = ("norms_staged.cu",
                                                                       smem.defines(p))
                            break
    for weight in DTYPES:
        seen[weight] = (nc.REDUCE_SOURCE, nc.reduce_defines(weight))
    return list(seen.values())


def _nvcc(variant):
    from cutlass_ops.gemms.build import nvcc_path

    source, defines = variant
    # The staged kernels must compile without warnings, and ptxas reports their spills (below).
    strict = ["-Xptxas", "-v", "-Werror", "all-warnings"] if source == "norms_staged.cu" else []
    cmd = [nvcc_path(), "-std=c++17", "-arch=sm_90a", "--cubin", "-o", "/dev/null", *strict,
           *(f"-I{d}" for d in jit.include_dirs()), *(f"-D{k}={v}" for k, v in defines.items()),
           str(jit.CSRC / source)]
    return variant, subprocess.run(cmd, capture_output=True, text=True)


@pytest.mark.compile
def test_norms_cu_compiles_with_nvcc_for_every_variant_python_uses():
    variants = _variants()
    assert len(variants) >= 20
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(_nvcc, variants))
    failed = [(d, r.stderr[-2000:]) for d, r in results if r.returncode]
    assert not failed, failed[0]
    # At most a few bytes of spills in a staged kernel (fp32 LayerNorm rows of 262144 spill 4);
    # the direct kernel is allowed its known spills (LayerNorm backward at 262144).
    spills = [(d, int(m)) for d, r in results
              for m in re.findall(r"(\d+) bytes spill stores", r.stdout + r.stderr)]
    assert all(n <= 16 for _, n in spills), max(spills, key=lambda item: item[1])
    # The staged kernels' dynamic shared memory (their cp.async slots) starts where the static
    # ends: a multiple of 128 bytes keeps it sector-aligned (norms_staged.cu, kRedSlots).
    static_smem = [(d, int(m)) for d, r in results if d[0] == "norms_staged.cu"
                   for m in re.findall(r"(\d+) bytes smem", r.stdout + r.stderr)]
    assert static_smem and all(n % 128 == 0 for _, n in static_smem), \
        [item for item in static_smem if item[1] % 128]
