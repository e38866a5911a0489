"""FP8 outputs of the fused RMSNorm and SwiGLU kernels on an sm90 GPU (marker gpu): ``q`` and the
scales bit for bit against ``fp8_quant.torch_quantize`` (and ``fp8_quant.quantize``) of the
kernel's own rounded ``y``, and ``y`` bit for bit against ``rms_norm`` / ``swiglu``; both
granularities and FP8 types; bf16, fp16 and fp32 (and an fp32 weight, an fp32 ``y``); a
residual; hidden sizes that take each norm kernel (16- and 32-lane rows, several rows a thread,
a block a row, one and two stages, clusters, rows read again past the registers) and a sweep of
the norm's launch configs; odd row counts (rows past the end of a warp's rows); strided and
misaligned inputs (the norm copies them, SwiGLU reads them one element an access); SwiGLU rows
read again past the registers; NaN and inf; ``write_y=False``; gradients as the plain
functions'; no host sync; opcheck; torch.compile(fullgraph=True); CUDA graph replay on new data;
``cutlass_ops.scaled_mm`` reading ``q`` and the scales as they are."""

import itertools
import os

import pytest
import torch

import cutlass_ops
from custom_kernels import jit, norms, swiglu
from custom_kernels.core.tolerances import relative_error
from custom_kernels.fp8.fp8_quant import Granularity, quantize, tensor_amax, torch_quantize
from custom_kernels.fp8.grad_amax import GradAmax
from custom_kernels.norms import norm_config as nc
from custom_kernels.norms import fp8 as norm_fp8
from custom_kernels.norms import norm_ops

pytestmark = pytest.mark.gpu
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
GRANULARITIES = ["row", "block_1x128"]
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}
# hidden sizes that take each kernel of the heuristic (bf16): 16 lanes a row, 32 lanes, a block
# a row (one stage), 1024 threads (two stages), clusters
HIDDEN = [128, 256, 1024, 4096, 8192, 16384, 65536]
# (hidden, dtype) of the launch-config sweep: 8- and 16-lane rows (a chunk over two sweeps),
# several rows a thread; blocks with stages; fp32 (4 sweeps a chunk); clusters
SWEEP = [(256, torch.bfloat16), (4096, torch.bfloat16), (512, torch.float32),
         (32768, torch.bfloat16)]


def _configs(problem, limit=12):
    """A spread of the norm's valid 16-byte configs: the first of each kind."""
    kinds = {}
    for cfg in nc.space(problem):
        if cfg.vec == problem.vec:
            kinds.setdefault((cfg.stages > 0, cfg.threads_per_row, cfg.rows_per_thread,
                              cfg.cluster, cfg.param_smem, cfg.cache(problem)), cfg)
    return list(kinds.values())[:limit]


@pytest.fixture(scope="module", autouse=True)
def prebuilt():
    """The norm kernels these tests run (FP8 and plain, heuristic configs and the sweep's),
    compiled first in parallel processes: NVRTC takes seconds a kernel."""
    jobs = set()

    def add(hidden, dtype, out, w, residual, cfg=None):
        problem = nc.NormProblem("rms", "fwd", hidden, dtype, out, w, True, residual)
        cfg = cfg or nc.heuristic(problem)
        jobs.update(norm_ops._job(spec) for spec in norm_ops.kernel_specs(problem, cfg))
        for g, fp8 in itertools.product(Granularity, ("e4m3", "e5m2")):
            if g in norm_fp8.MODE_CODES:
                jobs.add(norm_ops._job((cfg.source, cfg.kernel_name("fwd"),
                                        norm_fp8.fp8_defines(problem, cfg, g, fp8))))

    for hidden, residual in itertools.product(HIDDEN, (False, True)):
        add(hidden, "bfloat16", "bfloat16", "bfloat16", residual)
    for hidden, dtype in itertools.product((256, 4096), NAMES.values()):
        add(hidden, dtype, dtype, dtype, False)
        add(hidden, dtype, "float32", "float32", False)
    for hidden, dtype in SWEEP:
        name = NAMES[dtype]
        problem = nc.NormProblem("rms", "fwd", hidden, name, name, name, True, True)
        for cfg in _configs(problem):
            add(hidden, name, name, name, True, cfg)
    norm_ops._compile(jobs, os.cpu_count() or 8, jit.DEFAULT_ARCH)


def data(rows, cols, dtype=torch.bfloat16, wide=None, offset=0):
    """Rows over four decades with both signs; columns [offset, offset + cols) of a
    (rows, wide) tensor when ``wide`` is given."""
    wide = wide or cols + offset
    x = torch.randn(rows, wide, device="cuda")
    x *= torch.logspace(-2, 2, rows, device="cuda")[torch.randperm(rows, device="cuda")][:, None]
    return x.to(dtype)[:, offset:offset + cols]


def weight(hidden, dtype=torch.bfloat16):
    return (torch.rand(hidden, device="cuda") * 2 - 0.5).to(dtype)


def assert_bits(got, want):
    assert got.shape == want.shape and got.dtype == want.dtype
    bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[got.element_size()]
    same = got.contiguous().view(bits) == want.contiguous().view(bits)
    assert same.all(), f"{int((~same).sum())} of {got.numel()} differ, first at " \
                       f"{(~same).nonzero()[0].tolist()}"


def assert_quantized(q, scale, y, g, fp8_dtype=E4M3):
    """q, scale = torch_quantize(y) bit for bit, layouts included (NaN compared by bits)."""
    y2 = y.reshape(-1, y.shape[-1])
    q_ref, scale_ref = torch_quantize(y2, g, fp8_dtype=fp8_dtype)
    assert q.is_contiguous() and q.shape == y.shape
    assert_bits(q.reshape(q_ref.shape), q_ref)
    assert scale.stride() == scale_ref.stride() and scale.dtype == torch.float32
    assert_bits(scale, scale_ref)


# --- RMSNorm ---------------------------------------------------------------------------------

@pytest.mark.parametrize("hidden", HIDDEN)
@pytest.mark.parametrize("g", GRANULARITIES)
@pytest.mark.parametrize("residual", [False, True])
def test_norm_equals_quantize_of_its_output(hidden, g, residual):
    for rows in (1, 77, 1000):
        x, w = data(rows, hidden), weight(hidden)
        res = data(rows, hidden) if residual else None
        out = norms.rms_norm_fp8(x, w, 1e-6, g, res)
        plain = norms.rms_norm(x, w, 1e-6, res)
        y, q, scale = out[:3]
        if residual:
            assert_bits(out[3], plain[1])
            plain = plain[0]
        assert_bits(y, plain)
        assert_quantized(q, scale, y, g)
        fp8_q, fp8_scale = quantize(y, g)  # the standalone kernel
        assert_bits(q, fp8_q)
        assert_bits(scale, fp8_scale)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fp8_dtype", [E4M3, E5M2])
@pytest.mark.parametrize("g", GRANULARITIES)
def test_norm_dtypes_and_fp8_types(dtype, fp8_dtype, g):
    for hidden in (256, 4096):
        x, w = data(333, hidden, dtype), weight(hidden, dtype)
        y, q, scale = norms.rms_norm_fp8(x, w, 1e-5, g, fp8_dtype=fp8_dtype)
        assert_bits(y, norms.rms_norm(x, w, 1e-5))
        assert_quantized(q, scale, y, g, fp8_dtype)
        # an fp32 weight beside 16-bit x, and an fp32 y: y as written is what is quantized
        y, q, scale = norms.rms_norm_fp8(x, w.float(), 1e-5, g, fp8_dtype=fp8_dtype,
                                         out_dtype=torch.float32)
        assert y.dtype == torch.float32
        assert_bits(y, norms.rms_norm(x, w.float(), 1e-5, out_dtype=torch.float32))
        assert_quantized(q, scale, y, g, fp8_dtype)


@pytest.mark.parametrize("hidden,dtype", SWEEP)
@pytest.mark.parametrize("g", GRANULARITIES)
def test_norm_every_kind_of_launch_config(hidden, dtype, g):
    """Each config (8-lane rows whose 128 columns span two sweeps, several rows a thread with
    rows past the end, clusters, rows read again) against rms_norm with the same config."""
    name = NAMES[dtype]
    problem = nc.NormProblem("rms", "fwd", hidden, name, name, name, True, True)
    x, w, res = data(37, hidden, dtype), weight(hidden, dtype), data(37, hidden, dtype)
    for cfg in _configs(problem):
        y, q, scale, h = norms.rms_norm_fp8(x, w, 1e-6, g, res, config=cfg.name)
        want_y, want_h = norms.rms_norm(x, w, 1e-6, res, config=cfg)
        assert_bits(y, want_y)
        assert_bits(h, want_h)
        assert_quantized(q, scale, y, g)


def test_norm_strided_and_misaligned_inputs():
    """Aligned strided rows are read in place; an odd row stride, a pointer off 16 bytes or a
    misaligned weight are copied first; 3-D input with rows that are not one view."""
    for g in GRANULARITIES:
        cases = [data(64, 1024, wide=1536, offset=512),  # aligned stride and pointer
                 data(64, 1024, wide=1030, offset=3),  # odd stride, misaligned pointer
                 data(64, 1024, wide=1032, offset=8)]  # aligned stride, pointer + 16 bytes
        w_off = weight(1025)[1:]  # 2 bytes off 16
        for x in cases:
            for w in (weight(1024), w_off):
                y, q, scale, h = norms.rms_norm_fp8(x, w, 1e-6, g, x.flip(0))
                want_y, want_h = norms.rms_norm(x.contiguous(), w.clone(), 1e-6,
                                                x.flip(0).contiguous())
                assert_bits(y, want_y)
                assert_bits(h, want_h)
                assert_quantized(q, scale, y, g)
        x3 = data(40, 3 * 512).view(8, 5, 3, 512).transpose(0, 1)[:, :, 1]  # rows not one view
        y, q, scale = norms.rms_norm_fp8(x3, weight(512), 1e-6, g)
        assert q.shape == (5, 8, 512) and scale.shape[0] == 40
        assert_quantized(q, scale, y, g)


def test_norm_non_finite_rows():
    x, w = data(64, 4096), weight(4096)
    x[3, 17] = float("nan")
    x[5, 4000] = float("inf")
    x[7] = 0
    for g in GRANULARITIES:
        y, q, scale = norms.rms_norm_fp8(x, w, 1e-6, g)
        assert_bits(y, norms.rms_norm(x, w, 1e-6))
        assert_quantized(q, scale, y, g)
        assert scale[3].isnan().all() and (scale[7] == 1).all()


def test_norm_without_y_writes_the_same_fp8():
    x, w, res = data(300, 4096), weight(4096), data(300, 4096)
    for g in GRANULARITIES:
        with torch.no_grad():
            y, q, scale, h = norms.rms_norm_fp8(x, w, 1e-6, g, res, write_y=False)
        full = norms.rms_norm_fp8(x, w, 1e-6, g, res)
        assert y is None
        assert_bits(q, full[1])
        assert_bits(scale, full[2])
        assert_bits(h, full[3])


def test_norm_gradients_are_rms_norms():
    x = data(200, 4096).requires_grad_()
    w = weight(4096).requires_grad_()
    res = data(200, 4096).requires_grad_()
    dy, dh = data(200, 4096), data(200, 4096)
    for fn in (lambda: norms.rms_norm_fp8(x, w, 1e-6, "block_1x128", res),
               torch.compile(lambda: norms.rms_norm_fp8(x, w, 1e-6, "row", res),
                             fullgraph=True)):
        y, q, scale, h = fn()
        assert not q.requires_grad and not scale.requires_grad
        got = torch.autograd.grad((y, h), (x, w, res), (dy, dh))
        y2, h2 = norms.rms_norm(x, w, 1e-6, res)
        want = torch.autograd.grad((y2, h2), (x, w, res), (dy, dh))
        for a, b in zip(got, want):
            assert_bits(a, b)


# --- SwiGLU ----------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("g", GRANULARITIES)
def test_swiglu_equals_quantize_of_its_output(dtype, g):
    # I: short rows (small teams), LlamaMLP's 14336 (7 slots a thread), 28672 (read again past
    # the registers' 8 slots)
    sizes = [128, 384, 1408 if g == "row" else 1536, 14336, 28672] + \
        ([16, 48] if g == "row" else [])
    for inter in sizes:
        for rows in (1, 77):
            gate_up = data(rows, 2 * inter, dtype) * 3
            for fp8_dtype in (E4M3, E5M2):
                y, q, scale = swiglu.swiglu_fp8(gate_up, g, fp8_dtype=fp8_dtype)
                assert_bits(y, swiglu.swiglu(gate_up))
                assert_quantized(q, scale, y, g, fp8_dtype)


@pytest.mark.parametrize("g", GRANULARITIES)
def test_swiglu_strided_and_misaligned_inputs(g):
    """Strided slices of a wider GEMM output: 16-byte accesses where stride and pointer allow,
    else one element an access; 3-D input."""
    for wide, offset in ((3 * 2048, 2048), (2 * 1024 + 5, 1), (2 * 1024 + 8, 8)):
        gate_up = data(99, 2048, wide=wide, offset=offset) * 3
        y, q, scale = swiglu.swiglu_fp8(gate_up, g)
        assert_bits(y, swiglu.swiglu(gate_up.contiguous()))
        assert_quantized(q, scale, y, g)
    gate_up = data(30, 1024).view(2, 15, 1024)
    y, q, scale = swiglu.swiglu_fp8(gate_up, g)
    assert q.shape == (2, 15, 512) and scale.shape[0] == 30
    assert_quantized(q, scale, y, g)


def test_swiglu_non_finite_and_without_y():
    gate_up = data(64, 2 * 1024) * 3
    gate_up[2, 5] = float("nan")
    gate_up[4, 1024 + 9] = float("inf")
    gate_up[6] = 0
    for g in GRANULARITIES:
        y, q, scale = swiglu.swiglu_fp8(gate_up, g)
        assert_quantized(q, scale, y, g)
        with torch.no_grad():
            none, q2, scale2 = swiglu.swiglu_fp8(gate_up, g, write_y=False)
        assert none is None
        assert_bits(q2, q)
        assert_bits(scale2, scale)


def test_swiglu_gradients_are_swiglus():
    gate_up = (data(128, 2 * 1408) * 3).requires_grad_()
    dy = data(128, 1408)
    for fn in (lambda: swiglu.swiglu_fp8(gate_up, "row"),
               torch.compile(lambda: swiglu.swiglu_fp8(gate_up, "row"), fullgraph=True)):
        y, q, scale = fn()
        (got,) = torch.autograd.grad(y, gate_up, dy)
        (want,) = torch.autograd.grad(swiglu.swiglu(gate_up), gate_up, dy)
        assert_bits(got, want)


@pytest.mark.parametrize("dtype", DTYPES)
def test_swiglu_with_amax_reduces_the_amaxes_bit_for_bit(dtype):
    """y and d_gate_up are swiglu's bits; the amaxes are tensor_amax of them (the forward's
    returned, the backward's recorded in the GradAmax for d_gate_up itself). Sizes: short rows
    (several rows a block), one block a row (many blocks a row, the grid capped at about
    AMAX_BLOCKS with rows looped), a non-16-byte I (one element an access), 4096 x 14336."""
    for rows, inter in ((3, 40), (77, 1408), (300, 14336), (33, 1001), (4096, 14336)):
        if dtype == torch.float32 and rows * inter > 10 ** 7:
            continue
        gate_up = (data(rows, 2 * inter, dtype) * 3).requires_grad_()
        dy = data(rows, inter, dtype)
        slot = GradAmax()
        y, amax = swiglu.swiglu_with_amax(gate_up, grad_amax=slot)
        (dgu,) = torch.autograd.grad(y, gate_up, dy)
        want_y = swiglu.swiglu(gate_up)
        (want_dgu,) = torch.autograd.grad(want_y, gate_up, dy)
        assert_bits(y, want_y)
        assert_bits(dgu, want_dgu)
        assert_bits(amax, tensor_amax(want_y.detach()))
        assert_bits(slot.amax_of(dgu), tensor_amax(want_dgu))
        with torch.no_grad():
            y2, amax2 = swiglu.swiglu_with_amax(gate_up)
        assert_bits(y2, want_y)
        assert_bits(amax2, amax)


def test_swiglu_with_amax_non_finite():
    gate_up = data(64, 2 * 1024) * 3
    gate_up[6] = 0
    y, amax = swiglu.swiglu_with_amax(gate_up)
    assert_bits(amax, tensor_amax(y))
    gate_up[4, 1024 + 9] = float("inf")
    y, amax = swiglu.swiglu_with_amax(gate_up)
    assert amax.item() == float("inf")
    gate_up[2, 5] = float("nan")
    y, amax = swiglu.swiglu_with_amax(gate_up)
    assert torch.isnan(amax).item() and torch.isnan(tensor_amax(y)).item()


def test_tensorwise_mlp_with_the_amaxes_gives_the_same_bits(monkeypatch):
    """gate+up GEMM -> swiglu_with_amax -> down_proj, tensorwise FP8, as the fused MLP wires
    them: the same output and gradients, bit for bit, as the same layers quantizing x and dy
    with amax passes of their own; and the backward did find d_gate_up's amax."""
    from cutlass_ops.fp8.linear import fp8_linear

    hits = []
    amax_of = GradAmax.amax_of
    monkeypatch.setattr(GradAmax, "amax_of", lambda self, g: hits.append(amax_of(self, g))
                        or hits[-1])
    x = data(512, 1024)
    w_gu = data(2 * 2816, 1024) / 32
    w_down = data(1024, 2816) / 32
    dy = data(512, 1024)

    def run(amaxes: bool):
        xs, a, b = (t.clone().requires_grad_() for t in (x, w_gu, w_down))
        slot = GradAmax() if amaxes else None
        gate_up = fp8_linear(xs, [a], None, "tensorwise", grad_amax=slot)
        if amaxes:
            h, amax = swiglu.swiglu_with_amax(gate_up, grad_amax=slot)
        else:
            h, amax = swiglu.swiglu(gate_up), None
        out = fp8_linear(h, [b], None, "tensorwise", x_amax=amax)
        out.backward(dy)
        return out.detach(), xs.grad, a.grad, b.grad

    plain, fused = run(False), run(True)
    for got, want in zip(fused, plain):
        assert_bits(got, want)
    assert len(hits) == 1 and hits[0] is not None


# --- the ops: sync, opcheck, compile, graphs, scaled_mm --------------------------------------

def _both(x, w, res, gate_up):
    y, q, s, h = norms.rms_norm_fp8(x, w, 1e-6, "block_1x128", res)
    y2, q2, s2 = swiglu.swiglu_fp8(gate_up, "row")
    y3, q3, s3 = norms.rms_norm_fp8(x, w, 1e-6, "row")
    y4, q4, s4 = swiglu.swiglu_fp8(gate_up, "block_1x128")
    return y, q, s, h, y2, q2, s2, y3, q3, s3, y4, q4, s4


def _inputs(rows=256):
    return data(rows, 4096), weight(4096), data(rows, 4096), data(rows, 2 * 1536) * 3


def test_no_host_sync():
    inputs = _inputs()
    _both(*inputs)  # compiled and loaded
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        _both(*inputs)
        with torch.no_grad():
            norms.rms_norm_fp8(inputs[0], inputs[1], write_y=False)
            swiglu.swiglu_fp8(inputs[3], write_y=False)
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_opcheck():
    x, w, res, gate_up = _inputs(64)
    ops = torch.ops.custom_kernels
    for g in GRANULARITIES:
        torch.library.opcheck(ops.rms_norm_fp8_fwd.default,
                              (x, w, res, 1e-6, torch.bfloat16, g, E4M3, True, None))
        torch.library.opcheck(ops.rms_norm_fp8_fwd.default,
                              (x, w, None, 1e-6, torch.bfloat16, g, E5M2, False, None))
        torch.library.opcheck(ops.swiglu_fp8_fwd.default, (gate_up, g, E4M3, True))


def test_compiled_fullgraph_equals_eager():
    inputs = _inputs()
    compiled = torch.compile(_both, fullgraph=True)
    for got, want in zip(compiled(*inputs), _both(*inputs)):
        assert_bits(got, want)


def test_graph_replay_on_new_data():
    inputs = _inputs()
    _both(*inputs)  # compiled and loaded before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = _both(*inputs)
    for seed in range(2):
        torch.manual_seed(seed)
        for t, new in zip(inputs, _inputs()):
            t.copy_(new * (seed + 2))  # new values, new amaxes
        graph.replay()
        for got, want in zip(outputs, _both(*inputs)):
            assert_bits(got, want)


@pytest.mark.parametrize("recipe", ["rowwise", "blockwise"])
def test_scaled_mm_reads_q_and_scales_as_they_are(recipe):
    """The FP8 GEMM after the norm: y @ w.t() from the norm's q and scales as they are
    (rowwise: (M, 1); blockwise: (M, K/128) column-major), close to the float32 product."""
    g_act, g_w = ("row", "row") if recipe == "rowwise" else ("block_1x128", "block_128x128")
    x, norm_w = data(1000, 2048), weight(2048)
    w = (torch.randn(1536, 2048, device="cuda") * 0.02).bfloat16()
    y, q, scale = norms.rms_norm_fp8(x, norm_w, 1e-6, g_act)
    qw, sw = quantize(w, g_w)
    out = cutlass_ops.scaled_mm(q, qw.t(), scale, sw.t(), out_dtype=torch.bfloat16)
    assert relative_error(out.float(), y.float() @ w.float().t()) < 0.06
    assert_quantized(q, scale, y, g_act)  # the operands quantize(y) would have given


@pytest.mark.parametrize("cls", ["RMSNorm", "OffsetRMSNorm"])
def test_module_forward_fp8(cls):
    """The norm modules' FP8 entry (what a fused block calls): y is forward's, q and the scales
    its quantization (Gemma's offset weight: a float32 weight into the kernel)."""
    module = getattr(norms, cls)(4096, eps=1e-5, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        module.weight.uniform_(-0.5, 1.5)
    x, res = data(300, 4096), data(300, 4096)
    for g in GRANULARITIES:
        y, q, scale, h = module.forward_fp8(x, g, res)
        want_y, want_h = module(x, res)
        assert_bits(y, want_y)
        assert_bits(h, want_h)
        assert_quantized(q, scale, y, g)
