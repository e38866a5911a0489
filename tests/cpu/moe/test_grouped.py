"""cutlass_ops.grouped_mm on the CPU (the per-group reference, the CPU rule): every form and
its gradients against per-group torch.matmul in float64, empty groups and zero tokens, the
custom op's registrations (opcheck), and bad input refused by name."""

import pytest
import torch

import cutlass_ops
from cutlass_ops.moe import grouped
from custom_kernels.core.errors import UnsupportedInputError


def offsets(sizes):
    return torch.tensor(sizes, dtype=torch.int32).cumsum(0).to(torch.int32)


def per_group(form, a, b, sizes):
    """The float64 ground truth, a group at a time."""
    a, b = a.double(), b.double()
    if form == "3d3d":
        return a @ b
    ends = torch.tensor(sizes).cumsum(0).tolist()
    starts = [0] + ends[:-1]
    if form == "2d3d":
        out = torch.zeros(a.shape[0], b.shape[-1], dtype=torch.float64)
        for g, (s, e) in enumerate(zip(starts, ends)):
            out[s:e] = a[s:e] @ b[g]
        return out
    if form == "2d2d":
        return torch.stack([a[:, s:e] @ b[s:e] for s, e in zip(starts, ends)])
    if form == "3d2d":
        out = torch.zeros(a.shape[1], b.shape[-1], dtype=torch.float64)
        for g, (s, e) in enumerate(zip(starts, ends)):
            out[:, s:e] = a[g] @ b[:, s:e]
        return out


CASES = {  # form: (a shape, b shape, group sizes)
    "2d3d": ((24, 16), (4, 16, 8), [5, 0, 11, 8]),
    "2d2d": ((8, 24), (24, 16), [5, 0, 11, 8]),
    "3d2d": ((4, 8, 16), (16, 24), [5, 0, 11, 8]),
    "3d3d": ((4, 8, 16), (4, 16, 24), None),
}


@pytest.mark.parametrize("form", list(CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_form_and_its_gradients_against_the_groups_one_by_one(form, dtype):
    a_shape, b_shape, sizes = CASES[form]
    a = torch.randn(a_shape, dtype=dtype, requires_grad=True)
    b = torch.randn(b_shape, dtype=dtype, requires_grad=True)
    offs = offsets(sizes) if sizes else None
    out = cutlass_ops.grouped_mm(a, b, offs)
    expected = per_group(form, a.detach(), b.detach(), sizes)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert out.dtype == dtype and out.shape == expected.shape
    torch.testing.assert_close(out.double(), expected, rtol=tol, atol=tol * 4)
    grad = torch.randn_like(out)
    out.backward(grad)
    a64 = a.detach().double().requires_grad_()
    b64 = b.detach().double().requires_grad_()
    per_group(form, a64, b64, sizes).backward(grad.double())
    torch.testing.assert_close(a.grad.double(), a64.grad, rtol=tol, atol=tol * 8)
    torch.testing.assert_close(b.grad.double(), b64.grad, rtol=tol, atol=tol * 8)


@pytest.mark.parametrize("form", ["2d3d", "3d3d"])
def test_transposed_expert_weights_get_their_gradient_in_their_own_layout(form):
    """Hugging Face's [E, N, K] weights used as [E, K, N] views: the weight gradient comes out
    contiguous in [E, N, K], so AccumulateGrad adds it without a transposing copy."""
    a_shape, b_shape, sizes = CASES[form]
    a = torch.randn(a_shape, requires_grad=True)
    w = torch.randn(b_shape[0], b_shape[2], b_shape[1], requires_grad=True)  # [E, N, K]
    offs = offsets(sizes) if sizes else None
    out = cutlass_ops.grouped_mm(a, w.transpose(1, 2), offs)
    grad = torch.randn_like(out)
    out.backward(grad)
    w64 = w.detach().double().requires_grad_()
    per_group(form, a.detach().double(), w64.transpose(1, 2), sizes).backward(grad.double())
    assert w.grad.is_contiguous()
    torch.testing.assert_close(w.grad.double(), w64.grad, rtol=1e-5, atol=1e-4)


def test_rows_past_the_last_group_get_no_gradient_and_zero_tokens_work():
    a = torch.randn(10, 16, requires_grad=True)
    b = torch.randn(2, 16, 8, requires_grad=True)
    offs = offsets([3, 4])  # rows 7..9 belong to no group
    cutlass_ops.grouped_mm(a, b, offs).sum().backward()
    assert torch.equal(a.grad[7:], torch.zeros(3, 16)) and a.grad[:7].abs().sum() > 0
    empty = cutlass_ops.grouped_mm(torch.randn(0, 16), b.detach(), offsets([0, 0]))
    assert empty.shape == (0, 8)
    no_k = cutlass_ops.grouped_mm(torch.randn(8, 0), torch.randn(0, 8), offsets([0, 0]))
    assert torch.equal(no_k, torch.zeros(2, 8, 8))


def test_routed_rows_skip_the_tail_zeroing_and_keep_the_gradients(monkeypatch):
    """Groups covering every row by construction (an MoE layer's routed pairs): the same
    gradients, without the masking pass over them."""
    a = torch.randn(7, 16, requires_grad=True)
    b = torch.randn(2, 16, 8, requires_grad=True)
    offs = offsets([3, 4])
    grad = torch.randn(7, 8)
    cutlass_ops.grouped_mm(a, b, offs).backward(grad)
    want = (a.grad.clone(), b.grad.clone())
    a.grad = b.grad = None
    masked = []
    monkeypatch.setattr(grouped, "_zero_past", lambda t, *args: masked.append(t) or t)
    grouped.routed_grouped_mm(a, b, offs).backward(grad)
    assert not masked and torch.equal(a.grad, want[0]) and torch.equal(b.grad, want[1])
    grouped.grouped_mm(a, b, offs).backward(grad)
    assert len(masked) == 1  # without the promise the tail is zeroed


def test_eager_calls_skip_the_custom_op_dispatch_and_compiled_ones_take_it(monkeypatch):
    """Plain tensors eagerly: the implementation directly (autograd through a Function), since
    the op's Python dispatch costs a launch's worth of host time; the same values and
    gradients. Under torch.compile the custom op is what the graph holds."""
    a = torch.randn(24, 16, requires_grad=True)
    b = torch.randn(4, 16, 8, requires_grad=True)
    offs = offsets([5, 0, 11, 8])
    grad = torch.randn(24, 8)
    cutlass_ops.grouped_mm(a, b, offs).backward(grad)
    want = (a.grad.clone(), b.grad.clone())
    a.grad = b.grad = None
    dispatched = []
    real = grouped.grouped_mm_op
    monkeypatch.setattr(grouped, "grouped_mm_op", lambda *args: dispatched.append(1) or
                        real(*args))
    out = cutlass_ops.grouped_mm(a, b, offs)
    out.backward(grad)
    assert not dispatched and torch.equal(a.grad, want[0]) and torch.equal(b.grad, want[1])
    torch.compile(cutlass_ops.grouped_mm, fullgraph=True, backend="aot_eager")(
        a.detach(), b.detach(), offs)
    assert dispatched


def test_the_custom_op_passes_opcheck():
    op = torch.ops.cutlass_ops.grouped_mm.default
    for form, (a_shape, b_shape, sizes) in CASES.items():
        a = torch.randn(a_shape, requires_grad=True)
        b = torch.randn(b_shape, requires_grad=True)
        torch.library.opcheck(op, (a, b, offsets(sizes) if sizes else None))


def test_compiles_with_fullgraph_and_matches_eager():
    a = torch.randn(24, 16)
    b = torch.randn(4, 16, 8)
    offs = offsets([5, 0, 11, 8])
    compiled = torch.compile(cutlass_ops.grouped_mm, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(a, b, offs), cutlass_ops.grouped_mm(a, b, offs))


@pytest.mark.parametrize("args, words", [
    (lambda: (torch.randn(8, 16), torch.randn(2, 16, 8), None), "offs is required"),
    (lambda: (torch.randn(2, 8, 16), torch.randn(2, 16, 8), offsets([4, 4])),
     "batched GEMM, without offs"),
    (lambda: (torch.randn(8, 16), torch.randn(2, 12, 8), offsets([4, 4])), "do not multiply"),
    (lambda: (torch.randn(8, 16), torch.randn(3, 16, 8), offsets([4, 4])), "2 groups"),
    (lambda: (torch.randn(8, 16), torch.randn(2, 16, 8), offsets([4, 4]).float()), "int32"),
    (lambda: (torch.randn(8, 16), torch.randn(2, 16, 8).half(), offsets([4, 4])), "one dtype"),
    (lambda: (torch.randn(8), torch.randn(2, 16, 8), offsets([4, 4])), "2-D or 3-D"),
    (lambda: (torch.randn(8, 16), torch.randn(2, 16, 8), offsets([6, -1])), "non-decreasing"),
    (lambda: (torch.randn(8, 16), torch.randn(2, 16, 8), offsets([6, 4])), "within"),
])
def test_bad_input_is_refused_by_name(args, words):
    with pytest.raises(UnsupportedInputError, match=words):
        cutlass_ops.grouped_mm(*args())


def test_out_dtype_is_the_operands_and_int64_offsets_are_taken():
    a, b = torch.randn(8, 16), torch.randn(2, 16, 8)
    with pytest.raises(UnsupportedInputError, match="operands' dtype"):
        cutlass_ops.grouped_mm(a.bfloat16(), b.bfloat16(), offsets([4, 4]), out_dtype=torch.float32)
    torch.testing.assert_close(cutlass_ops.grouped_mm(a, b, offsets([4, 4]).long()),
                               grouped.reference(a, b, offsets([4, 4])))


def test_grouped_kernel_configs_name_round_trip_and_refuse_by_name():
    from cutlass_ops.gemms.grouped.grouped_build import GroupedConfig

    config = GroupedConfig()
    assert config.name == "grouped-bf16-tn-cooperative-t128x256x64-c2x1"
    assert GroupedConfig.from_name(config.name) == config
    assert "GROUPED_LAYOUT_B=1" in config.defines()
    with pytest.raises(ValueError, match="pingpong tiles"):
        GroupedConfig(pingpong=True, tile=(256, 128, 64))
    with pytest.raises(ValueError, match="clusters"):
        GroupedConfig(cluster=(4, 1))
    with pytest.raises(ValueError, match="not a grouped"):
        GroupedConfig.from_name("sm90a-cooperative-t128x256x64")


def test_our_kernel_is_used_only_where_every_group_starts_aligned():
    """TMA needs 16-byte aligned group starts and the offsets stay on the device: the grouped
    extent must not be a unit-stride dimension (then grouped_mm keeps torch._grouped_mm)."""
    from cutlass_ops.gemms.grouped.grouped_runtime import group_starts_aligned

    x, w = torch.randn(64, 32).bfloat16(), torch.randn(4, 48, 32).bfloat16()
    assert group_starts_aligned("2d3d", x, w.transpose(1, 2))  # tokens row-major
    assert not group_starts_aligned("2d3d", x.t().contiguous().t(), w.transpose(1, 2))
    dy = torch.randn(64, 48).bfloat16()
    assert group_starts_aligned("2d2d", x.t(), dy)  # the weight gradient x^T dy
    assert not group_starts_aligned("2d2d", x.t().contiguous(), dy)
    assert not group_starts_aligned("3d2d", torch.randn(4, 8, 32).bfloat16(), torch.randn(32, 64))
    assert group_starts_aligned("3d3d", torch.randn(4, 8, 32), torch.randn(4, 32, 8))


def test_a_grouped_kernel_library_is_looked_up_once_per_process(monkeypatch):
    """The build cache's lookup costs more host time than a launch: ``run`` finds a config's
    library once and keeps it; a failed build is not remembered."""
    from cutlass_ops.gemms.grouped import grouped_runtime
    from cutlass_ops.gemms.grouped.grouped_build import GroupedConfig
    from custom_kernels.core.errors import BuildError

    calls = []

    def build(config):
        calls.append(config)
        if config.tile[1] == 192:
            raise BuildError(config.name, "/nonexistent/build.log", "error: fake")
        return f"/fake/{config.name}.so"

    monkeypatch.setattr(grouped_runtime, "build", build)
    monkeypatch.setattr(grouped_runtime, "_library", lambda path: ("library", path))
    grouped_runtime._loaded.cache_clear()
    good = GroupedConfig("bf16", "t", "t", tile=(128, 256, 64))
    bad = GroupedConfig("bf16", "t", "t", tile=(128, 192, 64))
    assert grouped_runtime._loaded(good) == grouped_runtime._loaded(good)
    for _ in range(2):
        with pytest.raises(BuildError):
            grouped_runtime._loaded(bad)
    assert calls == [good, bad, bad]
    grouped_runtime._loaded.cache_clear()
