"""FP8 quantization kernels on an sm90 GPU (marker gpu): every granularity x transpose x FP8 type
x input dtype bit for bit against the torch reference run on the same device (q's bytes, the
scales and their layouts), on random data over six decades with negative values, zero rows,
large values, odd extents (one element an access), strided and misaligned rows, short rows
(small teams) and long ones (re-read past the registers); quantize_pair against two quantize
calls; NaN and inf; empty input; no host sync (sync debug mode); opcheck;
torch.compile(fullgraph=True); CUDA graph replay on new data (the scales recomputed on the
device); and cutlass_ops.scaled_mm of quantized operands (tensorwise, rowwise, blockwise; the
forward's x @ w.t() and the backward's dy @ w through the transposed weight) close to the
float32 product."""

import pytest
import torch

import cutlass_ops
from custom_kernels.core.tolerances import relative_error
from custom_kernels.fp8.fp8_quant import Granularity, quantize, quantize_pair, torch_quantize

pytestmark = pytest.mark.gpu
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FP8 = [E4M3, E5M2]
ALL = list(Granularity)
DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def data(rows, cols, dtype=torch.bfloat16, zero_rows=(0,), wide=None, offset=0):
    """Random values over six decades a row with both signs, a few large ones, some zero rows;
    as columns [offset, offset + cols) of a (rows, wide) tensor when ``wide`` is given."""
    wide = wide or cols + offset
    x = torch.randn(rows, wide, device="cuda")
    x *= torch.logspace(-3, 3, rows, device="cuda")[torch.randperm(rows, device="cuda")][:, None]
    big = 6e4 if dtype == torch.float16 else 1e6
    x.view(-1)[torch.randint(0, x.numel(), (max(1, x.numel() // 97),), device="cuda")] = -big
    x[list(zero_rows)] = 0
    return x.to(dtype)[:, offset:offset + cols]


def assert_same(got, want):
    (q, scale), (q_ref, scale_ref) = got, want
    assert q.shape == q_ref.shape and q.dtype == q_ref.dtype and q.is_contiguous()
    same = q.view(torch.uint8) == q_ref.view(torch.uint8)
    assert same.all(), f"{int((~same).sum())} of {q.numel()} bytes differ, first at " \
                       f"{(~same).nonzero()[0].tolist()}"
    assert scale.shape == scale_ref.shape and scale.stride() == scale_ref.stride()
    assert scale.dtype == torch.float32
    assert torch.equal(scale, scale_ref), (scale - scale_ref).abs().max()


def shapes(g, transpose):
    """Shapes the granularity takes (transposed: x.t()'s rules), aligned and odd."""
    if g is Granularity.BLOCK_128X128:
        return [(256, 384), (128, 1024)]
    if g is Granularity.BLOCK_1X128:
        return [(256, 384), (256, 77) if transpose else (77, 384)]
    return [(256, 384), (77, 131), (3, 4096), (1, 8)]


# --- bit for bit against the reference ----------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fp8_dtype", FP8)
@pytest.mark.parametrize("transpose", [False, True])
@pytest.mark.parametrize("g", ALL)
def test_kernels_equal_the_reference(g, transpose, fp8_dtype, dtype):
    for rows, cols in shapes(g, transpose):
        x = data(rows, cols, dtype, zero_rows=(0,) if rows > 2 else ())
        got = quantize(x, g, fp8_dtype=fp8_dtype, transpose=transpose)
        assert_same(got, torch_quantize(x, g, fp8_dtype=fp8_dtype, transpose=transpose))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("g", ALL)
def test_pair_equals_both_orientations(g, dtype):
    for rows, cols in [(256, 384), (384, 128)] + ([(77, 131)] if g in (
            Granularity.TENSOR, Granularity.ROW) else []):
        x = data(rows, cols, dtype)
        for fp8_dtype in FP8:
            pair = quantize_pair(x, g, fp8_dtype=fp8_dtype)
            assert_same(pair[0], torch_quantize(x, g, fp8_dtype=fp8_dtype))
            assert_same(pair[1], torch_quantize(x, g, fp8_dtype=fp8_dtype, transpose=True))


@pytest.mark.parametrize("layout", ["aligned slice", "misaligned slice", "padded rows"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_strided_rows(layout, dtype):
    offset, wide = {"aligned slice": (16, 1024), "misaligned slice": (1, 640),
                    "padded rows": (0, 520)}[layout]
    x = data(256, 512 if layout != "padded rows" else 512, dtype, wide=wide, offset=offset)
    assert x.stride(0) == wide
    for g in ALL:
        for transpose in (False, True):
            assert_same(quantize(x, g, transpose=transpose),
                        torch_quantize(x, g, transpose=transpose))
        pair = quantize_pair(x, g)
        assert_same(pair[1], torch_quantize(x, g, transpose=True))


@pytest.mark.parametrize("cols", [20000, 9001, 24, 2])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_row_teams_short_and_long(cols, dtype):
    """Rows past the registers (read again), odd ones, and teams smaller than a warp."""
    x = data(37, cols, dtype)
    for g in (Granularity.ROW, Granularity.TENSOR):
        assert_same(quantize(x, g), torch_quantize(x, g))
        assert_same(quantize(x, g, transpose=True), torch_quantize(x, g, transpose=True))


def test_many_rows_and_tiles():
    """More groups and tiles than one pass of the grid covers in a block's registers."""
    x = data(8192 + 128, 1024)
    for g in ALL:
        assert_same(quantize(x, g), torch_quantize(x, g))
        assert_same(quantize_pair(x, g)[1], torch_quantize(x, g, transpose=True))


def test_all_zero_and_negative_zero():
    x = torch.zeros(256, 256, device="cuda", dtype=torch.bfloat16)
    x[3] = -0.0
    for g in ALL:
        for transpose in (False, True):
            q, scale = quantize(x, g, transpose=transpose)
            assert (scale == 1).all()
            assert_same((q, scale), torch_quantize(x, g, transpose=transpose))


def test_non_finite_values():
    x = data(256, 256, torch.float32)
    x[2, 7], x[9, 130], x[200, 3] = float("nan"), float("inf"), float("-inf")
    for g in ALL:
        for transpose in (False, True):
            (q, s), (q_ref, s_ref) = (quantize(x, g, transpose=transpose),
                                      torch_quantize(x, g, transpose=transpose))
            assert torch.equal(s.isnan(), s_ref.isnan()) and s.isnan().any()
            assert torch.equal(s.nan_to_num(), s_ref.nan_to_num())
            nan = q.float().isnan()
            assert torch.equal(nan, q_ref.float().isnan())
            assert torch.equal(q.view(torch.uint8)[~nan], q_ref.view(torch.uint8)[~nan])


def test_empty_input():
    for shape in [(0, 256), (128, 0)]:
        x = torch.empty(shape, device="cuda", dtype=torch.bfloat16)
        q, s = quantize(x, "tensor", transpose=True)
        assert q.shape == shape[::-1] and q.is_cuda and s == 1
        (q, s), (qt, st) = quantize_pair(x, "row")
        assert s.shape == (shape[0], 1) and st.shape == (shape[1], 1)


# --- streams, sync, ops, compile, graphs -------------------------------------------------------

def test_no_host_sync():
    x = data(512, 1024)
    for g in ALL:  # first calls compile and load the kernels
        quantize(x, g, transpose=True), quantize_pair(x, g), quantize(x, g)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for g in ALL:
            quantize(x, g), quantize(x, g, transpose=True), quantize_pair(x, g)
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_side_stream():
    x = data(256, 512)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        got = quantize_pair(x, "row")
    torch.cuda.current_stream().wait_stream(stream)
    assert_same(got[1], torch_quantize(x, "row", transpose=True))


def test_opcheck():
    x = data(256, 384)
    ops = torch.ops.custom_kernels
    torch.library.opcheck(ops.fp8_quantize.default, (x, "block_1x128", E4M3, False))
    torch.library.opcheck(ops.fp8_quantize.default, (x, "row", E5M2, True))
    torch.library.opcheck(ops.fp8_quantize_pair.default, (x, "block_128x128", E4M3))
    torch.library.opcheck(ops.fp8_quantize_pair.default, (x, "tensor", E4M3))


def test_compiled_fullgraph_equals_eager():
    x = data(256, 384)

    def everything(x):
        out = [quantize(x, g, transpose=t) for g in ALL for t in (False, True)]
        return out + [quantize_pair(x, g) for g in ALL]

    compiled = torch.compile(everything, fullgraph=True)
    for got, want in zip(compiled(x), everything(x)):
        if isinstance(got[0], tuple):
            assert_same(got[0], want[0])
            assert_same(got[1], want[1])
        else:
            assert_same(got, want)


def test_graph_replay_recomputes_the_scales():
    x = data(256, 384)
    calls = lambda: ([quantize(x, g, transpose=t) for g in ALL for t in (False, True)]
                     + [qs for g in ALL for qs in quantize_pair(x, g)])
    calls()  # compiled and loaded before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = calls()
    x.copy_(data(256, 384, zero_rows=(5, 9)) * 7)  # new values, new amaxes
    graph.replay()
    expected = ([torch_quantize(x, g, transpose=t) for g in ALL for t in (False, True)]
                + [torch_quantize(x, g, transpose=t) for g in ALL for t in (False, True)])
    for got, want in zip(outputs, expected):
        assert_same(got, want)


# --- end to end: scaled_mm of quantized operands ----------------------------------------------

RECIPES = {"tensorwise": ("tensor", "tensor"), "rowwise": ("row", "row"),
           "blockwise": ("block_1x128", "block_128x128")}


def product_error(y, want):
    return relative_error(y.float(), want)


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_scaled_mm_forward_and_dgrad(recipe):
    """y = x @ w.t() from quantize(x), quantize(w); dx = dy @ w from quantize(dy) and
    quantize(w, transpose=True) (the backward's K-major weight), both close to float32."""
    g_act, g_weight = RECIPES[recipe]
    m, n, k = 1000, 1536, 2048
    x = torch.randn(m, k, device="cuda").bfloat16()
    w = (torch.randn(n, k, device="cuda") * 0.02).bfloat16()
    qx, sx = quantize(x, g_act)
    qw, sw = quantize(w, g_weight)
    y = cutlass_ops.scaled_mm(qx, qw.t(), sx, sw.t(), out_dtype=torch.float32)
    assert product_error(y, x.float() @ w.float().t()) < 0.06
    dy = torch.randn(m, n, device="cuda").bfloat16()
    qdy, sdy = quantize(dy, g_act)
    qwt, swt = quantize(w, g_weight, transpose=True)  # (K, N): w.t() quantized
    dx = cutlass_ops.scaled_mm(qdy, qwt.t(), sdy, swt.t(), out_dtype=torch.bfloat16)
    assert product_error(dx, dy.float() @ w.float()) < 0.06
    # and the GEMM's own error against the dequantized operands is small
    from cutlass_ops.gemms.fp8 import fp8_operands
    ref = fp8_operands.reference(qdy, qwt.t(), sdy, swt.t(), out_dtype=torch.float32)
    assert product_error(dx, ref) < 1e-2


def test_scaled_mm_wgrad_from_the_pair():
    """dW = dy.t() @ x from the pair's transposes (rowwise: K = M tokens)."""
    m, n, k = 1024, 512, 768
    x = torch.randn(m, k, device="cuda").bfloat16()
    dy = torch.randn(m, n, device="cuda").bfloat16()
    _, (qdyt, sdyt) = quantize_pair(dy, "row")  # (N, M)
    _, (qxt, sxt) = quantize_pair(x, "row")  # (K, M)
    dw = cutlass_ops.scaled_mm(qdyt, qxt.t(), sdyt, sxt.t(), out_dtype=torch.float32)
    assert product_error(dw, dy.float().t() @ x.float()) < 0.06


# --- known call signatures and a given amax --------------------------------------------------

def test_a_known_signature_skips_the_checks_and_gives_the_same_bytes(monkeypatch):
    """The second call of a signature takes its kept plan (no input checks: ``_check`` is not
    called), on new values; a new stride or alignment is a new signature."""
    from custom_kernels.fp8 import fp8_quant

    for g in ALL:
        x = data(256, 384)
        assert_same(quantize(x, g), torch_quantize(x, g))
        assert_same(quantize(x, g, transpose=True), torch_quantize(x, g, transpose=True))
        assert_same(quantize_pair(x, g)[1], torch_quantize(x, g, transpose=True))
    calls = []
    original = fp8_quant._check
    monkeypatch.setattr(fp8_quant, "_check", lambda *a, **k: (calls.append(1), original(*a, **k))[1])
    for g in ALL:
        y = data(256, 384)  # same signature, new values
        assert_same(quantize(y, g), torch_quantize(y, g))
        assert_same(quantize(y, g, transpose=True), torch_quantize(y, g, transpose=True))
        (q, s), (qt, st) = quantize_pair(y, g)
        assert_same((q, s), torch_quantize(y, g))
        assert_same((qt, st), torch_quantize(y, g, transpose=True))
    assert calls == []
    strided = data(256, 384, wide=512, offset=8)  # another stride and alignment: checked
    assert_same(quantize(strided, "row"), torch_quantize(strided, "row"))
    assert calls


@pytest.mark.parametrize("transpose", [False, True])
@pytest.mark.parametrize("fp8_dtype", FP8)
def test_a_given_amax_gives_the_same_bytes(transpose, fp8_dtype):
    from custom_kernels.fp8.fp8_quant import tensor_amax

    x = data(512, 384)
    amax = tensor_amax(x)
    assert amax.dtype == torch.float32 and amax == x.float().abs().max()
    for _ in range(2):  # the first call makes the plan, the second takes it
        assert_same(quantize(x, "tensor", fp8_dtype=fp8_dtype, transpose=transpose, amax=amax),
                    torch_quantize(x, "tensor", fp8_dtype=fp8_dtype, transpose=transpose))
    x[7, 9] = float("nan")
    assert tensor_amax(x).isnan()
