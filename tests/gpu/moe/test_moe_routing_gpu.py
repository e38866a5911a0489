"""The MoE routing kernels on an sm90 GPU (marker gpu) against route_reference on the same GPU:
random, even, skewed and empty-expert routings, E 8, 64, 128 and 256 (and 160, 1024 at the
limits), k 1, 2 and 8 (and 32), T 1, 7 and 4096 (and 100000: many blocks, a chunk that is not a
multiple of the block's pairs), bf16, fp16 and fp32, softmax and sigmoid, normalized or not:
index, token_of_row, offsets and inverse bit for bit (the logits are permutations of distinct
values exact in the dtype, so no two scores are near each other), weights within one rounding,
and an exact tie (the lower index first); the backward against the reference's autograd; strided
logits; the backward's token loop past the grid cap; T = 0; no host sync; opcheck; the eager path
against the custom op; torch.compile(fullgraph=True); a CUDA graph replayed on new logits.

Not run yet on a GPU when written: the kernels were compiled (nvcc, NVRTC) and their arithmetic
and bookkeeping checked in torch (tests/cpu/moe/test_moe_routing.py) only."""

import pytest
import torch

from custom_kernels.moe import moe_routing as mr
from custom_kernels.core.tolerances import NORMS, relative_error, relative_tolerance

pytestmark = pytest.mark.gpu
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
KINDS = ["random", "even", "skewed", "empty experts"]
EPS = {torch.bfloat16: 2.0 ** -7, torch.float16: 2.0 ** -10, torch.float32: 1e-5}


def routing_logits(tokens, experts, top_k, kind="random", dtype=torch.bfloat16, seed=0):
    """Logits [T, E] on the GPU, each row a permutation of distinct values that the dtype holds
    exactly (steps of 1/16 for E <= 256, 1/64 above: fp16 and fp32 only), with the top k values
    on chosen experts: ``random`` any, ``even`` experts (t k + j) mod E for token t (as many
    pairs for every expert), ``skewed`` the same k experts for every token (the others empty),
    ``empty experts`` k random even experts (the odd ones empty)."""
    g = torch.Generator("cuda").manual_seed(seed)
    step = 1 / 16 if experts <= 256 else 1 / 64
    values = (torch.arange(experts, 0, -1, device="cuda") - experts // 2) * step  # descending
    keys = torch.rand(tokens, experts, device="cuda", generator=g) + 64  # after ranks 0..31
    if kind != "random":
        t = torch.arange(tokens, device="cuda").unsqueeze(1)
        j = torch.arange(top_k, device="cuda")
        if kind == "even":
            chosen = (t * top_k + j) % experts
        elif kind == "skewed":
            favourites = torch.randperm(experts, device="cuda", generator=g)[:top_k]
            chosen = favourites.expand(tokens, top_k)
        else:
            assert 2 * top_k <= experts
            halves = torch.rand(tokens, experts // 2, device="cuda", generator=g).argsort(-1)
            chosen = 2 * halves[:, :top_k]
        keys.scatter_(1, chosen, j.float().expand(tokens, top_k))  # ranks 0 .. k-1
    order = keys.argsort(-1)  # order[t, r]: the expert with the r-th largest value
    logits = torch.empty(tokens, experts, device="cuda").scatter_(
        1, order, values.float().expand(tokens, experts))
    assert torch.equal(logits.to(dtype).float(), logits)  # exact in the dtype
    return logits.to(dtype)


def check(logits, top_k, scoring="softmax", normalize=True, dout=None):
    """The kernels' routing against the reference's (integers exactly, weights within one
    rounding) and the gradient against the reference's autograd."""
    x = logits.detach().requires_grad_()
    got = mr.route(x, top_k, scoring=scoring, normalize=normalize)
    ref_x = logits.detach().requires_grad_()
    want = mr.route_reference(ref_x, top_k, scoring=scoring, normalize=normalize)
    for name in ("index", "token_of_row", "offsets", "inverse"):
        g, w = getattr(got, name), getattr(want, name)
        assert g.dtype == w.dtype and g.shape == w.shape and g.is_contiguous(), name
        assert torch.equal(g, w), name
    assert got.weights.dtype == logits.dtype and got.weights.shape == want.weights.shape
    torch.testing.assert_close(got.weights.float(), want.weights.float(),
                               rtol=EPS[logits.dtype], atol=1e-7)
    if dout is None:
        dout = torch.randn(want.weights.shape, device="cuda").to(logits.dtype)
    (d_got,) = torch.autograd.grad(got.weights, x, dout)
    (d_want,) = torch.autograd.grad(want.weights, ref_x, dout)
    assert d_got.dtype == logits.dtype and d_got.shape == logits.shape
    assert_gradient_close(d_got, d_want, dout)
    return got


def assert_gradient_close(got, want, dout):
    """The relative error within the norms' bound, measured against the reference's norm or,
    where that is near 0 (k = 1 normalized: w = 1 whatever the logits, so the gradient is 0 and
    the reference's autograd leaves rounding residue), 1e-3 of the output gradient's."""
    scale = max(float(want.float().norm()), 1e-3 * float(dout.float().norm()))
    error = float((got.float() - want.float()).norm())
    assert error <= relative_tolerance(want.dtype, NORMS) * scale, (error, scale)


# --- against the reference ---------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("experts", [8, 64, 128, 256])
@pytest.mark.parametrize("top_k", [1, 2, 8])
@pytest.mark.parametrize("tokens", [1, 7, 4096])
def test_random_routing(dtype, experts, top_k, tokens):
    check(routing_logits(tokens, experts, top_k, "random", dtype, seed=tokens + experts), top_k)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("experts", [8, 64, 128, 256])
@pytest.mark.parametrize("top_k", [1, 2, 8])
@pytest.mark.parametrize("kind", KINDS[1:])
def test_even_skewed_and_empty_expert_routings(dtype, experts, top_k, kind):
    if kind == "empty experts" and 2 * top_k > experts:
        pytest.skip("k experts among the even half need 2k <= E")
    r = check(routing_logits(4096, experts, top_k, kind, dtype, seed=experts), top_k)
    counts = torch.diff(r.offsets, prepend=r.offsets.new_zeros(1))
    if kind == "skewed":
        assert int((counts == 4096).sum()) == top_k
    elif kind == "empty experts":
        assert not counts[1::2].any()
    elif 4096 * top_k % experts == 0:
        assert bool((counts == 4096 * top_k // experts).all())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("kind", KINDS)
def test_scorings_and_normalization(dtype, scoring, normalize, kind):
    check(routing_logits(777, 64, 8, kind, dtype, seed=3), 8, scoring, normalize)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("experts, top_k", [(1024, 32), (1024, 1), (160, 6), (33, 32)])
def test_limits(dtype, experts, top_k):
    """32 experts a lane (the most registers), the largest k, E not a multiple of 32."""
    for scoring in ("softmax", "sigmoid"):
        check(routing_logits(300, experts, top_k, "random", dtype, seed=experts), top_k,
              scoring)


def test_many_tokens():
    """Hundreds of blocks, chunks of pairs that are not multiples of a block's 256 threads."""
    blocks, chunk = mr.partition(100_000, torch.cuda.get_device_properties(0).
                                 multi_processor_count)
    assert blocks > 100, (blocks, chunk)
    check(routing_logits(100_000, 128, 8, "random", torch.bfloat16, seed=5), 8)
    check(routing_logits(100_000, 128, 8, "skewed", torch.bfloat16, seed=6), 8)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
def test_exact_ties_go_to_the_lower_index(dtype, scoring):
    logits = torch.zeros(5, 16, device="cuda")
    logits[1, [3, 7, 12]] = 1.0  # a three-way tie at the top
    logits[2, [0, 9]] = 2.0
    logits[2, [4, 5, 6]] = 1.0  # a tie after the first two picks
    logits[3] = torch.arange(16, device="cuda") % 4  # four-way ties at every level
    logits[4, 15] = 3.0
    logits = logits.to(dtype)
    r = check(logits, 4, scoring)
    assert r.index.tolist() == [[0, 1, 2, 3], [3, 7, 12, 0], [0, 9, 4, 5], [3, 7, 11, 15],
                                [15, 0, 1, 2]]


def test_strided_logits_are_read_in_place():
    wide = routing_logits(500, 3 * 64, 8, "random", torch.bfloat16, seed=7)
    check(wide[:, 64:128], 8)
    one = wide[:1, 64:128]
    check(one, 2)


def test_backward_token_loop_past_the_grid_cap(monkeypatch):
    monkeypatch.setattr(mr, "MAX_GRID", 3)
    check(routing_logits(3000, 64, 4, "random", torch.bfloat16, seed=8), 4)


def test_empty_tokens():
    x = torch.empty(0, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    r = mr.route(x, 8)
    assert r.weights.shape == (0, 8) and r.index.shape == (0, 8) and r.inverse.shape == (0, 8)
    assert r.token_of_row.shape == (0,) and r.offsets.tolist() == [0] * 64
    (d,) = torch.autograd.grad(r.weights.float().sum(), x)
    assert d.shape == (0, 64)


def test_gradients_only_through_the_weights():
    x = routing_logits(64, 32, 4, "random", torch.bfloat16, seed=9).requires_grad_()
    r = mr.route(x, 4)
    assert r.weights.requires_grad
    assert not any(t.requires_grad for t in r[1:])
    with torch.no_grad():
        assert mr.route(x, 4).weights.grad_fn is None


# --- the op: no host sync, opcheck, the eager path, torch.compile, CUDA graphs -----------------

def step(x, dout, top_k=8):
    r = mr.route(x, top_k)
    (d,) = torch.autograd.grad(r.weights, x, dout)
    return (*r, d)


def test_no_host_sync():
    x = routing_logits(4096, 128, 8, "random", torch.bfloat16, seed=10).requires_grad_()
    dout = torch.randn(4096, 8, device="cuda").bfloat16()
    step(x, dout)  # compiled and loaded
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step(x, dout)
        with torch.no_grad():
            mr.route(x, 2, scoring="sigmoid", normalize=False)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("dtype", DTYPES)
def test_opcheck(dtype):
    x = routing_logits(37, 64, 4, "random", dtype, seed=11)
    ops = torch.ops.custom_kernels
    torch.library.opcheck(ops.moe_routing_fwd.default, (x.requires_grad_(), 4, "softmax", True))
    index = mr.route_reference(x.detach(), 4).index
    dout = torch.randn(37, 4, device="cuda").to(dtype)
    torch.library.opcheck(ops.moe_routing_bwd.default,
                          (dout, x.detach(), index, "sigmoid", False))


def test_eager_path_equals_the_custom_op():
    x = routing_logits(333, 64, 8, "random", torch.bfloat16, seed=12)
    dout = torch.randn(333, 8, device="cuda").bfloat16()
    eager = step(x.detach().requires_grad_(), dout)
    xo = x.detach().requires_grad_()
    op = torch.ops.custom_kernels.moe_routing_fwd(xo, 8, "softmax", True)
    (d,) = torch.autograd.grad(op[0], xo, dout)
    for got, want in zip(eager, (*op, d)):
        assert torch.equal(got, want)


def test_torch_compile_fullgraph_forward_and_backward():
    x = routing_logits(512, 64, 8, "random", torch.bfloat16, seed=13)
    target = torch.randn(512, 8, device="cuda")

    def loss(logits):
        r = mr.route(logits * 1.0, 8)
        rows = r.token_of_row.float().sum() + r.offsets[-1] + r.inverse.sum()
        return (r.weights.float() * target).square().mean(), r.index, rows

    compiled = torch.compile(loss, fullgraph=True)
    results = []
    for fn in (compiled, loss):
        xi = x.detach().requires_grad_()
        value, index, rows = fn(xi)
        value.backward()
        results.append((value.detach(), index, rows, xi.grad))
    (v1, i1, r1, g1), (v2, i2, r2, g2) = results
    assert torch.equal(i1, i2) and torch.equal(r1, r2)
    assert relative_error(v1, v2) < relative_tolerance(torch.bfloat16, NORMS)
    assert relative_error(g1, g2) < relative_tolerance(torch.bfloat16, NORMS)


def test_cuda_graph_replay_on_new_logits():
    tokens, experts, top_k = 1024, 128, 8
    x = routing_logits(tokens, experts, top_k, "random", torch.bfloat16).requires_grad_()
    dout = torch.randn(tokens, top_k, device="cuda").bfloat16()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):  # warm up (compile, load) outside the capture
            step(x, dout)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step(x, dout)
    for seed, kind in enumerate(KINDS):
        with torch.no_grad():
            x.copy_(routing_logits(tokens, experts, top_k, kind, torch.bfloat16, seed + 20))
        dout.copy_(torch.randn_like(dout))
        graph.replay()
        ref_x = x.detach().requires_grad_()
        want = mr.route_reference(ref_x, top_k)
        for got, w in zip(outs[1:5], want[1:]):
            assert torch.equal(got, w), kind
        torch.testing.assert_close(outs[0].float(), want.weights.float(),
                                   rtol=EPS[torch.bfloat16], atol=1e-7)
        (d_want,) = torch.autograd.grad(want.weights, ref_x, dout)
        assert_gradient_close(outs[5], d_want, dout)
