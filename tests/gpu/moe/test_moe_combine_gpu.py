"""The MoE combine on an sm90 GPU (marker gpu): forward and backward against the float64 reference
within the dtype's tolerance (bf16, fp16, fp32 rows; float32 or same-dtype weights; int64 and
int32 inverses; H 2048, 4096, 200 and 203, the last one element an access; k 1, 2 and 8; up to 4096
tokens), the rows' gradient bit for bit against its formula, strided and misaligned rows,
gradients only where needed, the token loop past the grid cap, empty inputs, opcheck, the eager
path against the custom op, torch.compile(fullgraph=True), a CUDA graph replayed on new data
(a new routing too), a side stream, and cutlass_ops.moe.experts_forward with the kernel against
the same with the torch fallback."""

import pytest
import torch

from custom_kernels.moe import moe_combine as mc
from custom_kernels.core.tolerances import NORMS, relative_error, relative_tolerance

pytestmark = pytest.mark.gpu
DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def bound(dtype) -> float:
    """The norms' column: float32 math and one rounding to the dtype, like this kernel (the GEMM
    column's float32 bound allows for TF32 inputs, which this kernel does not have)."""
    return relative_tolerance(dtype, NORMS)


def routing(tokens, top_k, hidden, dtype, index_dtype=torch.int64, weights_dtype=None,
            offset=0, width=None):
    """(rows [T*k, H] as columns [offset, offset + H) of a [T*k, width] tensor, inverse [T, k]
    a random permutation, weights [T, k] normalized per token), on the GPU."""
    pairs = tokens * top_k
    wide = torch.randn(pairs, width or offset + hidden, device="cuda").to(dtype)
    rows = wide[:, offset:offset + hidden]
    inverse = torch.randperm(pairs, device="cuda").view(tokens, top_k).to(index_dtype)
    weights = torch.rand(tokens, top_k, device="cuda") + 0.1
    weights = (weights / weights.sum(-1, keepdim=True)).to(weights_dtype or dtype)
    return rows, inverse, weights


def run(fn, rows, inverse, weights, dout):
    """(out, d_rows, d_weights) through autograd."""
    rows = rows.detach().requires_grad_()
    weights = weights.detach().requires_grad_()
    out = fn(rows, inverse, weights)
    d_rows, d_weights = torch.autograd.grad(out, (rows, weights), dout)
    return out, d_rows, d_weights


def rows_grad_formula(dout, inverse, weights, dtype):
    """d_rows[inverse[t, j]] = weights[t, j] * dout[t], the float32 product rounded once."""
    tokens, top_k = inverse.shape
    product = (dout.float().unsqueeze(1) * weights.float().unsqueeze(-1)).to(dtype)
    d_rows = torch.empty(tokens * top_k, dout.shape[1], device="cuda", dtype=dtype)
    d_rows[inverse.reshape(-1).long()] = product.reshape(tokens * top_k, -1)
    return d_rows


def check(rows, inverse, weights, dout=None):
    """The kernel's forward and both gradients against the reference and the formula."""
    dtype = rows.dtype
    if dout is None:
        dout = torch.randn(inverse.shape[0], rows.shape[1], device="cuda").to(dtype)
    out, d_rows, d_weights = run(mc.combine, rows, inverse, weights, dout)
    ref, _, ref_weights = run(mc.combine_reference, rows, inverse, weights, dout)
    assert out.shape == ref.shape and out.dtype == dtype and out.is_contiguous()
    assert relative_error(out, ref) < bound(dtype)
    assert d_rows.dtype == dtype and d_weights.dtype == weights.dtype
    assert torch.equal(d_rows, rows_grad_formula(dout, inverse, weights, dtype))
    assert relative_error(d_weights, ref_weights) < bound(weights.dtype)


# --- forward and backward ----------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [2048, 4096, 200, 203])  # 203: no 16-byte slots
@pytest.mark.parametrize("top_k", [1, 2, 8])
@pytest.mark.parametrize("tokens", [1, 333])
def test_against_the_reference(dtype, hidden, top_k, tokens):
    check(*routing(tokens, top_k, hidden, dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("weights_dtype", ["float32", "same"])
def test_index_and_weights_dtypes(dtype, index_dtype, weights_dtype):
    wd = torch.float32 if weights_dtype == "float32" else dtype
    check(*routing(97, 4, 512, dtype, index_dtype, wd))


@pytest.mark.parametrize("tokens, top_k, hidden", [(4096, 8, 2048), (4096, 2, 4096),
                                                   (512, 8, 7168), (64, 64, 256)])
def test_model_shapes(tokens, top_k, hidden):
    """Qwen3-30B-A3B (the motivating shape), Mixtral-8x7B, DeepSeek-V3's hidden (3.5 16-byte
    slots a thread) and the largest k."""
    check(*routing(tokens, top_k, hidden, torch.bfloat16))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("hidden", [8 * 1024 + 8, 4096 + 3])
def test_rows_longer_than_the_registers_hold(dtype, hidden):
    """More slots a thread than MAX_NS: the extra passes of both kernels (16-byte slots, and one
    element an access)."""
    check(*routing(33, 3, hidden, dtype))


@pytest.mark.parametrize("layout", ["aligned slice", "misaligned slice"])
def test_strided_rows(layout):
    """Rows read in place from a wider tensor: 16-byte accesses when the offset and the row
    stride allow, else one element an access."""
    offset, width = {"aligned slice": (64, 3 * 1024), "misaligned slice": (1, 1024 + 3)}[layout]
    check(*routing(50, 4, 1024, torch.bfloat16, offset=offset, width=width))


def test_expanded_and_transposed_output_gradients():
    rows, inverse, weights = routing(24, 2, 256, torch.bfloat16)
    check(rows, inverse, weights, torch.randn(256, 24, device="cuda").bfloat16().t())
    r = rows.detach().requires_grad_()
    w = weights.detach().requires_grad_()
    mc.combine(r, inverse, w).sum().backward()  # dout: ones expanded from a scalar
    ones = torch.ones(24, 256, device="cuda", dtype=torch.bfloat16)
    assert torch.equal(r.grad, rows_grad_formula(ones, inverse, weights, torch.bfloat16))


def test_gradients_only_where_needed():
    rows, inverse, weights = routing(40, 8, 2048, torch.bfloat16)
    dout = torch.randn(40, 2048, device="cuda").bfloat16()
    r = rows.detach().requires_grad_()
    (d_rows,) = torch.autograd.grad(mc.combine(r, inverse, weights), r, dout)
    assert torch.equal(d_rows, rows_grad_formula(dout, inverse, weights, torch.bfloat16))
    w = weights.detach().requires_grad_()
    (d_weights,) = torch.autograd.grad(mc.combine(rows, inverse, w), w, dout)
    _, _, want = run(mc.combine_reference, rows, inverse, weights, dout)
    assert relative_error(d_weights, want) < bound(torch.bfloat16)


def test_token_loop_past_the_grid_cap(monkeypatch):
    """Fewer blocks than token groups: the kernels' loops over token groups (a small cap stands
    in for MAX_GRID; a short row puts many tokens in a block, a long one one token)."""
    monkeypatch.setattr(mc, "MAX_GRID", 3)
    for hidden in (8, 2048):
        check(*routing(3000, 2, hidden, torch.bfloat16))


def test_empty_inputs():
    for tokens, top_k, hidden in [(0, 8, 2048), (5, 0, 64), (5, 2, 0)]:
        rows, inverse, weights = routing(tokens, top_k, hidden, torch.bfloat16)
        dout = torch.randn(tokens, hidden, device="cuda").bfloat16()
        out, d_rows, d_weights = run(mc.combine, rows, inverse, weights, dout)
        assert out.shape == (tokens, hidden) and not out.any()
        assert d_rows.shape == rows.shape and d_weights.shape == weights.shape
        assert not d_weights.any()


# --- the op: opcheck, the eager path, torch.compile, CUDA graphs, streams ----------------------

@pytest.mark.parametrize("dtype", DTYPES)
def test_opcheck(dtype):
    rows, inverse, weights = routing(9, 4, 96, dtype, weights_dtype=torch.float32)
    ops = torch.ops.custom_kernels
    torch.library.opcheck(ops.moe_combine_fwd.default,
                          (rows.requires_grad_(), inverse, weights.requires_grad_()))
    dout = torch.randn(9, 96, device="cuda").to(dtype)
    torch.library.opcheck(ops.moe_combine_bwd.default,
                          (dout, rows.detach(), inverse, weights.detach(), True, True))


def test_eager_path_equals_the_custom_op():
    rows, inverse, weights = routing(33, 8, 512, torch.bfloat16)
    dout = torch.randn(33, 512, device="cuda").bfloat16()
    for got, want in zip(run(mc.combine, rows, inverse, weights, dout),
                         run(torch.ops.custom_kernels.moe_combine_fwd, rows, inverse, weights,
                             dout)):
        assert torch.equal(got, want)


def test_torch_compile_fullgraph_forward_and_backward():
    rows, inverse, weights = routing(256, 8, 2048, torch.bfloat16)

    def loss(rows, inverse, weights):
        return mc.combine(rows * 2, inverse, weights.softmax(-1)).float().square().mean()

    compiled = torch.compile(loss, fullgraph=True)
    results = []
    for fn in (compiled, loss):
        r = rows.detach().requires_grad_()
        w = weights.detach().float().requires_grad_()
        value = fn(r, inverse, w)
        value.backward()
        results.append((value.detach(), r.grad, w.grad))
    for got, want in zip(*results):
        assert relative_error(got, want) < bound(torch.bfloat16)


def test_cuda_graph_replay_on_new_data():
    rows, inverse, weights = routing(512, 8, 2048, torch.bfloat16)
    rows = rows.detach().requires_grad_()
    weights = weights.detach().requires_grad_()
    dout = torch.randn(512, 2048, device="cuda").bfloat16()

    def step():
        out = mc.combine(rows, inverse, weights)
        d_rows, d_weights = torch.autograd.grad(out, (rows, weights), dout)
        return out, d_rows, d_weights

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):  # warm up (compile, load) outside the capture
            step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, d_rows, d_weights = step()
    for _ in range(3):
        new_rows, new_inverse, new_weights = routing(512, 8, 2048, torch.bfloat16)
        with torch.no_grad():
            rows.copy_(new_rows)
            weights.copy_(new_weights)
        inverse.copy_(new_inverse)  # a new routing: nothing was read on the host
        dout.copy_(torch.randn_like(dout))
        graph.replay()
        ref, _, ref_weights = run(mc.combine_reference, rows, inverse, weights, dout)
        assert relative_error(out, ref) < bound(torch.bfloat16)
        assert torch.equal(d_rows, rows_grad_formula(dout, inverse, weights, torch.bfloat16))
        assert relative_error(d_weights, ref_weights) < bound(torch.bfloat16)


def test_side_stream():
    """The kernels run on torch's current stream: queued behind a slow kernel that writes their
    input on a side stream, they read what it wrote."""
    rows, inverse, weights = routing(1024, 8, 2048, torch.bfloat16)
    fresh = torch.randn_like(rows)
    rows_in = rows.detach().clone().requires_grad_()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        torch.cuda._sleep(50_000_000)  # holds the stream for tens of milliseconds
        with torch.no_grad():
            rows_in.copy_(fresh)
        out = mc.combine(rows_in, inverse, weights)
        (d_rows,) = torch.autograd.grad(out, rows_in, torch.ones_like(out))
    stream.synchronize()
    assert relative_error(out, mc.combine_reference(fresh, inverse, weights)) < \
        bound(torch.bfloat16)
    ones = torch.ones(1024, 2048, device="cuda", dtype=torch.bfloat16)
    assert torch.equal(d_rows, rows_grad_formula(ones, inverse, weights, torch.bfloat16))


# --- in the MoE experts ------------------------------------------------------------------------

def test_experts_forward_with_the_kernel_equals_it_with_the_fallback(monkeypatch):
    """cutlass_ops.moe.experts_forward, the same call with the torch fallback in the kernel's
    place: the output and every gradient (hidden, routing weights, expert weights) agree."""
    from cutlass_ops.moe import experts as moe_experts

    g = torch.Generator("cuda").manual_seed(0)
    tokens, experts, top_k, hidden, inter = 256, 16, 4, 512, 256
    x = torch.randn(tokens, hidden, device="cuda", generator=g).bfloat16()
    scores = torch.rand(tokens, experts, device="cuda", generator=g)
    weights, index = scores.topk(top_k, dim=-1)
    gate_up = (torch.randn(experts, 2 * inter, hidden, device="cuda", generator=g)
               / hidden ** 0.5).bfloat16()
    down = (torch.randn(experts, hidden, inter, device="cuda", generator=g)
            / inter ** 0.5).bfloat16()
    dout = torch.randn(tokens, hidden, device="cuda", generator=g).bfloat16()

    def forward_backward():
        leaves = [t.detach().requires_grad_() for t in (x, weights.bfloat16(), gate_up, down)]
        out = moe_experts.experts_forward(leaves[0], index, leaves[1], leaves[2], leaves[3])
        return [out, *torch.autograd.grad(out, leaves, dout)]

    ours = forward_backward()
    monkeypatch.setattr(moe_experts, "combine", mc.torch_combine)
    theirs = forward_backward()
    for name, got, want in zip(["out", "hidden", "weights", "gate_up", "down"], ours, theirs):
        assert relative_error(got, want) < bound(torch.bfloat16), name
