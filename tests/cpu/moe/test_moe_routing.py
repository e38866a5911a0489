"""The MoE routing without a GPU: route_reference against Hugging Face's chain (softmax or sigmoid,
topk, normalization, a stable argsort, counts and their cumulative sum, the inverse) on random,
even, skewed and empty-expert routings, ties to the lower index, its gradients (gradcheck in
float64), the input rules (raised on every device and by the custom ops), T = 0, the fakes'
shapes and dtypes, the ops' wiring with a torch stand-in for the kernels (the eager path, the
custom op's autograd, torch.compile(fullgraph=True), opcheck), the backward kernel's formulas
against autograd, and the kernels' partition, histogram, scan and placement emulated in torch."""

import re

import pytest
import torch
from torch._subclasses import FakeTensorMode

from custom_kernels.moe import moe_routing as mr
from custom_kernels.core.errors import UnsupportedInputError

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
SCORINGS = ["softmax", "sigmoid"]


def hf_chain(logits, top_k, scoring="softmax", normalize=True):
    """Hugging Face's router (Qwen3MoeTopKRouter, Mixtral) and the sort cutlass_ops.moe does
    with its output, written out."""
    if scoring == "softmax":
        probs = torch.nn.functional.softmax(logits, dim=-1, dtype=torch.float32)
    else:
        probs = torch.sigmoid(logits.float())
    values, index = torch.topk(probs, top_k, dim=-1)
    if normalize:
        values = values / values.sum(dim=-1, keepdim=True)
    weights = values.to(logits.dtype)
    flat = index.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=logits.shape[1])
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel())
    return mr.Routing(weights, index, (order // top_k).int(), counts.cumsum(0).int(),
                      inverse.view(index.shape).int())


def distinct_logits(tokens, experts, dtype=torch.float32, generator=None, favourites=None):
    """Logits [T, E] whose rows are permutations of distinct values exact in every dtype (steps
    of 1/16 below 256 / 16): no ties, no near-ties. ``favourites``: experts that get the
    largest values of every row, in this order (a skewed routing; the others get none)."""
    values = (torch.arange(experts, dtype=torch.float32) - experts // 2) / 16
    rows = torch.stack([torch.randperm(experts, generator=generator) for _ in range(tokens)])
    logits = values[rows] if tokens else torch.empty(0, experts)
    if favourites is not None and tokens:
        top = values.max() + 1 + torch.arange(len(favourites), 0, -1, dtype=torch.float32) / 16
        logits[:, favourites] = top
    return logits.to(dtype)


def assert_routing_equal(got, want, exact_weights=True):
    assert got.weights.dtype == want.weights.dtype and got.index.dtype == torch.int64
    for name in ("token_of_row", "offsets", "inverse"):
        assert getattr(got, name).dtype == torch.int32, name
    for name in ("index", "token_of_row", "offsets", "inverse"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    if exact_weights:
        assert torch.equal(got.weights, want.weights)
    else:
        torch.testing.assert_close(got.weights, want.weights)


def check_consistent(r, tokens, experts, top_k):
    """The invariants of a routing, whatever the logits."""
    assert r.weights.shape == r.index.shape == r.inverse.shape == (tokens, top_k)
    assert r.token_of_row.shape == (tokens * top_k,) and r.offsets.shape == (experts,)
    flat = r.index.reshape(-1)
    assert sorted(r.inverse.reshape(-1).tolist()) == list(range(tokens * top_k))
    assert torch.equal(r.token_of_row[r.inverse.long()],
                       torch.arange(tokens).unsqueeze(1).expand(tokens, top_k).int())
    sorted_experts = torch.empty_like(flat)
    sorted_experts[r.inverse.reshape(-1).long()] = flat
    assert bool((sorted_experts[1:] >= sorted_experts[:-1]).all())
    ends = torch.searchsorted(sorted_experts, torch.arange(experts), right=True)
    assert torch.equal(r.offsets, ends.int())


# --- the reference against Hugging Face's chain ------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scoring", SCORINGS)
@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("tokens, experts, top_k", [(1, 1, 1), (7, 8, 2), (64, 64, 8),
                                                    (33, 128, 1), (16, 256, 8), (5, 1024, 32)])
def test_reference_equals_the_hf_chain(dtype, scoring, normalize, tokens, experts, top_k):
    g = torch.Generator().manual_seed(tokens * experts + top_k)
    if experts <= 256:  # no ties among values rounded to a 16-bit dtype
        logits = distinct_logits(tokens, experts, dtype, g)
    else:  # float32 (1024 distinct values do not fit bfloat16's 8 bits)
        logits = torch.randn(tokens, experts, generator=g)
    got = mr.route_reference(logits, top_k, scoring=scoring, normalize=normalize)
    assert_routing_equal(got, hf_chain(logits, top_k, scoring, normalize))
    check_consistent(got, tokens, experts, top_k)


@pytest.mark.parametrize("kind", ["even", "skewed", "empty experts"])
def test_reference_on_even_skewed_and_empty_expert_routings(kind):
    tokens, experts, top_k = 96, 16, 2
    g = torch.Generator().manual_seed(1)
    if kind == "even":  # token t goes to experts 2t and 2t + 1 mod 16: 12 pairs an expert
        logits = torch.zeros(tokens, experts)
        t = torch.arange(tokens)
        logits[t, (2 * t) % experts] = 2.0
        logits[t, (2 * t + 1) % experts] = 1.0
    elif kind == "skewed":  # every token to experts 11 and 3
        logits = distinct_logits(tokens, experts, generator=g, favourites=[11, 3])
    else:  # only the even experts are ever chosen
        logits = distinct_logits(tokens, experts, generator=g)
        logits[:, 1::2] -= 100
    r = mr.route_reference(logits, top_k)
    assert_routing_equal(r, hf_chain(logits, top_k))
    check_consistent(r, tokens, experts, top_k)
    counts = torch.diff(r.offsets, prepend=r.offsets.new_zeros(1))
    if kind == "even":
        assert counts.tolist() == [12] * experts
    elif kind == "skewed":
        assert counts[11] == counts[3] == tokens and counts.sum() == 2 * tokens
        assert r.index[:, 0].eq(11).all() and r.index[:, 1].eq(3).all()
        # stable: expert 3's rows hold the tokens in order, then expert 11's
        assert r.token_of_row.tolist() == list(range(tokens)) * 2
    else:
        assert not counts[1::2].any()


@pytest.mark.parametrize("scoring", SCORINGS)
def test_ties_go_to_the_lower_index(scoring):
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0, 3.0],
                           [2.0, 2.0, 2.0, 2.0, 2.0],
                           [0.0, 5.0, -1.0, 5.0, 5.0]])
    r = mr.route_reference(logits, 3, scoring=scoring)
    assert r.index.tolist() == [[1, 2, 4], [0, 1, 2], [1, 3, 4]]
    assert torch.allclose(r.weights[1], torch.full((3,), 1 / 3))
    r = mr.route_reference(logits, 2, scoring=scoring, normalize=False)
    assert r.index.tolist() == [[1, 2], [0, 1], [1, 3]]
    check_consistent(r, 3, 5, 2)


def test_reference_keeps_float32_scores_for_16_bit_logits():
    """The weights are float32 math rounded once: not softmax in bf16."""
    logits = distinct_logits(32, 64, torch.bfloat16, torch.Generator().manual_seed(3))
    r = mr.route_reference(logits, 4)
    probs = logits.float().softmax(-1)
    v = probs.gather(1, r.index)
    assert torch.equal(r.weights, (v / v.sum(-1, keepdim=True)).bfloat16())


@pytest.mark.parametrize("scoring", SCORINGS)
@pytest.mark.parametrize("normalize", [True, False])
def test_reference_gradcheck_in_float64(scoring, normalize):
    logits = distinct_logits(6, 12, torch.float64, torch.Generator().manual_seed(4))
    logits = (logits + 0.01 * torch.randn(6, 12, dtype=torch.float64)).requires_grad_()
    assert torch.autograd.gradcheck(
        lambda x: mr.route_reference(x, 3, scoring=scoring, normalize=normalize).weights,
        (logits,))


def test_reference_empty_tokens():
    r = mr.route_reference(torch.empty(0, 8), 2)
    assert r.weights.shape == (0, 2) and r.token_of_row.shape == (0,)
    assert r.offsets.tolist() == [0] * 8 and r.inverse.shape == (0, 2)


# --- the public function off CUDA --------------------------------------------------------------

def test_route_on_cpu_runs_the_reference(warnings):
    logits = distinct_logits(9, 16, torch.bfloat16).requires_grad_()
    r = mr.route(logits, 4)
    assert_routing_equal(r, mr.route_reference(logits, 4))
    r.weights.float().square().sum().backward()
    assert logits.grad.shape == logits.shape and logits.grad.dtype == torch.bfloat16
    mr.route(logits, 4)
    assert warnings() == ["moe_routing uses route_reference: the tensors are on cpu, not a "
                          "CUDA device"]
    r = mr.route(torch.empty(0, 16), 4)
    assert r.offsets.tolist() == [0] * 16 and r.weights.shape == (0, 4)


def test_meta():
    r = mr.route(torch.empty(5, 64, device="meta", dtype=torch.bfloat16), 8)
    assert r.weights.shape == (5, 8) and r.weights.device.type == "meta"
    assert r.offsets.shape == (64,) and r.token_of_row.shape == (40,)


# --- input rules -------------------------------------------------------------------------------

def refused(match, *args, fn=mr.route, **kwargs):
    with pytest.raises(UnsupportedInputError, match=match):
        fn(*args, **kwargs)


def test_input_rules():
    logits = torch.randn(4, 8)
    refused("logits must be a 2-D torch.Tensor .* got list", [[1.0]], 1)
    refused(r"logits must be a 2-D torch.Tensor \[T, E\], got shape \(8,\)", logits[0], 1)
    refused(r"got shape \(2, 4, 8\)", torch.randn(2, 4, 8), 1)
    refused("logits must be float32, float16 or bfloat16, not torch.float64", logits.double(), 1)
    refused("not torch.int64", logits.long(), 1)
    refused(r"non-contiguous last dimension \(stride 2\); call .contiguous\(\)",
            torch.randn(4, 16)[:, ::2], 1)
    refused(r"the number of experts E .* must be 1 to 1024, got 1025", torch.randn(2, 1025), 1)
    refused("must be 1 to 1024, got 0", torch.randn(2, 0), 1)
    refused(r"top_k must be an int from 1 to min\(E, 32\) = 8, got 9", logits, 9)
    refused("top_k must be an int .* got 0", logits, 0)
    refused(r"top_k must be an int from 1 to min\(E, 32\) = 32, got 33", torch.randn(2, 64), 33)
    refused("top_k must be an int .* got 2.0", logits, 2.0)
    refused("top_k must be an int .* got True", logits, True)
    refused("scoring must be one of softmax, sigmoid, got 'relu'", logits, 2, scoring="relu")
    refused("route_reference: scoring must be one of", logits, 2, scoring="x",
            fn=mr.route_reference)
    ops = torch.ops.custom_kernels
    refused("custom_kernels::moe_routing_fwd: top_k must be an int", logits, 9, "softmax", True,
            fn=ops.moe_routing_fwd)
    refused("custom_kernels::moe_routing_fwd: scoring must be one of", logits, 2, "tanh", True,
            fn=ops.moe_routing_fwd)
    index = torch.zeros(4, 2, dtype=torch.int64)
    refused(r"moe_routing_bwd: d_weights must be a torch.float32 tensor of shape \(4, 2\)",
            torch.randn(4, 3), logits, index, "softmax", True, fn=ops.moe_routing_bwd)
    refused("moe_routing_bwd: index must be the forward's int64", torch.randn(4, 2), logits,
            index.int(), "softmax", True, fn=ops.moe_routing_bwd)


def test_pair_limit(monkeypatch):
    monkeypatch.setattr(mr, "MAX_PAIRS", 10)
    refused(r"T \* k = 12 pairs exceed the int32 rows \(at most 10\)", torch.randn(6, 8), 2)


def test_rules_hold_for_cuda_tensors_too():
    """What a GPU refuses is refused before anything runs (fake CUDA tensors: no GPU here)."""
    with FakeTensorMode():
        refused("must be float32, float16 or bfloat16", torch.empty(4, 8, device="cuda",
                                                                   dtype=torch.float64), 2)
        refused("non-contiguous", torch.empty(8, 4, device="cuda").t(), 2)
        refused("top_k must be", torch.empty(4, 8, device="cuda"), 9)
        refused("1 to 1024", torch.empty(4, 2048, device="cuda"), 2)
        refused("scoring", torch.empty(4, 8, device="cuda"), 2, scoring="Softmax")


def test_cpu_tensors_at_the_ops():
    with pytest.raises(UnsupportedInputError, match="moe_routing_fwd: the tensors are on cpu"):
        torch.ops.custom_kernels.moe_routing_fwd(torch.randn(3, 8), 2, "softmax", True)
    with pytest.raises(UnsupportedInputError, match="moe_routing_bwd: the tensors are on cpu"):
        torch.ops.custom_kernels.moe_routing_bwd(torch.randn(3, 2), torch.randn(3, 8),
                                                 torch.zeros(3, 2, dtype=torch.int64),
                                                 "softmax", True)


# --- fakes -------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
def test_fakes_match_the_real_outputs(dtype):
    logits = distinct_logits(7, 32, dtype)
    real = mr.route_reference(logits, 4)
    with FakeTensorMode():
        wide = torch.empty(7, 3 * 32, device="cuda", dtype=dtype)
        logits_view = wide.narrow(-1, 32, 32)  # a row stride: read in place
        fake = mr.route(logits_view, 4)
        d_logits = torch.ops.custom_kernels.moe_routing_bwd(fake.weights, logits_view,
                                                            fake.index, "softmax", True)
    for f, r in zip(fake, real):
        assert f.shape == r.shape and f.dtype == r.dtype and f.device.type == "cuda"
        assert f.is_contiguous()
    assert d_logits.shape == (7, 32) and d_logits.dtype == dtype and d_logits.is_contiguous()


# --- the ops' wiring, with a torch stand-in for the kernels ------------------------------------

def backward_formula(d_weights, logits, index, softmax, normalize):
    """The backward kernel's formulas (csrc/moe_routing.cu), in float32 torch (float64 stays
    float64), rounded once."""
    compute = torch.promote_types(logits.dtype, torch.float32)
    x = logits.to(compute)
    p = x.softmax(-1) if softmax else torch.sigmoid(x)
    v = p.gather(1, index)
    dw = d_weights.to(compute)
    if normalize:
        total = v.sum(-1, keepdim=True)
        c = (dw * (v / total)).sum(-1, keepdim=True)
        dv = (dw - c) / total
    else:
        dv = dw
    dp = torch.zeros_like(p).scatter(1, index, dv)
    if softmax:
        dl = p * (dp - (dv * v).sum(-1, keepdim=True))
    else:
        dl = dp * p * (1 - p)
    return dl.to(logits.dtype)


def torch_launch(backward, tensors, top_k, softmax, normalize):
    """What the kernels write, in torch."""
    scoring = "softmax" if softmax else "sigmoid"
    if backward:
        d_weights, logits, index, d_logits = tensors
        assert d_weights.is_contiguous() and index.is_contiguous() and logits.stride(1) == 1
        assert index.shape[1] == top_k
        d_logits.copy_(backward_formula(d_weights, logits, index, softmax, normalize))
        return
    logits, *outs = tensors
    assert logits.stride(1) == 1 and all(o.is_contiguous() for o in outs)
    for out, want in zip(outs, mr.route_reference(logits, top_k, scoring=scoring,
                                                   normalize=normalize)):
        out.copy_(want)


@pytest.fixture
def calls(monkeypatch):
    """The stand-in installed; the list of (backward, tensors, top_k, softmax, normalize)."""
    seen = []

    def recording(*args):
        seen.append(args)
        torch_launch(*args)

    monkeypatch.setattr(mr, "_launch", recording)
    return seen


def run(fn, logits, top_k, scoring, normalize, dout):
    logits = logits.detach().requires_grad_()
    r = fn(logits, top_k, scoring, normalize)
    (d_logits,) = torch.autograd.grad(r[0], logits, dout)
    return r, d_logits


@pytest.mark.parametrize("path", ["eager", "op", "compiled"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scoring", SCORINGS)
@pytest.mark.parametrize("normalize", [True, False])
def test_paths_and_autograd(calls, path, dtype, scoring, normalize):
    """The direct path (_EagerRouting), the custom op with its registered autograd, and the op
    under torch.compile(fullgraph=True) give the reference's routing and, backward, the
    reference's autograd within float32 rounding (their formulas differ in order only)."""
    logits = distinct_logits(11, 16, dtype, torch.Generator().manual_seed(5))
    dout = torch.randn(11, 4).to(dtype)
    op = torch.ops.custom_kernels.moe_routing_fwd
    if path == "compiled":
        torch._dynamo.reset()  # one compile a case: the parameters exceed the recompile limit
    fn = {"eager": mr._route, "op": op,
          "compiled": torch.compile(mr._route, backend="aot_eager", fullgraph=True)}[path]
    r, d_logits = run(fn, logits, 4, scoring, normalize, dout)
    assert [c[0] for c in calls] == [False, True]
    want, want_d = run(lambda x, k, s, n: mr.route_reference(x, k, scoring=s, normalize=n),
                       logits, 4, scoring, normalize, dout)
    assert_routing_equal(mr.Routing(*r), want)
    assert all(not t.requires_grad for t in r[1:])
    assert d_logits.dtype == dtype and d_logits.is_contiguous()
    tol = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}[dtype]
    torch.testing.assert_close(d_logits, want_d, rtol=tol, atol=tol * 1e-2)


@pytest.mark.parametrize("scoring", SCORINGS)
@pytest.mark.parametrize("normalize", [True, False])
def test_backward_formulas_equal_autograd_in_float64(scoring, normalize):
    """The kernel's closed forms against the reference's autograd, in float64 (no rounding):
    the stand-in's backward is the .cu file's arithmetic."""
    g = torch.Generator().manual_seed(6)
    logits = distinct_logits(9, 24, torch.float64, g).requires_grad_()
    r = mr.route_reference(logits, 5, scoring=scoring, normalize=normalize)
    dout = torch.randn(9, 5, dtype=torch.float64, generator=g)
    (want,) = torch.autograd.grad(r.weights, logits, dout)
    got = backward_formula(dout, logits.detach(), r.index, scoring == "softmax", normalize)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)


def test_no_gradient_and_unused_weights(calls):
    logits = distinct_logits(4, 8)
    r = mr._route(logits, 2, "softmax", True)
    assert r.weights.grad_fn is None and [c[0] for c in calls] == [False]
    x = logits.clone().requires_grad_()
    with torch.no_grad():
        assert mr._route(x, 2, "softmax", True).weights.grad_fn is None
    r = torch.ops.custom_kernels.moe_routing_fwd(x, 2, "softmax", True)
    (r[0].sum() * 0 + r[0].sum()).backward()
    assert x.grad.shape == x.shape and calls[-1][0] is True


def test_strided_logits_reach_the_launcher_in_place(calls):
    wide = distinct_logits(6, 48)
    logits = wide[:, 16:32]
    r = mr._route(logits, 3, "softmax", True)
    seen = calls[-1][1][0]
    assert seen.data_ptr() == logits.data_ptr() and seen.stride(0) == 48
    assert_routing_equal(r, mr.route_reference(logits, 3))
    # a custom op given a transposed layout copies it (the public function refuses it)
    t = distinct_logits(16, 6).t()
    r = torch.ops.custom_kernels.moe_routing_fwd(t, 2, "sigmoid", False)
    assert calls[-1][1][0].stride(1) == 1
    assert_routing_equal(mr.Routing(*r), mr.route_reference(t, 2, scoring="sigmoid",
                                                            normalize=False))


def test_empty_tokens_through_the_ops(calls):
    for fn in (mr._route, torch.ops.custom_kernels.moe_routing_fwd):
        x = torch.empty(0, 8, requires_grad=True)
        r = fn(x, 2, "softmax", True)
        assert r[3].tolist() == [0] * 8 and r[0].shape == (0, 2) and r[2].shape == (0,)
        r[0].sum().backward()
        assert x.grad.shape == (0, 8)
    assert calls == []  # nothing launched for T = 0


@pytest.mark.parametrize("scoring", SCORINGS)
def test_opcheck(calls, scoring):
    logits = distinct_logits(5, 16, generator=torch.Generator().manual_seed(7))
    ops = torch.ops.custom_kernels
    torch.library.opcheck(ops.moe_routing_fwd.default,
                          (logits.requires_grad_(), 4, scoring, True))
    torch.library.opcheck(ops.moe_routing_fwd.default, (logits.detach(), 1, scoring, False))
    index = mr.route_reference(logits.detach(), 4).index
    torch.library.opcheck(ops.moe_routing_bwd.default,
                          (torch.randn(5, 4), logits.detach(), index, scoring, True))


# --- launcher pieces ---------------------------------------------------------------------------

@pytest.mark.parametrize("tokens", [1, 7, 31, 32, 33, 4096, 100_000, 10 ** 7])
@pytest.mark.parametrize("sms", [1, 132])
def test_partition_covers_every_token_once(tokens, sms):
    blocks, chunk = mr.partition(tokens, sms)
    assert chunk >= mr.MIN_CHUNK and blocks * chunk >= tokens > (blocks - 1) * chunk
    assert blocks <= max(1, mr.BLOCKS_PER_SM * sms)


def emulate_sort(index, experts, chunk):
    """The three forward launches' bookkeeping in torch: per-block histograms, the scan's bases
    and offsets, then each pair's rank among its block's earlier pairs of the same expert."""
    tokens, top_k = index.shape
    blocks = -(-tokens // chunk)
    flat = index.reshape(-1)
    hist = torch.zeros(blocks, experts, dtype=torch.int64)
    for b in range(blocks):
        hist[b] = torch.bincount(flat[b * chunk * top_k:(b + 1) * chunk * top_k],
                                 minlength=experts)
    total = hist.sum(0)
    start = total.cumsum(0) - total
    base = start + hist.cumsum(0) - hist
    token_of_row = torch.empty(flat.numel(), dtype=torch.int64)
    inverse = torch.empty_like(flat)
    for b in range(blocks):
        seen = torch.zeros(experts, dtype=torch.int64)
        for p in range(b * chunk * top_k, min((b + 1) * chunk, tokens) * top_k):
            e = flat[p]
            row = base[b, e] + seen[e]
            seen[e] += 1
            token_of_row[row], inverse[p] = p // top_k, row
    return token_of_row.int(), (total.cumsum(0)).int(), inverse.view(tokens, top_k).int()


@pytest.mark.parametrize("tokens, experts, top_k, chunk", [(100, 8, 2, 32), (70, 16, 4, 33),
                                                           (5, 4, 4, 32), (200, 64, 8, 40)])
def test_the_kernels_bookkeeping_equals_the_stable_sort(tokens, experts, top_k, chunk):
    g = torch.Generator().manual_seed(tokens)
    logits = distinct_logits(tokens, experts, generator=g)
    logits[: tokens // 2, :3] += 100  # half the tokens skewed to experts 0..2
    r = mr.route_reference(logits, top_k)
    token_of_row, offsets, inverse = emulate_sort(r.index, experts, chunk)
    assert torch.equal(token_of_row, r.token_of_row) and torch.equal(offsets, r.offsets)
    assert torch.equal(inverse, r.inverse)


def parameter_count(kernel: str) -> int:
    text = (mr.jit.CSRC / mr.SOURCE).read_text()
    return len(re.search(kernel + r"\(([^)]*)\)", text).group(1).split(","))


@pytest.fixture
def launches(monkeypatch):
    """The real launcher with stand-ins for the loader (it returns the kernel and its
    defines), the SM count and the launch (it records the arguments)."""
    seen = []
    monkeypatch.setattr(mr, "_kernel", lambda kernel, code, ne, device:
                        (kernel, mr._defines(kernel, code, ne)))
    monkeypatch.setattr(mr, "_sm_count", lambda device: 2)
    monkeypatch.setattr(mr, "launch", lambda kernel, *args, grid, block, device: seen.append(
        (kernel, tuple(a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args), grid,
         block)))
    monkeypatch.setattr(mr.fallback, "require_cuda", lambda *a: None)
    return seen


def test_launch_arguments(launches):
    wide = torch.randn(300, 200).bfloat16()
    logits = wide[:, :130]  # E = 130: 5 experts a lane
    out = mr._fwd_impl(logits, 6, "sigmoid", False)
    (topk, a1, g1, b1), (scan, a2, g2, b2), (place, a3, g3, b3) = launches
    blocks, chunk = mr.partition(300, 2)
    assert (blocks, chunk) == (8, 38)  # ceil(300 / (4 * 2)) tokens a block
    assert topk == ("topk", {"DTYPE": 2, "NE": 5, "WARPS": 8})
    assert scan == ("scan", {"SCAN_BLOCK": 1024}) and place == ("place", {"NE": 5, "WARPS": 8})
    assert (g1, b1, g2, b2, g3, b3) == (8, 256, 1, 1024, 8, 256)
    for name, args in (("topk", a1), ("scan", a2), ("place", a3)):
        assert len(args) == parameter_count(mr.KERNELS[name]), name
    assert a1[:3] == (logits.data_ptr(), out.weights.data_ptr(), out.index.data_ptr())
    assert a1[4:] == (300, 130, 6, 200, 38, 0, 0)
    hist, base = a1[3], a2[1]
    assert a2[0] == hist and a2[2:] == (out.offsets.data_ptr(), 8, 130)
    assert base == hist + 8 * 130 * 4  # the second half of one workspace
    assert a3 == (out.index.data_ptr(), base, out.token_of_row.data_ptr(),
                  out.inverse.data_ptr(), 300, 130, 6, 38)
    launches.clear()
    d_weights = torch.randn(300, 6).bfloat16()
    d_logits = mr._bwd_impl(d_weights, logits, out.index, "softmax", True)
    ((bwd, args, grid, block),) = launches
    assert bwd == ("bwd", {"DTYPE": 2, "NE": 5, "WARPS": 8}) and (grid, block) == (38, 256)
    assert len(args) == parameter_count(mr.KERNELS["bwd"])
    assert args == (d_weights.data_ptr(), logits.data_ptr(), out.index.data_ptr(),
                    d_logits.data_ptr(), 300, 130, 6, 200, 1, 1)


def test_lanes_per_row():
    assert [mr.lanes_per_row(e) for e in (1, 32, 33, 64, 256, 1024)] == [1, 1, 2, 2, 8, 32]
