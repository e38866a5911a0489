"""The MoE combine without a GPU: the torch fallback against the reference and against the torch
chain it replaces in cutlass_ops.moe (values, gradients, gradcheck in float64), the input rules
(raised on every device, and by the custom ops), empty and meta inputs, the fakes' shapes
(FakeTensorMode with CUDA tensors), the ops' wiring with a torch stand-in for the kernels (the
eager path, the custom op's autograd, torch.compile(fullgraph=True), opcheck, gradients only where
needed), the launcher's teams and access width, and cutlass_ops.moe.experts_forward against a
per-expert loop."""

import re

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses import FakeTensorMode

from custom_kernels.moe import moe_combine as mc
from custom_kernels.core.errors import UnsupportedInputError

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def routing(tokens, top_k, hidden, dtype=torch.float32, index_dtype=torch.int64,
            weights_dtype=None, generator=None):
    """(rows [T*k, H], inverse [T, k], weights [T, k]): a random permutation as inverse."""
    rows = torch.randn(tokens * top_k, hidden, generator=generator).to(dtype)
    inverse = torch.randperm(tokens * top_k, generator=generator).view(tokens, top_k)
    weights = torch.rand(tokens, top_k, generator=generator).to(weights_dtype or dtype)
    return rows, inverse.to(index_dtype), weights


def old_chain(rows, inverse, weights):
    """cutlass_ops.moe's combine before the kernel: rows put back in pair order with the sort's
    ``order`` (inverse's inverse), weighted and summed in float32, rounded once."""
    tokens, top_k = inverse.shape
    order = torch.empty_like(inverse.reshape(-1))
    order[inverse.reshape(-1)] = torch.arange(inverse.numel(), dtype=inverse.dtype)
    pairs = rows.new_zeros(rows.shape).index_copy(0, order.long(), rows)
    weighted = pairs.view(tokens, top_k, -1).float() * weights.float().unsqueeze(-1)
    return weighted.sum(1).to(rows.dtype)


def grads(fn, rows, inverse, weights, dout):
    rows = rows.detach().requires_grad_()
    weights = weights.detach().requires_grad_()
    out = fn(rows, inverse, weights)
    d_rows, d_weights = torch.autograd.grad(out, (rows, weights), dout)
    return out, d_rows, d_weights


# --- the torch fallback against the reference --------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("tokens, top_k, hidden", [(1, 1, 1), (7, 2, 33), (16, 8, 64),
                                                   (3, 5, 200), (5, 64, 8)])
def test_fallback_equals_the_reference_and_the_old_chain(dtype, index_dtype, tokens, top_k,
                                                         hidden, warnings):
    rows, inverse, weights = routing(tokens, top_k, hidden, dtype, index_dtype)
    out = mc.combine(rows, inverse, weights)
    assert out.shape == (tokens, hidden) and out.dtype == dtype and out.is_contiguous()
    assert torch.equal(out, old_chain(rows, inverse, weights))  # the same operations
    torch.testing.assert_close(out, mc.combine_reference(rows, inverse, weights))
    mc.combine(rows, inverse, weights)
    assert warnings() == ["moe_combine uses torch_combine: the tensors are on cpu, not a CUDA "
                          "device"]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("weights_dtype", ["float32", "same"])
def test_fallback_gradients_equal_the_references(dtype, weights_dtype):
    """d_rows is the float32 product weights * dout rounded once (the kernel's formula, and the
    old chain's gradient); d_weights the dot products in weights' dtype; both near the float64
    reference's."""
    wd = torch.float32 if weights_dtype == "float32" else dtype
    rows, inverse, weights = routing(9, 4, 40, dtype, weights_dtype=wd)
    dout = torch.randn(9, 40).to(dtype)
    out, d_rows, d_weights = grads(mc.combine, rows, inverse, weights, dout)
    assert d_rows.dtype == dtype and d_weights.dtype == wd
    _, old_rows, old_weights = grads(old_chain, rows, inverse, weights, dout)
    assert torch.equal(d_rows, old_rows)
    torch.testing.assert_close(d_weights, old_weights)
    formula = (dout.float().unsqueeze(1) * weights.float().unsqueeze(-1)).to(dtype)
    assert torch.equal(d_rows[inverse.reshape(-1)], formula.reshape(-1, 40))
    _, ref_rows, ref_weights = grads(mc.combine_reference, rows, inverse, weights, dout)
    torch.testing.assert_close(d_rows, ref_rows)
    torch.testing.assert_close(d_weights, ref_weights)


def test_fallback_gradcheck_in_float64():
    rows, inverse, weights = routing(4, 3, 5, torch.float64)
    rows.requires_grad_()
    weights.requires_grad_()
    assert torch.autograd.gradcheck(lambda r, w: mc.torch_combine(r, inverse, w),
                                    (rows, weights))
    assert torch.autograd.gradgradcheck(lambda r, w: mc.torch_combine(r, inverse, w),
                                        (rows, weights))


def test_reference_in_float32_math():
    rows, inverse, weights = routing(6, 2, 16, torch.bfloat16)
    ref32 = mc.combine_reference(rows, inverse, weights, torch.float32)
    assert ref32.dtype == torch.bfloat16
    torch.testing.assert_close(ref32, mc.combine_reference(rows, inverse, weights))


def test_fallback_traces_under_torch_compile():
    rows, inverse, weights = routing(8, 2, 16)
    rows.requires_grad_()
    weights.requires_grad_()
    compiled = torch.compile(mc.combine, backend="aot_eager", fullgraph=True)
    out = compiled(rows, inverse, weights)
    got = torch.autograd.grad(out.sum(), (rows, weights))
    want = torch.autograd.grad(mc.combine_reference(rows, inverse, weights).sum(),
                               (rows, weights))
    torch.testing.assert_close(out, mc.combine_reference(rows, inverse, weights))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)


# --- input rules -------------------------------------------------------------------------------

def test_input_rules():
    rows, inverse, weights = routing(4, 2, 8)

    def refused(match, *args, fn=mc.combine):
        with pytest.raises(UnsupportedInputError, match=match):
            fn(*args)

    refused("rows must be a torch.Tensor, got list", [1.0], inverse, weights)
    refused(r"rows must be 2-D, got shape \(8,\)", rows[:, 0], inverse, weights)
    refused(r"inverse must be 2-D, got shape \(8,\)", rows, inverse.reshape(-1), weights)
    refused(r"weights must be 2-D", rows, inverse, weights.reshape(-1))
    refused("rows must be float32, float16 or bfloat16, not torch.float64", rows.double(),
            inverse, weights)
    refused("rows must be float32, float16 or bfloat16, not torch.int32", rows.int(), inverse,
            weights)
    refused("inverse must be int64 or int32, not torch.int16", rows, inverse.short(), weights)
    refused("inverse must be int64 or int32, not torch.float32", rows, inverse.float(), weights)
    refused(r"rows must have T \* k = 4 \* 2 = 8 rows .* got 9",
            torch.randn(9, 8), inverse, weights)
    refused(r"rows must have T \* k = 2 \* 4 = 8 rows", torch.randn(8, 8)[:7].repeat(1, 1),
            inverse.view(2, 4), weights.view(2, 4))
    refused(r"weights must be a float32 or torch.float32 tensor of inverse's shape \(4, 2\), "
            r"got torch.float32 \(2, 4\)", rows, inverse, weights.view(2, 4))
    refused(r"weights must be a float32 or torch.bfloat16 tensor .* got torch.float16",
            rows.bfloat16(), inverse, weights.half())
    refused(r"weights must be a float32 or torch.float32 tensor .* got torch.float64", rows,
            inverse, weights.double())
    refused(r"at most 64 slots a token \(the kernel's limit\), got k = 65",
            torch.randn(65, 4), torch.arange(65).view(1, 65), torch.rand(1, 65))
    refused(r"non-contiguous last dimension \(stride 2\); call .contiguous\(\)",
            torch.randn(8, 16)[:, ::2], inverse, weights)
    ops = torch.ops.custom_kernels
    refused(r"custom_kernels::moe_combine_fwd: rows must have T \* k", torch.randn(9, 8),
            inverse, weights, fn=ops.moe_combine_fwd)
    refused(r"custom_kernels::moe_combine_bwd: dout must be a torch.float32 tensor of shape "
            r"\(4, 8\)", torch.randn(4, 7), rows, inverse, weights, True, True,
            fn=ops.moe_combine_bwd)
    refused("dout must be a torch.float32", torch.randn(4, 8).half(), rows, inverse, weights,
            True, True, fn=ops.moe_combine_bwd)


def test_rules_hold_for_cuda_tensors_too():
    """What a GPU refuses is refused before anything runs (fake CUDA tensors: no GPU here)."""
    with FakeTensorMode():
        rows = torch.empty(9, 16, device="cuda", dtype=torch.bfloat16)
        inverse = torch.empty(4, 2, device="cuda", dtype=torch.int64)
        weights = torch.empty(4, 2, device="cuda", dtype=torch.bfloat16)
        with pytest.raises(UnsupportedInputError, match=r"T \* k = 4 \* 2 = 8 rows"):
            mc.combine(rows, inverse, weights)
        with pytest.raises(UnsupportedInputError, match="at most 64 slots"):
            mc.combine(torch.empty(130, 16, device="cuda"),
                       torch.empty(2, 65, device="cuda", dtype=torch.int64),
                       torch.empty(2, 65, device="cuda"))
        with pytest.raises(UnsupportedInputError, match="non-contiguous"):
            mc.combine(torch.empty(16, 8, device="cuda").t(), inverse,
                       torch.empty(4, 2, device="cuda"))


def test_mixed_devices_and_cpu_tensors_at_the_ops():
    rows, inverse, weights = routing(2, 2, 4)
    with FakeTensorMode():
        with pytest.raises(UnsupportedInputError, match="on different devices"):
            mc.combine(torch.empty(4, 4, device="cuda"), torch.empty(2, 2, dtype=torch.int64),
                       torch.empty(2, 2, device="cuda"))
    with pytest.raises(UnsupportedInputError, match="moe_combine_fwd: the tensors are on cpu"):
        torch.ops.custom_kernels.moe_combine_fwd(rows, inverse, weights)
    with pytest.raises(UnsupportedInputError, match="moe_combine_bwd: the tensors are on cpu"):
        torch.ops.custom_kernels.moe_combine_bwd(torch.randn(2, 4), rows, inverse, weights,
                                                 True, False)


# --- empty and meta ----------------------------------------------------------------------------

def test_empty_tokens_slots_and_hidden():
    for tokens, top_k, hidden in [(0, 2, 8), (3, 0, 8), (3, 2, 0)]:
        rows, inverse, weights = routing(tokens, top_k, hidden)
        out, d_rows, d_weights = grads(mc.combine, rows, inverse, weights,
                                       torch.randn(tokens, hidden))
        assert out.shape == (tokens, hidden) and d_rows.shape == rows.shape
        assert d_weights.shape == weights.shape
        assert not out.any() and not d_weights.any()


def test_meta():
    out = mc.combine(torch.empty(24, 64, device="meta", dtype=torch.bfloat16),
                     torch.empty(3, 8, device="meta", dtype=torch.int32),
                     torch.empty(3, 8, device="meta"))
    assert out.shape == (3, 64) and out.device.type == "meta" and out.dtype == torch.bfloat16


# --- fakes -------------------------------------------------------------------------------------

def test_fakes_give_contiguous_outputs_and_the_gradients_asked_for():
    with FakeTensorMode():
        wide = torch.empty(16, 3 * 64, device="cuda", dtype=torch.bfloat16)
        rows = wide.narrow(-1, 64, 64)  # strided rows
        inverse = torch.empty(8, 2, device="cuda", dtype=torch.int64)
        weights = torch.empty(8, 2, device="cuda")
        out = mc.combine(rows, inverse, weights)
        assert out.shape == (8, 64) and out.is_contiguous() and out.dtype == torch.bfloat16
        ops = torch.ops.custom_kernels
        d_rows, d_weights = ops.moe_combine_bwd(out, rows, inverse, weights, True, True)
        assert d_rows.shape == (16, 64) and d_rows.is_contiguous()
        assert d_weights.shape == (8, 2) and d_weights.dtype == torch.float32
        d_rows, d_weights = ops.moe_combine_bwd(out, rows, inverse, weights, False, True)
        assert d_rows.shape == (0,) and d_weights.shape == (8, 2)


# --- the ops' wiring, with a torch stand-in for the kernels ------------------------------------

def torch_launch(backward, tensors):
    """What the kernels write, in torch (the .cu file's formulas)."""
    if not backward:
        rows, inverse, weights, out = tensors
        assert rows.stride(1) == 1 and out.is_contiguous()
        out.copy_(mc.torch_combine(rows, inverse, weights))
        return
    dout, rows, inverse, weights, d_rows, d_weights = tensors
    assert dout.stride(1) == 1 and rows.stride(1) == 1
    tokens, top_k = inverse.shape
    idx = inverse.reshape(-1).long()
    if d_rows is not None:
        product = dout.float().unsqueeze(1) * weights.float().unsqueeze(-1)
        d_rows[idx] = product.reshape(tokens * top_k, -1).to(d_rows.dtype)
    if d_weights is not None:
        pairs = rows.float()[idx].view(tokens, top_k, -1)
        d_weights.copy_((dout.float().unsqueeze(1) * pairs).sum(-1))


@pytest.fixture
def calls(monkeypatch):
    """The stand-in installed; the list of (backward, tensors) it saw."""
    seen = []

    def recording(backward, tensors):
        seen.append((backward, tensors))
        torch_launch(backward, tensors)

    monkeypatch.setattr(mc, "_launch", recording)
    return seen


@pytest.mark.parametrize("path", ["eager", "op", "compiled"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32])
def test_paths_and_autograd(calls, path, dtype, index_dtype):
    """The direct path (_EagerCombine), the custom op with its registered autograd, and the op
    under torch.compile(fullgraph=True) give the fallback's values and gradients."""
    rows, inverse, weights = routing(6, 3, 24, dtype, index_dtype, weights_dtype=torch.float32)
    dout = torch.randn(6, 24).to(dtype)
    fn = {"eager": mc._combine, "op": torch.ops.custom_kernels.moe_combine_fwd,
          "compiled": torch.compile(mc._combine, backend="aot_eager", fullgraph=True)}[path]
    got = grads(fn, rows, inverse, weights, dout)
    assert [c[0] for c in calls] == [False, True]
    want = grads(mc.torch_combine, rows, inverse, weights, dout)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.is_contiguous()
        torch.testing.assert_close(g, w)


@pytest.mark.parametrize("path", ["eager", "op"])
def test_gradients_only_where_needed(calls, path):
    rows, inverse, weights = routing(4, 2, 16)
    fn = {"eager": mc._combine, "op": torch.ops.custom_kernels.moe_combine_fwd}[path]
    out = fn(rows.requires_grad_(), inverse, weights)  # the weights need no gradient
    out.sum().backward()
    d_rows, d_weights = calls[-1][1][4:]
    assert d_rows is not None and d_weights is None and rows.grad.shape == rows.shape
    rows.requires_grad_(False)
    weights.requires_grad_()
    fn(rows, inverse, weights).sum().backward()
    d_rows, d_weights = calls[-1][1][4:]
    assert d_rows is None and d_weights is not None and weights.grad.shape == weights.shape
    with torch.no_grad():
        out = mc._combine(rows, inverse, weights)
    assert out.grad_fn is None and calls[-1][0] is False


def test_layouts_reaching_the_launcher(calls):
    """Strided rows are read in place; an expanded gradient is copied to rows with a unit last
    stride; a non-contiguous inverse or weights is made contiguous."""
    wide = torch.randn(12, 3 * 16)
    rows = wide[:, 16:32].requires_grad_()
    inverse = torch.randperm(12).view(2, 6).t()  # [6, 2], not contiguous
    weights = torch.rand(2, 6).t().requires_grad_()
    out = mc._combine(rows, inverse, weights)
    seen = calls[-1][1]
    assert seen[0].data_ptr() == rows.data_ptr() and seen[0].stride(0) == 48
    assert seen[1].is_contiguous() and seen[2].is_contiguous()
    torch.testing.assert_close(out, mc.combine_reference(rows, inverse, weights))
    out.sum().backward()  # dout: ones expanded from a scalar
    assert calls[-1][0] and calls[-1][1][0].stride(1) == 1
    want = torch.autograd.grad(mc.combine_reference(rows, inverse, weights).sum(),
                               (rows, weights))
    torch.testing.assert_close(rows.grad, want[0])
    torch.testing.assert_close(weights.grad, want[1])


def test_opcheck(calls):
    rows, inverse, weights = routing(5, 4, 16, weights_dtype=torch.float32)
    ops = torch.ops.custom_kernels
    torch.library.opcheck(ops.moe_combine_fwd.default,
                          (rows.requires_grad_(), inverse, weights.requires_grad_()))
    # The backward op has no autograd of its own (no double backward): detached inputs.
    for rows_grad, weights_grad in [(True, True), (True, False), (False, True)]:
        torch.library.opcheck(ops.moe_combine_bwd.default,
                              (torch.randn(5, 16), rows.detach(), inverse, weights.detach(),
                               rows_grad, weights_grad))
    torch.library.opcheck(ops.moe_combine_fwd.default,
                          (torch.randn(20, 3 * 16)[:, 8:24].requires_grad_(), inverse.int(),
                           weights.requires_grad_()))


# --- launcher pieces ---------------------------------------------------------------------------

def test_vector_ok():
    assert mc.vector_ok(2, 2048, (2048, 2048), (0, 512))
    assert mc.vector_ok(4, 4, (4,))
    assert not mc.vector_ok(2, 203)
    assert mc.vector_ok(2, 200) and mc.vector_ok(4, 200)  # 200 is 25 slots of bf16
    assert not mc.vector_ok(4, 6)
    assert not mc.vector_ok(2, 64, (100,))
    assert not mc.vector_ok(2, 64, (), (2,))
    assert mc.vector_ok(2, 64, (0,))  # a one-row (or expanded) tensor


@pytest.mark.parametrize("tokens, slots", [(4096, 256), (4096, 512), (1, 1), (7, 11),
                                           (3, 200), (5, 896), (10 ** 6, 1), (10 ** 7, 2048),
                                           (2, 0)])
def test_teams_cover_every_slot(tokens, slots):
    blocks, shift, ns = mc.team_shape(tokens, slots)
    team = 1 << shift
    teams = mc.BLOCK // team
    assert team * teams == mc.BLOCK
    assert team >= min(slots, mc.BLOCK) and (team < 2 * slots or team == 1)  # smallest
    assert ns == max(1, min(mc.MAX_NS, -(-slots // team)))
    assert blocks <= mc.MAX_GRID and (blocks == mc.MAX_GRID or blocks * teams >= tokens)
    assert blocks == mc.MAX_GRID or (blocks - 1) * teams < tokens  # no idle block


def parameter_count(kernel: str) -> int:
    text = (mc.jit.CSRC / mc.SOURCE).read_text()
    return len(re.search(kernel + r"\(([^)]*)\)", text).group(1).split(","))


@pytest.fixture
def launches(monkeypatch):
    """The real launcher with stand-ins for the loader (it returns the defines) and the launch
    (it records the arguments); CPU tensors let through the device rule."""
    seen = []
    monkeypatch.setattr(mc, "_kernel", lambda backward, *key: (backward, mc._defines(*key[:5])))
    monkeypatch.setattr(mc, "launch", lambda kernel, *args, grid, block, device: seen.append(
        (kernel, tuple(a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args), grid,
         block)))  # launch passes a tensor as its data_ptr()
    monkeypatch.setattr(mc.fallback, "require_cuda", lambda *a: None)
    return seen


@pytest.mark.parametrize("hidden, vec, team, ns", [(2048, True, 256, 1), (4096, True, 256, 2),
                                                   (7168, True, 256, 4), (64, True, 8, 1),
                                                   (200, True, 32, 1), (203, False, 256, 1)])
def test_launch_arguments(launches, hidden, vec, team, ns):
    rows, inverse, weights = routing(37, 8, hidden, torch.bfloat16, torch.int32,
                                     weights_dtype=torch.float32)
    out = mc._fwd_impl(rows, inverse, weights)
    dout = torch.randn(37, hidden).bfloat16()
    d_rows, d_weights = mc._bwd_impl(dout, rows, inverse, weights, True, True)
    (fwd, fwd_args, fwd_grid, block), (bwd, bwd_args, bwd_grid, _) = launches
    shift = team.bit_length() - 1
    want = {"DTYPE": 2, "WDTYPE": 0, "INDEX_BITS": 32, "VEC": int(vec), "NS": ns,
            "BLOCK": 256, "MAX_TOP_K": 64}
    assert fwd == (False, want) and bwd == (True, want) and block == 256
    assert fwd_grid == bwd_grid == -(-37 // (256 // team))
    assert len(fwd_args) == parameter_count(mc.KERNELS[False])
    assert len(bwd_args) == parameter_count(mc.KERNELS[True])
    assert fwd_args == (rows.data_ptr(), inverse.data_ptr(), weights.data_ptr(),
                        out.data_ptr(), 37, 8, hidden, hidden, shift)
    assert bwd_args == (dout.data_ptr(), rows.data_ptr(), inverse.data_ptr(),
                        weights.data_ptr(), d_rows.data_ptr(), d_weights.data_ptr(), 37, 8,
                        hidden, hidden, hidden, shift)


def test_launch_of_strided_rows_and_one_gradient(launches):
    """Rows read in place (their stride passed; 16-byte slots only when it allows them), a
    gradient not wanted passed as a null pointer, a one-token dout's row stride as 0."""
    wide = torch.randn(8, 3 * 64).bfloat16()
    inverse = torch.randperm(8).view(1, 8)
    weights = torch.rand(1, 8).bfloat16()
    mc._fwd_impl(wide[:, 64:128], inverse, weights)
    mc._fwd_impl(torch.randn(8, 67).bfloat16()[:, :64], inverse, weights)
    d_rows, d_weights = mc._bwd_impl(torch.randn(1, 64).bfloat16(), wide[:, 64:128], inverse,
                                     weights, False, True)
    (aligned, a_args, *_), (odd, o_args, *_), (bwd, b_args, *_) = launches
    assert aligned[1]["VEC"] == 1 and a_args[0] == wide[:, 64:].data_ptr() and a_args[7] == 192
    assert odd[1]["VEC"] == 0 and o_args[7] == 67
    assert d_rows is None and b_args[4] == 0 and b_args[5] == d_weights.data_ptr()
    assert b_args[9:11] == (0, 192)


def test_kernel_names_and_limits_match_the_source():
    source = (mc.jit.CSRC / mc.SOURCE).read_text()
    assert all(f"{name}(" in source for name in mc.KERNELS.values())
    assert re.search(r"#define MAX_TOP_K (\d+)", source).group(1) == str(mc.MAX_TOP_K)
    assert mc._defines(2, 0, 64, True, 1)["MAX_TOP_K"] == mc.MAX_TOP_K


def test_compile_function_refuses_bad_arguments():
    with pytest.raises(ValueError, match="index_bits must be 32 or 64"):
        mc.compile_moe_combine(index_bits=16)
    with pytest.raises(ValueError, match="slots_per_thread 1 to 4"):
        mc.compile_moe_combine(slots_per_thread=5)


# --- cutlass_ops.moe.experts_forward against a per-expert loop ---------------------------------

def loop_experts(hidden, index, weights, gate_up_proj, down_proj):
    """Each expert on its tokens, in float32, the weighted results added per token."""
    out = torch.zeros(hidden.shape, dtype=torch.float32)
    for e in range(gate_up_proj.shape[0]):
        tok, slot = (index == e).nonzero(as_tuple=True)
        if tok.numel():
            gate, up = (hidden[tok].float() @ gate_up_proj[e].float().t()).chunk(2, dim=-1)
            y = (F.silu(gate) * up) @ down_proj[e].float().t()
            out = out.index_add(0, tok, y * weights[tok, slot].float().unsqueeze(-1))
    return out.to(hidden.dtype)


def experts_problem(tokens=24, experts=6, top_k=3, hidden=32, inter=20, dtype=torch.float32):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    scores = torch.rand(tokens, experts, generator=g)
    weights, index = scores.topk(top_k, dim=-1)
    gate_up = (torch.randn(experts, 2 * inter, hidden, generator=g) / hidden ** 0.5).to(dtype)
    down = (torch.randn(experts, hidden, inter, generator=g) / inter ** 0.5).to(dtype)
    return [x, index, weights.to(dtype), gate_up, down]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_experts_forward_equals_a_per_expert_loop(dtype):
    from cutlass_ops.moe import experts as moe_experts
    from custom_kernels.core.tolerances import relative_error

    args = experts_problem(dtype=dtype)
    differentiable = [0, 2, 3, 4]  # hidden, the routing weights, both expert weights
    ours_in = [a.clone().requires_grad_(i in differentiable) for i, a in enumerate(args)]
    ref_in = [a.clone().requires_grad_(i in differentiable) for i, a in enumerate(args)]
    ours, ref = moe_experts.experts_forward(*ours_in), loop_experts(*ref_in)
    assert ours.dtype == dtype and ours.shape == args[0].shape
    dout = torch.randn_like(ours)
    ours.backward(dout)
    ref.backward(dout)
    bound = 1e-5 if dtype == torch.float32 else 1e-2
    assert relative_error(ours, ref) < bound
    for i in differentiable:
        assert relative_error(ours_in[i].grad, ref_in[i].grad) < 2 * bound, i


def test_experts_forward_takes_weights_of_another_dtype():
    """Routing weights neither float32 nor the model's dtype are read as float32, as the torch
    chain did; their gradient comes back in their own dtype."""
    from cutlass_ops.moe import experts as moe_experts

    args = experts_problem(dtype=torch.bfloat16)
    args[2] = args[2].half().requires_grad_()
    out = moe_experts.experts_forward(*args)
    out.float().sum().backward()
    assert out.dtype == torch.bfloat16 and args[2].grad.dtype == torch.float16
    want = loop_experts(*args)
    torch.testing.assert_close(out, want, rtol=2e-2, atol=2e-2)
