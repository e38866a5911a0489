"""FP8 outputs of the fused RMSNorm and SwiGLU kernels (``custom_kernels.norms.rms_norm_fp8``,
``custom_kernels.swiglu.swiglu_fp8``) without a GPU: the CPU rule (the torch norm / SwiGLU, then
``fp8_quant.torch_quantize`` of the rounded output) for both granularities, FP8 types, a
residual, several leading dimensions; y the same as the plain functions' and its gradients too;
``write_y=False``; refusals by name (also for fake CUDA tensors, before anything runs); the
custom ops' fakes against the real outputs (FakeTensorMode), opcheck, torch.compile(fullgraph);
and the FP8 config rules of the norm kernel (16-byte vectors, no register cap)."""

import pytest
import torch
from torch._subclasses import FakeTensorMode

from custom_kernels import norms
from custom_kernels.core.errors import UnsupportedInputError
from custom_kernels.fp8.fp8_quant import Granularity, quantize, torch_quantize
from custom_kernels.norms import norm_config as nc
from custom_kernels.norms import fp8 as norm_fp8
from custom_kernels.swiglu import swiglu, swiglu_fp8, torch_swiglu

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
GRANULARITIES = ["row", "block_1x128"]


def sample(*shape, dtype=torch.bfloat16, spread=True):
    """Values over several decades a row (rows of very different amaxes), both signs."""
    x = torch.randn(*shape, dtype=torch.float64)
    if spread:
        x *= torch.logspace(-2, 2, shape[-2] if len(shape) > 1 else 1,
                            dtype=torch.float64)[:, None]
    return x.to(dtype)


def assert_same_fp8(got, want):
    (q, scale), (q_ref, scale_ref) = got, want
    assert q.dtype == q_ref.dtype and q.is_contiguous()
    assert torch.equal(q.view(torch.uint8).reshape(-1), q_ref.view(torch.uint8).reshape(-1))
    assert (scale.shape, scale.stride(), scale.dtype) == (scale_ref.shape, scale_ref.stride(),
                                                          torch.float32)
    assert torch.equal(scale, scale_ref)


# --- the CPU rule --------------------------------------------------------------------------------

@pytest.mark.parametrize("fp8_dtype", [E4M3, E5M2])
@pytest.mark.parametrize("g", GRANULARITIES)
@pytest.mark.parametrize("residual", [False, True])
def test_norm_is_the_torch_norm_then_quantize_of_its_output(g, fp8_dtype, residual):
    x, w = sample(2, 3, 256), torch.rand(256).bfloat16() + 0.5
    res = sample(2, 3, 256) if residual else None
    out = norms.rms_norm_fp8(x, w, 1e-5, g, res, fp8_dtype=fp8_dtype)
    plain = norms.rms_norm(x, w, 1e-5, res)
    y, q, scale = out[:3]
    if residual:
        assert torch.equal(out[3], plain[1])
        plain = plain[0]
    assert torch.equal(y, plain)
    assert q.shape == x.shape
    assert_same_fp8((q, scale), quantize(y.reshape(-1, 256), g, fp8_dtype=fp8_dtype))
    assert scale.shape == ((6, 1) if g == "row" else (6, 2))
    ref = norms.rms_norm_fp8_reference(x, w, 1e-5, g, res, fp8_dtype=fp8_dtype)
    for got, want in zip(out, ref):
        assert torch.equal(got.float(), want.float())


def test_norm_out_dtype_is_what_is_quantized():
    x, w = sample(4, 128), torch.ones(128)
    y, q, scale = norms.rms_norm_fp8(x, w, granularity="row", out_dtype=torch.float32)
    assert y.dtype == torch.float32
    assert_same_fp8((q, scale), torch_quantize(y, "row"))
    y16 = norms.rms_norm_fp8(x, w, granularity="row")[0]
    assert y16.dtype == torch.bfloat16 and not torch.equal(y16.float(), y)


@pytest.mark.parametrize("fp8_dtype", [E4M3, E5M2])
@pytest.mark.parametrize("g", GRANULARITIES)
def test_swiglu_is_torch_swiglu_then_quantize_of_its_output(g, fp8_dtype):
    gate_up = sample(2, 5, 512)
    y, q, scale = swiglu_fp8(gate_up, g, fp8_dtype=fp8_dtype)
    assert torch.equal(y, swiglu(gate_up)) and torch.equal(y, torch_swiglu(gate_up))
    assert q.shape == (2, 5, 256) and q.dtype == fp8_dtype
    assert_same_fp8((q, scale), quantize(y.reshape(-1, 256), g, fp8_dtype=fp8_dtype))
    assert scale.shape == ((10, 1) if g == "row" else (10, 2))


@pytest.mark.parametrize("g", GRANULARITIES)
def test_dequantized_outputs_are_close(g):
    """Half an e4m3 step (2^-4 relative) from the rounded output, each element."""
    x, w = sample(8, 384), torch.rand(384).bfloat16() + 0.5
    y, q, scale = norms.rms_norm_fp8(x, w, granularity=g)
    dq = q.float().view(8, -1, 128 if g != "row" else 384) * \
        scale.reshape(8, -1, 1)
    err = (dq.reshape(8, 384) - y.float()).abs()
    assert (err <= y.float().abs() * 2 ** -4 + scale.repeat_interleave(
        384 // scale.shape[1], 1) * 2 ** -10).all()


def test_gradients_are_the_plain_functions():
    x, w = sample(4, 256).requires_grad_(), (torch.rand(256) + 0.5).bfloat16().requires_grad_()
    res = sample(4, 256).requires_grad_()
    y, q, scale, h = norms.rms_norm_fp8(x, w, 1e-6, "row", res)
    assert not q.requires_grad and not scale.requires_grad
    (y.float().square().sum() + h.float().sum()).backward()
    grads = [t.grad.clone() for t in (x, w, res)]
    for t in (x, w, res):
        t.grad = None
    y2, h2 = norms.rms_norm(x, w, 1e-6, res)
    (y2.float().square().sum() + h2.float().sum()).backward()
    assert all(torch.equal(a, t.grad) for a, t in zip(grads, (x, w, res)))
    gate_up = sample(3, 256).requires_grad_()
    y, q, _ = swiglu_fp8(gate_up, "block_1x128")
    y.float().square().sum().backward()
    grad = gate_up.grad.clone()
    gate_up.grad = None
    swiglu(gate_up).float().square().sum().backward()
    assert torch.equal(grad, gate_up.grad)


def test_write_y_false_returns_none_and_needs_no_grad():
    x, w, gate_up = sample(4, 128), torch.ones(128), sample(4, 256)
    y, q, scale = norms.rms_norm_fp8(x, w, granularity="row", write_y=False)
    assert y is None and torch.equal(scale, norms.rms_norm_fp8(x, w)[2])
    y, q, scale = swiglu_fp8(gate_up, write_y=False)
    assert y is None and torch.equal(q.view(torch.uint8), swiglu_fp8(gate_up)[1].view(torch.uint8))
    with pytest.raises(UnsupportedInputError, match="write_y=False writes no differentiable"):
        norms.rms_norm_fp8(x.requires_grad_(), w, write_y=False)
    with pytest.raises(UnsupportedInputError, match="write_y=False writes no differentiable"):
        swiglu_fp8(gate_up.requires_grad_(), write_y=False)
    with torch.no_grad():
        assert swiglu_fp8(gate_up, write_y=False)[0] is None


def test_off_cuda_is_logged_once(warnings):
    x, w, gate_up = sample(4, 128), torch.ones(128), sample(4, 256)
    for _ in range(2):
        swiglu_fp8(gate_up)
    assert warnings() == ["swiglu_fp8 uses torch_swiglu and torch_quantize: the tensors are on "
                          "cpu, not a CUDA device"]
    norms.rms_norm_fp8(x, w)


# --- refusals --------------------------------------------------------------------------------

NORM_CASES = [
    ("granularity 'tensor' is not written by the norm kernel", dict(granularity="tensor")),
    ("granularity 'block_128x128' is not written", dict(granularity="block_128x128")),
    ("granularity 'nope' is not written", dict(granularity="nope")),
    ("fp8_dtype must be torch.float8_e4m3fn or torch.float8_e5m2, not torch.bfloat16",
     dict(fp8_dtype=torch.bfloat16)),
    ("not torch.float8_e4m3fnuz", dict(fp8_dtype=torch.float8_e4m3fnuz)),
    (r"'row' needs hidden \(the last dimension\) a multiple of 16 \(an FP8 GEMM's K\), got 200",
     dict(x=(4, 200))),
    (r"'block_1x128' needs hidden .* a multiple of 128 \(its 128-column blocks\), got 144",
     dict(x=(4, 144), granularity="block_1x128")),
    ("rms_norm: x has dtype torch.float64", dict(dtype=torch.float64)),
    (r"weight has shape \(100,\), expected \(256,\)", dict(weight=100)),
]


def _norm_call(x=(4, 256), weight=None, dtype=torch.bfloat16, device="cpu", **kw):
    xt = torch.zeros(*x, dtype=dtype, device=device)
    w = torch.ones(weight or x[-1], dtype=torch.float32, device=device)
    return norms.rms_norm_fp8(xt, w, **kw)


@pytest.mark.parametrize("match,case", NORM_CASES)
def test_norm_refusals(match, case):
    with pytest.raises(UnsupportedInputError, match=match):
        _norm_call(**case)
    with FakeTensorMode(), pytest.raises(UnsupportedInputError, match=match):
        _norm_call(device="cuda", **case)


SWIGLU_CASES = [
    ("granularity 'tensor' is not written by the SwiGLU kernel", (4, 256), dict(g="tensor")),
    ("fp8_dtype must be", (4, 256), dict(fp8_dtype=torch.float16)),
    (r"'row' needs I \(half the last dimension\) a multiple of 16 .*got 100", (4, 200), {}),
    (r"'block_1x128' needs I .* multiple of 128 .*got 144", (4, 288), dict(g="block_1x128")),
    ("last dimension of gate_up must be even", (4, 255), {}),
]


@pytest.mark.parametrize("match,shape,case", SWIGLU_CASES)
def test_swiglu_refusals(match, shape, case):
    kw = {k: v for k, v in case.items() if k != "g"}
    for device in ("cpu", "cuda"):
        with FakeTensorMode() if device == "cuda" else torch.no_grad():
            gate_up = torch.zeros(*shape, dtype=torch.bfloat16, device=device)
            with pytest.raises(UnsupportedInputError, match=match):
                swiglu_fp8(gate_up, case.get("g", "row"), **kw)


def test_ops_refuse_like_the_functions():
    ops = torch.ops.custom_kernels
    x, w = torch.zeros(4, 144), torch.ones(144)
    with pytest.raises(UnsupportedInputError, match="custom_kernels::rms_norm_fp8_fwd: "
                                                    "granularity 'block_1x128' needs hidden"):
        ops.rms_norm_fp8_fwd(x, w, None, 1e-6, x.dtype, "block_1x128", E4M3, True)
    with pytest.raises(UnsupportedInputError, match="custom_kernels::swiglu_fp8_fwd: "
                                                    "granularity 'tensor'"):
        ops.swiglu_fp8_fwd(torch.zeros(4, 256), "tensor", E4M3, True)


# --- the custom ops: fakes, opcheck, torch.compile --------------------------------------------

@pytest.mark.parametrize("g", GRANULARITIES)
@pytest.mark.parametrize("write_y", [True, False])
def test_fakes_match_the_real_outputs(g, write_y):
    x, w, res, gate_up = sample(3, 5, 256), torch.ones(256), sample(3, 5, 256), sample(3, 5, 512)
    ops = torch.ops.custom_kernels
    real = [*ops.rms_norm_fp8_fwd(x, w, res, 1e-6, torch.bfloat16, g, E4M3, write_y),
            *ops.rms_norm_fp8_fwd(x, w, None, 1e-6, torch.float32, g, E5M2, write_y),
            *ops.swiglu_fp8_fwd(gate_up, g, E4M3, write_y)]
    with FakeTensorMode():
        xf = torch.empty(3, 5, 256, dtype=torch.bfloat16, device="cuda")
        wf = torch.empty(256, device="cuda")
        guf = torch.empty(3, 5, 512, dtype=torch.bfloat16, device="cuda")
        fakes = [*ops.rms_norm_fp8_fwd(xf, wf, xf, 1e-6, torch.bfloat16, g, E4M3, write_y),
                 *ops.rms_norm_fp8_fwd(xf, wf, None, 1e-6, torch.float32, g, E5M2, write_y),
                 *ops.swiglu_fp8_fwd(guf, g, E4M3, write_y)]
    for got, want in zip(fakes, real):
        assert (got.shape, got.stride(), got.dtype) == (want.shape, want.stride(), want.dtype)
        assert got.device.type == "cuda"


@pytest.mark.parametrize("g", GRANULARITIES)
def test_opcheck(g):
    x, w, gate_up = sample(6, 256), torch.rand(256) + 0.5, sample(6, 512, dtype=torch.float32)
    ops = torch.ops.custom_kernels
    torch.library.opcheck(ops.rms_norm_fp8_fwd.default,
                          (x, w, x, 1e-6, torch.bfloat16, g, E4M3, True, None))
    torch.library.opcheck(ops.rms_norm_fp8_fwd.default,
                          (x, w, None, 1e-6, torch.bfloat16, g, E5M2, False, None))
    torch.library.opcheck(ops.swiglu_fp8_fwd.default, (gate_up, g, E4M3, True))


def test_compiles_without_a_graph_break():
    x, w, gate_up = sample(4, 256), torch.rand(256).bfloat16(), sample(4, 512)

    def fused(x, w, gate_up):
        y, q, s, h = norms.rms_norm_fp8(x, w, 1e-6, "block_1x128", x)
        y2, q2, s2 = swiglu_fp8(gate_up, "row")
        return y, q, s, h, y2, q2, s2

    compiled = torch.compile(fused, fullgraph=True, backend="eager")
    for got, want in zip(compiled(x, w, gate_up), fused(x, w, gate_up)):
        assert torch.equal(got.float(), want.float()) and got.stride() == want.stride()
    ops = torch.ops.custom_kernels  # the ops themselves (what a GPU graph holds)
    both = torch.compile(lambda x, w, gu: (*ops.rms_norm_fp8_fwd(x, w, None, 1e-6, x.dtype, "row",
                                                                 E4M3, True),
                                           *ops.swiglu_fp8_fwd(gu, "block_1x128", E4M3, False)),
                         fullgraph=True, backend="eager")
    _, _, _, q, s, y2, q2, s2 = both(x, w, gate_up)
    assert torch.equal(s, norms.rms_norm_fp8(x, w)[2]) and y2.numel() == 0
    assert torch.equal(s2, swiglu_fp8(gate_up, "block_1x128")[2])


# --- the norm kernel's FP8 configs -----------------------------------------------------------

def test_fp8_defines_add_the_output_and_drop_the_register_cap():
    problem = nc.NormProblem("rms", "fwd", 256, "bfloat16", "bfloat16", "bfloat16")
    cfg = nc.heuristic(problem)
    assert "NORM_MAX_REGS" in cfg.defines(problem)  # 16 lanes a row: capped at 32 registers
    defines = norm_fp8.fp8_defines(problem, cfg, Granularity.BLOCK_1X128, "e5m2")
    assert defines["NORM_FP8"] == 2 and defines["NORM_FP8_TYPE"] == 4
    assert "NORM_MAX_REGS" not in defines
    assert {k: v for k, v in defines.items() if not k.startswith("NORM_FP8")} == \
        {k: v for k, v in cfg.defines(problem).items() if k != "NORM_MAX_REGS"}
    scalar = nc.NormConfig(256, 8, 1, 1)
    with pytest.raises(ValueError, match="16-byte vectors"):
        norm_fp8.fp8_defines(problem, scalar, Granularity.ROW, "e4m3")


def test_norm_source_has_the_fp8_parameters_only_with_the_define():
    from custom_kernels import jit

    header = (jit.CSRC / "norm_fp8.cuh").read_text()
    assert "#define NORM_FP8_PARAMS , unsigned char* __restrict__ q_out" in header
    for source in ("norms.cu", "norms_staged.cu"):
        text = (jit.CSRC / source).read_text()
        assert '#include "norm_fp8.cuh"' in text and "float eps NORM_FP8_PARAMS)" in text


# --- launchers (no GPU: the launch recorded with stand-ins for the loader and launch) ---------

def parameter_count(source: str, kernel: str) -> int:
    """The parameters of ``kernel`` in csrc/``source`` compiled with the FP8 output."""
    import re

    from custom_kernels import jit

    text = (jit.CSRC / source).read_text()
    params = re.search(kernel + r"\(([^)]*)\)", text).group(1)
    return len(params.split(",")) + (2 if "NORM_FP8_PARAMS" in params else 0)


@pytest.fixture
def norm_launches(monkeypatch):
    from custom_kernels.norms import norm_ops as ops

    seen = []

    def plan(hidden, dtype, out_dtype, weight_dtype, residual, g, fp8, config, device):
        problem = nc.NormProblem("rms", "fwd", hidden, dtype, out_dtype, weight_dtype, True,
                                 residual)
        cfg = nc.NormConfig.from_name(config) if config else nc.heuristic(problem)
        return ops._NormPlan(cfg, norm_fp8.fp8_defines(problem, cfg, g, fp8), cfg.stages > 1, 132,
                         cfg.shared_mem(problem))

    monkeypatch.setattr(norm_fp8, "_plan", plan)
    monkeypatch.setattr(norm_fp8, "launch", lambda kernel, *args, grid, block, cluster,
                        shared_mem, device: seen.append((kernel, args, grid, block, cluster)))
    return seen


@pytest.mark.parametrize("write_y", [True, False])
def test_norm_launch_arguments(norm_launches, write_y):
    x, w, res = sample(37, 4096), torch.ones(4096, dtype=torch.bfloat16), sample(37, 4096)
    y, h, rstd, q, scale = norm_fp8._fp8_impl(x, w, res, 1e-6, torch.bfloat16,
                                              Granularity.BLOCK_1X128, E4M3, write_y, None)
    ((defines, args, grid, block, cluster),) = norm_launches
    cfg = nc.heuristic(nc.NormProblem("rms", "fwd", 4096, "bfloat16", "bfloat16", "bfloat16",
                                      True, True))
    assert (grid, block, cluster) == (37, cfg.threads, 1)  # one stage: a block a row
    assert defines["NORM_FP8"] == 2 and defines["NORM_FP8_TYPE"] == 3
    assert len(args) == parameter_count(cfg.source, "norm_fwd_staged")
    pointers = [x, res, w, None, y, h, None, rstd]
    assert list(args[:8]) == [t.data_ptr() if t is not None else 0 for t in pointers]
    assert args[8:11] == (37, 4096, 4096) and args[-2:] == (q.data_ptr(), scale.data_ptr())
    assert (y is None) != write_y and q.shape == x.shape and scale.stride() == (1, 37)


def test_norm_copies_rows_the_kernel_cannot_read_16_bytes_at_a_time(norm_launches):
    wide = sample(8, 260)
    x = wide[:, 2:258]  # row stride 260: not a multiple of 8 elements
    w = torch.ones(257, dtype=torch.float32)[1:]  # 4 bytes off 16
    norm_fp8._fp8_impl(x, w, None, 1e-6, torch.bfloat16, Granularity.ROW, E5M2, True, None)
    aligned = sample(8, 512)[:, 256:]  # stride 512, pointer 512 bytes in: read in place
    norm_fp8._fp8_impl(aligned, w.clone(), None, 1e-6, torch.bfloat16, Granularity.ROW, E4M3,
                       True, None)
    (_, copied, *_), (_, in_place, *_) = norm_launches
    assert copied[0] != x.data_ptr() and copied[2] != w.data_ptr() and copied[10] == 256
    assert in_place[0] == aligned.data_ptr() and in_place[10] == 512
    assert norm_launches[0][0]["NORM_FP8_TYPE"] == 4


@pytest.fixture
def swiglu_launches(monkeypatch):
    from custom_kernels import swiglu as s

    seen = []
    monkeypatch.setattr(s, "_fp8_kernel", lambda *key: s._fp8_defines(*key[:4]))
    monkeypatch.setattr(s, "launch", lambda kernel, *args, grid, block, device: seen.append(
        (kernel, args, grid, block)))
    return seen


@pytest.mark.parametrize("g,inter,team", [("row", 14336, 256), ("row", 48, 8),
                                          ("block_1x128", 4096, 16)])
def test_swiglu_launch_arguments(swiglu_launches, g, inter, team):
    from custom_kernels import swiglu as s

    gate_up = sample(77, 2 * inter)
    y, q, scale = s._fp8_impl(gate_up, Granularity(g), E4M3, True)
    ((defines, args, grid, block),) = swiglu_launches
    assert defines == {"DTYPE": 2, "VEC": 1, "BLOCK": 256, "FP8": 3,
                       "MODE": s.FP8_MODES[Granularity(g)], "NV": s.NV}
    assert len(args) == parameter_count("swiglu.cu", s.FP8_KERNEL)
    group = 128 if g == "block_1x128" else inter
    assert args == (gate_up.data_ptr(), y.data_ptr(), q.data_ptr(), scale.data_ptr(), 77, inter,
                    2 * inter, group, team.bit_length() - 1)
    assert block == 256 and grid == -(-77 * (inter // group) // (256 // team))


def test_swiglu_strided_rows_take_scalar_accesses(swiglu_launches):
    from custom_kernels import swiglu as s

    gate_up = sample(5, 520)[:, :512]  # row stride 520 keeps 16 bytes: vectors
    s._fp8_impl(gate_up, Granularity.ROW, E4M3, False)
    odd = sample(5, 515)[:, :512]  # stride 515: one element an access, read in place
    s._fp8_impl(odd, Granularity.ROW, E4M3, False)
    (vec, args, *_), (scalar, odd_args, *_) = swiglu_launches
    assert vec["VEC"] == 1 and args[1] == 0 and args[6] == 520  # no y
    assert scalar["VEC"] == 0 and odd_args[0] == odd.data_ptr() and odd_args[6] == 515


def test_the_sources_use_the_element_table_codes():
    from custom_kernels import jit
    from custom_kernels.core.elements import element

    common = (jit.CSRC / "fp8_common.cuh").read_text()
    assert f"FP8_CODE == {element(E5M2).code} ? __NV_E5M2 : __NV_E4M3" in common
    assert "57344.0f : 448.0f" in common
    assert torch.finfo(E5M2).max == 57344 and torch.finfo(E4M3).max == 448


@pytest.mark.parametrize("cls", ["RMSNorm", "OffsetRMSNorm"])
def test_module_forward_fp8_is_forward_then_quantize(cls):
    module = getattr(norms, cls)(256, eps=1e-5).bfloat16()
    with torch.no_grad():
        module.weight.uniform_(-0.5, 1.5)
    x, res = sample(6, 256), sample(6, 256)
    y, q, scale, h = module.forward_fp8(x, "block_1x128", res)
    want_y, want_h = module(x, res)
    assert torch.equal(y, want_y) and torch.equal(h, want_h)
    assert_same_fp8((q, scale), torch_quantize(y, "block_1x128"))
    y, q, scale = module.forward_fp8(x, "row", fp8_dtype=E5M2)
    assert torch.equal(y, module(x))
    assert_same_fp8((q, scale), torch_quantize(y, "row", fp8_dtype=E5M2))


@pytest.mark.compile
def test_norm_fp8_kernels_compile_with_nvcc_without_warnings_or_spills():
    """The heuristic's FP8 kernels over the hidden sizes the families take (bf16; fp32 at
    4096), each granularity, with and without a residual: no warnings, at most the 16 bytes of
    spills the norms' own nvcc test allows, the staged kernels' static shared memory still a
    multiple of 128 bytes."""
    import concurrent.futures
    import re
    import subprocess

    from custom_kernels import jit
    from cutlass_ops.gemms.build import nvcc_path

    def build(args):
        source, defines = args
        cmd = [nvcc_path(), "-std=c++17", "-arch=sm_90a", "--cubin", "-o", "/dev/null",
               "-Xptxas", "-v", "-Werror", "all-warnings",
               *(f"-I{d}" for d in jit.include_dirs()),
               *(f"-D{k}={v}" for k, v in defines.items()), str(jit.CSRC / source)]
        return args, subprocess.run(cmd, capture_output=True, text=True)

    variants = []
    for hidden, dtype in [(h, "bfloat16") for h in (256, 1024, 4096, 8192, 16384, 65536)] + \
            [(4096, "float32")]:
        for residual in (False, True):
            problem = nc.NormProblem("rms", "fwd", hidden, dtype, dtype, dtype, True, residual)
            cfg = nc.heuristic(problem)
            for g in norm_fp8.MODE_CODES:
                variants.append((cfg.source, norm_fp8.fp8_defines(problem, cfg, g, "e4m3")))
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        results = list(pool.map(build, variants))
    failed = [(args, r.stderr[-2000:]) for args, r in results if r.returncode]
    assert not failed, failed[0]
    spills = [int(n) for _, r in results for n in re.findall(r"(\d+) bytes spill stores",
                                                            r.stdout + r.stderr)]
    assert spills and max(spills) <= 16, max(spills)
    smem = [int(n) for (source, _), r in results if source == "norms_staged.cu"
            for n in re.findall(r"(\d+) bytes smem", r.stdout + r.stderr)]
    assert smem and all(n % 128 == 0 for n in smem)
