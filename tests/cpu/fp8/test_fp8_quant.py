"""FP8 quantization without a GPU: the torch reference's rule (scales from an independent float64
amax, each group's largest value at the FP8 maximum, the round-trip error within half an FP8
step, all-zero groups scaled by 1, e5m2, non-finite values), the scales' shapes and layouts per
granularity, the transpose and the pair equal to quantizing ``x.t()``, strided rows, empty
input, refusals by name (also for fake CUDA tensors), the custom ops' fakes (FakeTensorMode,
opcheck), torch.compile(fullgraph=True), and ``cutlass_ops.scaled_mm`` of quantized operands
with each recipe's scale layout close to the float32 product."""

import math

import pytest
import torch
from torch._subclasses import FakeTensorMode

import cutlass_ops
from custom_kernels.fp8 import fp8_quant
from custom_kernels.fp8.fp8_quant import Granularity, quantize, quantize_pair
from custom_kernels.core.errors import UnsupportedInputError

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FP8 = [E4M3, E5M2]
ALL = list(Granularity)
# Half an FP8 step, relative (3 / 2 mantissa bits), and the absolute half step of the smallest
# subnormal (2^-9 / 2^-16) in units of the scale.
HALF_STEP = {E4M3: (2.0 ** -4, 2.0 ** -10), E5M2: (2.0 ** -3, 2.0 ** -17)}


def groups(m: torch.Tensor, g: Granularity):
    """Each scale group of a matrix as (index into the scale, the elements), for an
    independent loop over them."""
    rows, cols = m.shape
    if g is Granularity.TENSOR:
        yield (), m
    elif g is Granularity.ROW:
        for r in range(rows):
            yield (r, 0), m[r]
    elif g is Granularity.BLOCK_1X128:
        for r in range(rows):
            for c in range(cols // 128):
                yield (r, c), m[r, c * 128:(c + 1) * 128]
    else:
        for r in range(rows // 128):
            for c in range(cols // 128):
                yield (r, c), m[r * 128:(r + 1) * 128, c * 128:(c + 1) * 128]


def sample(rows, cols, dtype=torch.bfloat16, zero_rows=(), spread=True):
    """Random values over several decades, both signs, some rows zero."""
    x = torch.randn(rows, cols, dtype=torch.float64)
    if spread:
        x *= torch.logspace(-3, 3, rows, dtype=torch.float64)[:, None]
    x[list(zero_rows)] = 0
    return x.to(dtype)


def f32(v: float) -> float:
    return float(torch.tensor(v, dtype=torch.float32))


def expected_inv(group: torch.Tensor, fp8_dtype) -> float:
    """fp8_max / amax in float64 rounded to float32 (the float32 quotient: a float64 quotient of
    two floats rounds to the float32 one), 1.0 for an all-zero group."""
    amax = float(group.double().abs().max()) if group.numel() else 0.0
    return f32(fp8_quant.fp8_max(fp8_dtype) / amax) if amax else 1.0


def expected_scale(group: torch.Tensor, fp8_dtype) -> float:
    """1 / inv, rounded once to float32."""
    return f32(1.0 / expected_inv(group, fp8_dtype))


# --- the rule ----------------------------------------------------------------------------------

@pytest.mark.parametrize("g", ALL)
@pytest.mark.parametrize("fp8_dtype", FP8)
@pytest.mark.parametrize("transpose", [False, True])
def test_scales_values_and_round_trip(g, fp8_dtype, transpose):
    x = sample(256, 384, zero_rows=(3, 200))
    q, scale = quantize(x, g, fp8_dtype=fp8_dtype, transpose=transpose)
    m = (x.t() if transpose else x).double()
    top = fp8_quant.fp8_max(fp8_dtype)
    rel, absolute = HALF_STEP[fp8_dtype]
    qm = q.double()
    for index, group in groups(m, g):
        s = float(scale[index])
        assert s == expected_scale(group, fp8_dtype), index
        qg = dict(groups(qm, g))[index]
        if group.abs().max() == 0:
            assert s == 1.0 and (qg == 0).all()
            continue
        # the group's largest value lands on the FP8 maximum, nothing beyond it
        assert qg.abs().max() == top
        err = (qg * s - group).abs()
        assert (err <= rel * group.abs() + absolute * s * 1.0001).all(), index


def test_scales_are_the_reciprocal_of_the_float32_quotient():
    """inv = 448 / amax rounded once, scale = 1 / inv rounded once: on this data that differs
    from amax / 448 rounded once (the rule before), so the test tells the two apart."""
    amax = torch.rand(4096, dtype=torch.float64) * 1000 + 1e-3
    x = amax.float()[:, None].expand(4096, 128).contiguous()
    q, scale = quantize(x, "row")
    inv = (448 / amax.float().double()).float()
    assert torch.equal(scale[:, 0], (1 / inv.double()).float())
    assert not torch.equal(scale[:, 0], (amax.float().double() / 448).float())
    assert (q.float() == 448).all()  # each row's amax times its inv rounds to the maximum


@pytest.mark.parametrize("g", ALL)
def test_q_is_torchs_cast_of_the_clamped_product(g):
    """q = fp8(clamp(x * inv)), inv from an independent float64 amax per group."""
    x = sample(128, 256, torch.float32)
    q, _ = quantize(x, g)
    inv = torch.empty(128, 256, dtype=torch.float32)
    for index, group in groups(x, g):
        value = expected_inv(group, E4M3)
        if g is Granularity.TENSOR:
            inv.fill_(value)
        elif g is Granularity.ROW:
            inv[index[0]] = value
        elif g is Granularity.BLOCK_1X128:
            inv[index[0], index[1] * 128:(index[1] + 1) * 128] = value
        else:
            r, c = index
            inv[r * 128:(r + 1) * 128, c * 128:(c + 1) * 128] = value
    want = (x * inv).clamp(-448, 448).to(E4M3)
    assert torch.equal(q.view(torch.uint8), want.view(torch.uint8))


@pytest.mark.parametrize("fp8_dtype", FP8)
def test_all_zero_input_and_negative_zero(fp8_dtype):
    x = torch.zeros(128, 256, dtype=torch.bfloat16)
    x[5] = -0.0
    for g in ALL:
        q, scale = quantize(x, g, fp8_dtype=fp8_dtype)
        assert (scale == 1).all() and (q.float() == 0).all()
        assert (q[5].view(torch.uint8) == 0x80).all()  # the sign survives


def test_non_finite_values_stay_in_their_group():
    x = sample(128, 256, torch.float32, spread=False)
    x[2, 7] = float("nan")
    x[9, 130] = float("inf")
    q, scale = quantize(x, "block_1x128")
    assert scale[2, 0].isnan() and q[2, :128].float().isnan().all()
    assert scale[9, 1].isinf() and q[9, 130].float().isnan()
    assert (q[9, 128:].float().nan_to_num(1.0) == 0).sum() == 127  # the rest quantize to 0
    finite = torch.ones_like(scale, dtype=torch.bool)
    finite[2, 0] = finite[9, 1] = False
    assert scale[finite].isfinite().all() and (scale[finite] > 0).all()
    q, scale = quantize(x, "tensor")
    assert scale.isnan() and q.float().isnan().all()


def test_float32_values_too_small_for_a_finite_inv_keep_a_finite_one():
    """448 / amax overflows float32 below amax ~1.3e-36: inv is the largest float32 (values
    quantize finite, zeros stay zero, never NaN) and the scale its reciprocal."""
    x = torch.full((3, 128), 1e-44)
    x[0, 1:] = 0
    x[1] = 1e-30
    x[2] = 0
    q, scale = quantize(x, "row")
    biggest = torch.finfo(torch.float32).max
    assert scale[0, 0] == torch.tensor(1 / biggest, dtype=torch.float32)
    assert q[0].float().isfinite().all() and (q[0, 1:].float() == 0).all()
    assert scale[1, 0] == f32(1 / f32(448 / f32(1e-30))) and (q[1].float() == 448).all()
    assert scale[2, 0] == 1.0 and (q[2].float() == 0).all()


# --- layouts ---------------------------------------------------------------------------------

@pytest.mark.parametrize("transpose", [False, True])
def test_shapes_strides_and_dtypes(transpose):
    x = sample(256, 384)
    rows, cols = (384, 256) if transpose else (256, 384)
    expected = {Granularity.TENSOR: ((), ()), Granularity.ROW: ((rows, 1), (1, 1)),
                Granularity.BLOCK_1X128: ((rows, cols // 128), (1, rows)),
                Granularity.BLOCK_128X128: ((rows // 128, cols // 128), (cols // 128, 1))}
    for g, (shape, stride) in expected.items():
        for fp8_dtype in FP8:
            q, scale = quantize(x, g, fp8_dtype=fp8_dtype, transpose=transpose)
            assert q.shape == (rows, cols) and q.dtype == fp8_dtype and q.is_contiguous()
            assert scale.shape == shape and scale.stride() == stride
            assert scale.dtype == torch.float32


@pytest.mark.parametrize("g", ALL)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_transpose_and_pair_equal_quantizing_the_transpose(g, dtype):
    x = sample(256, 128, dtype, zero_rows=(0,))
    q, scale = quantize(x, g, transpose=True)
    want_q, want_scale = quantize(x.t().contiguous(), g)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
    assert torch.equal(scale, want_scale) and scale.stride() == want_scale.stride()
    (q1, s1), (q2, s2) = quantize_pair(x, g, fp8_dtype=E5M2)
    for (a, sa), (b, sb) in (((q1, s1), quantize(x, g, fp8_dtype=E5M2)),
                             ((q2, s2), quantize(x, g, fp8_dtype=E5M2, transpose=True))):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)) and torch.equal(sa, sb)
        assert sa.stride() == sb.stride()
    if g is Granularity.BLOCK_128X128:
        assert torch.equal(s1.t(), s2)  # the same blocks


def test_strided_rows_equal_contiguous_rows():
    wide = sample(130, 640)
    x = wide[1:129, 128:512]
    assert x.stride() == (640, 1)
    for g in ALL:
        for transpose in (False, True):
            q, s = quantize(x, g, transpose=transpose)
            q2, s2 = quantize(x.contiguous(), g, transpose=transpose)
            assert torch.equal(q.view(torch.uint8), q2.view(torch.uint8)) and torch.equal(s, s2)


@pytest.mark.parametrize("shape", [(0, 256), (128, 0), (0, 0)])
def test_empty_input_gives_empty_outputs_and_unit_scales(shape):
    x = torch.empty(shape, dtype=torch.bfloat16)
    q, scale = quantize(x, "tensor")
    assert q.shape == shape and scale.shape == () and scale == 1
    q, scale = quantize(x, "row", transpose=True)
    assert q.shape == shape[::-1] and scale.shape == (shape[1], 1) and (scale == 1).all()
    (q, s), (qt, st) = quantize_pair(x, "block_128x128")
    assert s.shape == (shape[0] // 128, shape[1] // 128) and st.shape == s.shape[::-1]


def test_granularity_is_a_string_enum():
    x = sample(128, 128)
    q1, s1 = quantize(x, Granularity.ROW)
    q2, s2 = quantize(x, "row")
    assert torch.equal(s1, s2) and Granularity.ROW == "row"


def test_off_cuda_is_logged_once(warnings):
    x = sample(4, 128)
    quantize(x, "row")
    quantize(x, "row")
    assert warnings() == ["custom_kernels.fp8.fp8_quant.quantize uses torch_quantize: the tensors "
                          "are on cpu, not a CUDA device"]


# --- refusals --------------------------------------------------------------------------------

def refused(match, x, g="row", fn=quantize, **kw):
    with pytest.raises(UnsupportedInputError, match=match):
        fn(x, g, **kw)


def test_bad_input_is_refused_by_name():
    x = sample(128, 256)
    refused("must be 2-D", torch.randn(2, 128, 128))
    refused("must be 2-D", torch.randn(128))
    refused("float32, float16 or bfloat16, not torch.float64", x.double())
    refused("float32, float16 or bfloat16, not torch.float8_e4m3fn", x.to(E4M3))
    refused(r"non-contiguous last dimension \(stride 256\)", x[:, :128].t())
    refused("must be a torch.Tensor, got list", [[1.0]])
    refused("unknown granularity 'block'; known: 'tensor', 'row'", x, "block")
    refused("fp8_dtype must be torch.float8_e4m3fn or torch.float8_e5m2, not torch.bfloat16",
            x, fp8_dtype=torch.bfloat16)
    refused("not torch.float8_e4m3fnuz", x, fp8_dtype=torch.float8_e4m3fnuz)
    refused("'block_1x128' needs the columns of the quantized matrix \\(x, \\(128, 200\\)\\) "
            "to be a multiple of 128, got 200", x[:, :200], "block_1x128")
    refused(r"columns of the quantized matrix \(x.t\(\), \(256, 100\)\)", x[:100], "block_1x128",
            transpose=True)
    refused("'block_128x128' needs the rows", x[:100], "block_128x128")
    refused(r"needs the rows of the quantized matrix \(x.t\(\), \(100, 128\)\)", x[:, :100],
            "block_128x128", transpose=True)
    # the pair checks both orientations: x (128, 256) is fine, its transpose's columns are not
    refused(r"x.t\(\), \(256, 100\)", x[:100], "block_1x128", fn=quantize_pair)
    ops = torch.ops.custom_kernels
    refused("custom_kernels::fp8_quantize: unknown granularity",
            x, "nope", fn=lambda x, g: ops.fp8_quantize(x, g, E4M3, False))
    refused("custom_kernels::fp8_quantize_pair: granularity 'block_1x128' needs",
            x[:100], "block_1x128", fn=lambda x, g: ops.fp8_quantize_pair(x, g, E4M3))


def test_rules_hold_for_cuda_tensors_too():
    """What a GPU refuses is refused before anything runs (fake CUDA tensors: no GPU here)."""
    with FakeTensorMode():
        with pytest.raises(UnsupportedInputError, match="multiple of 128"):
            quantize(torch.empty(128, 100, device="cuda"), "block_1x128")
        with pytest.raises(UnsupportedInputError, match="non-contiguous"):
            quantize(torch.empty(128, 256, device="cuda").t(), "row")


# --- the custom ops: fakes, opcheck, torch.compile --------------------------------------------

@pytest.mark.parametrize("g", ALL)
def test_fakes_match_the_outputs(g):
    x = sample(256, 384)
    with FakeTensorMode():
        xf = torch.empty(256, 384, dtype=torch.bfloat16, device="cuda")
        fakes = [torch.ops.custom_kernels.fp8_quantize(xf, g.value, E5M2, t) for t in (0, 1)]
        pair = torch.ops.custom_kernels.fp8_quantize_pair(xf, g.value, E4M3)
    real = [quantize(x, g, fp8_dtype=E5M2, transpose=t) for t in (False, True)]
    real_pair = [t for qs in quantize_pair(x, g) for t in qs]
    for got, want in zip([*fakes[0], *fakes[1], *pair], [*real[0], *real[1], *real_pair]):
        assert (got.shape, got.stride(), got.dtype) == (want.shape, want.stride(), want.dtype)
        assert got.device.type == "cuda"


@pytest.mark.parametrize("g", ALL)
def test_opcheck(g):
    x = sample(256, 128, torch.float32)
    ops = torch.ops.custom_kernels
    torch.library.opcheck(ops.fp8_quantize.default, (x, g.value, E4M3, False))
    torch.library.opcheck(ops.fp8_quantize.default, (x[:, :128], g.value, E5M2, True))
    torch.library.opcheck(ops.fp8_quantize_pair.default, (x.bfloat16(), g.value, E4M3))


def test_compiles_without_a_graph_break():
    x = sample(256, 256)

    def both(x):
        (q, s), (qt, st) = quantize_pair(x, "block_128x128")
        q1, s1 = quantize(x, "block_1x128", transpose=True)
        return q, s, qt, st, q1, s1

    compiled = torch.compile(both, fullgraph=True, backend="eager")
    for got, want in zip(compiled(x), both(x)):
        assert torch.equal(got.float(), want.float()) and got.stride() == want.stride()
    op = torch.compile(lambda x: torch.ops.custom_kernels.fp8_quantize(x, "row", E4M3, True),
                       fullgraph=True, backend="eager")
    q, s = op(x)
    assert torch.equal(s, quantize(x, "row", transpose=True)[1])


# --- end to end: scaled_mm of quantized operands ----------------------------------------------

@pytest.mark.parametrize("recipe", ["tensor", "row", "block"])
def test_scaled_mm_of_quantized_operands_is_close_to_the_product(recipe):
    x, w = torch.randn(200, 512), torch.randn(384, 512)
    if recipe == "block":
        qa, sa = quantize(x, "block_1x128")
        qw, sw = quantize(w, "block_128x128")
    else:
        qa, sa = quantize(x, recipe)
        qw, sw = quantize(w, recipe)
    y = cutlass_ops.scaled_mm(qa, qw.t(), sa, sw.t(), out_dtype=torch.float32)
    want = x @ w.t()
    err = float((y - want).norm() / want.norm())
    assert err < 0.06, err  # e4m3 on both operands: a few percent
    wrong = cutlass_ops.scaled_mm(qa, qw.t(), sa, torch.ones_like(sw).t(),
                                  out_dtype=torch.float32)
    assert float((wrong - want).norm() / want.norm()) > 0.5  # the scales matter
    assert math.isfinite(err)


# --- launcher pieces (no GPU: the plan recorded with stand-ins for the loader and launch) ------

def test_vector_ok_and_teams():
    assert fp8_quant.vector_ok(2, 4096, 4096, 256)
    assert not fp8_quant.vector_ok(2, 4100, 4100, 256)  # columns
    assert not fp8_quant.vector_ok(2, 4096, 4100, 256)  # row stride
    assert not fp8_quant.vector_ok(2, 4096, 4096, 258)  # pointer
    assert fp8_quant.vector_ok(4, 4100, 4100, 256) and not fp8_quant.vector_ok(4, 4102, 0, 0)
    team = lambda g, itemsize, cols: 1 << fp8_quant.rows_team(g, itemsize, cols)
    assert team(Granularity.BLOCK_1X128, 2, 4096) == 16
    assert team(Granularity.BLOCK_1X128, 4, 128) == 32
    assert team(Granularity.ROW, 2, 4096) == 256 and team(Granularity.ROW, 2, 100000) == 256
    assert team(Granularity.ROW, 2, 8) == 1 and team(Granularity.ROW, 4, 24) == 8
    assert team(Granularity.ROW, 2, 1000) == 128  # 125 slots
    # a row of up to BLOCK * NV slots stays in registers: 16384 bf16 values
    assert fp8_quant.BLOCK * fp8_quant.NV * fp8_quant.slot_elements(2) == 16384


def kernel_parameters():
    """{kernel name: its parameter count} read from csrc/fp8_quant.cu."""
    import re

    from custom_kernels import jit

    source = (jit.CSRC / fp8_quant.SOURCE).read_text()
    found = re.findall(r'extern "C" __global__ void __launch_bounds__\([\w, ]+\)\s*(\w+)\(([^)]*)\)',
                       source)
    return {name: len(params.split(",")) for name, params in found}


def test_the_source_agrees_with_the_launcher():
    from custom_kernels import jit

    source = (jit.CSRC / fp8_quant.SOURCE).read_text()
    assert f"constexpr int TILE = {fp8_quant.BLOCK_K};" in source
    assert f"constexpr int TILE_THREADS = {fp8_quant.TILE_THREADS};" in source
    from custom_kernels.core.elements import element  # the FP8 codes are the table's

    e4m3, e5m2 = element(E4M3).code, element(E5M2).code
    assert f"FP8 == {e5m2} ? __NV_E5M2 : __NV_E4M3" in source
    assert f"FP8 {e4m3} e4m3 / {e5m2} e5m2" in source
    assert set(kernel_parameters()) == {fp8_quant.AMAX_KERNEL, fp8_quant.ROWS_KERNEL,
                                        fp8_quant.TILES_KERNEL, fp8_quant.ONCE_KERNEL}


@pytest.fixture
def plan(monkeypatch):
    """Stand-ins for the loader and launch: the list of (kernel, defines, arguments, grid,
    block, shared memory) that ``_run`` would launch."""
    seen = []
    monkeypatch.setattr(fp8_quant, "_kernel",
                        lambda kernel, device, *key: (kernel, fp8_quant._defines(kernel, *key)))
    monkeypatch.setattr(fp8_quant, "launch", lambda kernel, *args, grid, block, shared_mem=0,
                        device=None: seen.append((*kernel, args, grid, block, shared_mem)))
    return seen


@pytest.mark.parametrize("g", ALL)
@pytest.mark.parametrize("what", ["q", "qt", "pair"])
def test_the_plan(plan, g, what):
    x = sample(256, 384)
    q, s = fp8_quant._empty_outputs(x, g, E4M3, False)
    qt, st = fp8_quant._empty_outputs(x, g, E4M3, True)
    outputs = {"q": (q, s, None, None), "qt": (None, None, qt, st), "pair": (q, s, qt, st)}[what]
    fp8_quant._run(x, g, 3, *outputs)
    names = [p[0] for p in plan]
    amax = g is Granularity.TENSOR or (g is Granularity.ROW and what != "q")
    once = g in (Granularity.TENSOR, Granularity.BLOCK_128X128)  # one scale a tile
    rows_kernel = what == "q" and not once
    assert names == [fp8_quant.AMAX_KERNEL] * amax + [
        fp8_quant.ONCE_KERNEL if once else
        fp8_quant.ROWS_KERNEL if rows_kernel else fp8_quant.TILES_KERNEL]
    counts = kernel_parameters()
    for name, defines, args, grid, block, shared in plan:
        assert len(args) == counts[name], name
        assert all(isinstance(a, int) for a in args)  # pointers and 64-bit integers
        assert defines["DTYPE"] == 2 and defines["VEC"] == 1
    name, defines, args, grid, block, shared = plan[-1]
    assert defines["MODE"] == fp8_quant.MODE_CODES[g] and defines["FP8_MAX"] == "448.0f"
    if name in (fp8_quant.TILES_KERNEL, fp8_quant.ONCE_KERNEL):
        assert (defines["WRITE_Q"], defines["WRITE_QT"]) == (what != "qt", what != "q")
        once_shared = 0  # its 16 KB of FP8 bytes are static shared memory
        assert grid == 2 * 3 and block == 256 and \
            shared == (once_shared if once else 128 * 128 * 2)
        q_, s_, qt_, st_ = outputs  # the kernel takes (x, q, qt, scale, scale_t, ...)
        assert args[1:5] == tuple(t.data_ptr() if t is not None else 0 for t in (q_, qt_, s_, st_))
    if amax:
        flags = plan[0][1]["AMAX"]
        assert flags == ({Granularity.TENSOR: 1}.get(g) or (4 if what == "qt" else 6))
        assert "FP8" not in plan[0][1]  # one amax cubin serves both FP8 types


# --- a tensor's amax given (the tensorwise weight's, reused by its transpose) -----------------

def test_tensor_amax_is_the_largest_magnitude_and_keeps_nan():
    x = sample(64, 256)
    assert fp8_quant.tensor_amax(x) == x.float().abs().max()
    assert fp8_quant.tensor_amax(x).dtype == torch.float32 and fp8_quant.tensor_amax(x).dim() == 0
    x[3, 5] = float("nan")
    assert fp8_quant.tensor_amax(x).isnan()
    assert fp8_quant.tensor_amax(torch.empty(0, 128)) == 0


@pytest.mark.parametrize("transpose", [False, True])
@pytest.mark.parametrize("fp8_dtype", FP8)
def test_a_given_amax_gives_what_the_call_without_it_gives(transpose, fp8_dtype):
    x = sample(128, 256)
    amax = fp8_quant.tensor_amax(x)
    got = quantize(x, "tensor", fp8_dtype=fp8_dtype, transpose=transpose, amax=amax)
    want = quantize(x, "tensor", fp8_dtype=fp8_dtype, transpose=transpose)
    assert torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8))
    assert torch.equal(got[1], want[1])
    # the amax is used, not recomputed: twice x's amax halves inv (a coarser, valid scale)
    q, scale = quantize(x, "tensor", fp8_dtype=fp8_dtype, transpose=transpose, amax=amax * 2)
    assert torch.equal(scale, want[1] * 2) and q.float().abs().max() < fp8_quant.fp8_max(fp8_dtype)


@pytest.mark.parametrize("bad, why", [
    (lambda x: fp8_quant.tensor_amax(x).double(), "one float32 value"),
    (lambda x: torch.ones(2), "one float32 value"),
    (lambda x: 3.0, "one float32 value"),
])
def test_a_bad_amax_is_refused(bad, why):
    x = sample(128, 256)
    with pytest.raises(UnsupportedInputError, match=why):
        quantize(x, "tensor", amax=bad(x))


def test_an_amax_with_another_granularity_is_refused():
    x = sample(128, 256)
    with pytest.raises(UnsupportedInputError, match="granularity 'tensor'"):
        quantize(x, "row", amax=fp8_quant.tensor_amax(x))
