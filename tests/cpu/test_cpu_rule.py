"""The CPU rule of every public entry point (``custom_kernels.core.fallback``): entry points that
choose their kernel compute torch's result for CPU tensors (logging once per reason), entry points
that name a kernel raise UnsupportedInputError naming the device, and tensors on different
devices raise everywhere."""

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import cutlass_ops
import cutlass_ops.gemms.dispatch
import custom_kernels
from custom_kernels.core.errors import UnsupportedInputError
from custom_kernels.norms import norm_ops as norms


def bf16(*shape):
    return torch.randn(*shape).to(torch.bfloat16)


# ---- entry points that choose their kernel: torch's result --------------------------------------

def test_matmul_and_explain(warnings):
    a, b, bias, res = bf16(8, 16), bf16(16, 24), bf16(24), bf16(8, 24)
    for _ in range(3):
        torch.testing.assert_close(cutlass_ops.matmul(a, b), a @ b)
        got = cutlass_ops.matmul(a, b, bias=bias, activation="gelu_tanh", residual=res,
                                 alpha=0.5, beta=2.0)
    want = F.gelu(0.5 * (a @ b) + bias, approximate="tanh") + 2.0 * res
    torch.testing.assert_close(got, want)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(cutlass_ops.matmul(a, b, out_dtype=torch.float32),
                               a.float() @ b.float())
    decision = cutlass_ops.explain(a, b)
    assert decision.source == "torch" and decision.choice is None and "cpu" in decision.reason
    assert warnings() == ["cutlass_ops.matmul uses torch.matmul: the tensors are on cpu, not a "
                          "CUDA device"]


@pytest.mark.parametrize("activation", ["identity", "silu"])
def test_nn_linear_forward_and_backward(warnings, activation):
    torch.manual_seed(0)
    ref = nn.Linear(16, 8)
    ours = cutlass_ops.nn.Linear.from_linear(copy.deepcopy(ref), activation=activation)
    act = nn.SiLU() if activation == "silu" else nn.Identity()
    x = torch.randn(3, 5, 16, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    y, y_ref = ours(x), act(ref(x_ref))
    torch.testing.assert_close(y, y_ref)
    y.square().sum().backward()
    y_ref.square().sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad)
    torch.testing.assert_close(ours.weight.grad, ref.weight.grad)
    torch.testing.assert_close(ours.bias.grad, ref.bias.grad)
    assert any("not a CUDA device" in line for line in warnings())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nn_norms_with_and_without_residual(warnings, dtype):
    torch.manual_seed(0)
    x, res = torch.randn(4, 64).to(dtype), torch.randn(4, 64).to(dtype)
    for theirs in (nn.RMSNorm(64, eps=1e-6, dtype=dtype), nn.LayerNorm(64, dtype=dtype)):
        with torch.no_grad():
            theirs.weight.uniform_(0.5, 1.5)
        ours_type = (cutlass_ops.nn.LayerNorm if isinstance(theirs, nn.LayerNorm)
                     else cutlass_ops.nn.RMSNorm)
        ours = ours_type.from_module(theirs)
        for _ in range(2):
            torch.testing.assert_close(ours(x), theirs(x))
            y, h = ours(x, res)
        torch.testing.assert_close(h, x + res)
        torch.testing.assert_close(y, theirs(x + res))
    assert warnings() == [
        "cutlass_ops.nn.RMSNorm uses torch.nn.RMSNorm: rms_norm: the tensors are on cpu, not a "
        "CUDA device",
        "cutlass_ops.nn.LayerNorm uses torch.nn.LayerNorm: layer_norm: the tensors are on cpu, "
        "not a CUDA device"]


def test_converted_model(monkeypatch, warnings):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.RMSNorm(32), nn.Linear(32, 8),
                          nn.LayerNorm(8))
    before = copy.deepcopy(model)
    # Convert as on an sm90 GPU (Linear layers, then norms), then run the model on the CPU.
    monkeypatch.setattr(cutlass_ops.nn, "_why_not", lambda layer: None)
    assert cutlass_ops.convert(model, norms=False).converted == ["0", "3"]
    with monkeypatch.context() as m:
        m.setattr(torch.Tensor, "device", property(lambda t: torch.device("cuda", 0)))
        assert cutlass_ops.convert(model).converted == ["2", "4"]
    assert model[0].activation == "gelu" and isinstance(model[1], nn.Identity)
    assert type(model[0]) is cutlass_ops.nn.Linear and type(model[2]) is cutlass_ops.nn.RMSNorm
    x = torch.randn(5, 16, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    y, y_ref = model(x), before(x_ref)
    torch.testing.assert_close(y, y_ref)
    y.sum().backward()
    y_ref.sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad)
    assert warnings()


@pytest.mark.parametrize("kind", ["rms", "ln"])
@pytest.mark.parametrize("residual", [False, True])
def test_norm_functions_run_the_reference(warnings, kind, residual):
    torch.manual_seed(0)
    x, w, b = torch.randn(3, 5, 64).to(torch.bfloat16), torch.rand(64) + 0.5, torch.randn(64)
    res = torch.randn(3, 5, 64).to(torch.bfloat16) if residual else None
    if kind == "rms":
        got = norms.rms_norm(x, w, 1e-6, residual=res, out_dtype=torch.float32)
        want = norms.rms_norm_reference(x, w, 1e-6, residual=res, out_dtype=torch.float32)
    else:
        got = norms.layer_norm(x, w, b, 1e-5, residual=res, out_dtype=torch.float32)
        want = norms.layer_norm_reference(x, w, b, 1e-5, residual=res, out_dtype=torch.float32)
    torch.testing.assert_close(got, want)
    y = got[0] if residual else got
    assert y.dtype == torch.float32
    if residual:
        assert got[1].dtype == torch.bfloat16
    assert len(warnings()) == 1


def test_norm_functions_differentiate_like_torch():
    torch.manual_seed(0)
    x, w, b = (torch.randn(4, 32, requires_grad=True),
               torch.rand(32, requires_grad=True),
               torch.randn(32, requires_grad=True))
    y = norms.layer_norm(x, w, b, 1e-5)
    grads = torch.autograd.grad(y.square().sum(), (x, w, b))
    want = torch.autograd.grad(F.layer_norm(x, (32,), w, b, 1e-5).square().sum(), (x, w, b))
    for got, expected in zip(grads, want):
        torch.testing.assert_close(got, expected)
    y = norms.rms_norm(x, w, 1e-6)
    (gx,) = torch.autograd.grad(y.sum(), x)
    (want_x,) = torch.autograd.grad(F.rms_norm(x, (32,), w, 1e-6).sum(), x)
    torch.testing.assert_close(gx, want_x)


def test_norms_compile_without_graph_breaks_on_cpu():
    """The fallback's warning must not break torch.compile(fullgraph=True) tracing."""
    x, res = torch.randn(4, 64), torch.randn(4, 64)
    for module in (cutlass_ops.nn.RMSNorm(64), cutlass_ops.nn.LayerNorm(64)):
        compiled = torch.compile(module, fullgraph=True, backend="eager")
        torch.testing.assert_close(compiled(x, res), module(x, res))
    compiled = torch.compile(norms.rms_norm, fullgraph=True, backend="eager")
    weight = torch.rand(64)
    torch.testing.assert_close(compiled(x, weight), norms.rms_norm_reference(x, weight))


def test_segment_reductions(warnings):
    values = torch.randn(50, 3, 4).to(torch.bfloat16)
    offsets = torch.tensor([0, 10, 10, 45, 50], dtype=torch.int32)
    for fn, mean in ((custom_kernels.segment_sum, False), (custom_kernels.segment_mean, True)):
        got = fn(values, offsets)
        assert got.dtype == torch.bfloat16 and got.shape == (4, 3, 4)
        want = custom_kernels.ragged.reference_segment_sum(values, offsets, mean)
        torch.testing.assert_close(got.double(), want, rtol=1e-2, atol=1e-2)
    assert len(warnings()) == 1


@pytest.mark.parametrize("norm_type", [2.0, math.inf])
def test_clip_grad_norm(warnings, norm_type):
    torch.manual_seed(0)
    ours = [nn.Parameter(torch.empty(n)) for n in (10, 300)]
    for p in ours:
        p.grad = torch.randn(p.shape) * 3
    theirs = copy.deepcopy(ours)
    for p, q in zip(ours, theirs):
        q.grad = p.grad.clone()
    got = custom_kernels.clip_grad_norm_(ours, 1.0, norm_type)
    torch.testing.assert_close(got, torch.nn.utils.clip_grad_norm_(theirs, 1.0, norm_type))
    for p, q in zip(ours, theirs):
        torch.testing.assert_close(p.grad, q.grad)
    assert warnings() == ["clip_grad_norm_ uses torch.nn.utils.clip_grad_norm_: the gradients "
                          "are on cpu, not a CUDA device"]


# ---- entry points that name a kernel: UnsupportedInputError naming the device -----------------

@pytest.mark.parametrize("entry", ["gemm", "plan"])
def test_gemm_and_plan_with_a_config_refuse_cpu_tensors(entry):
    a = bf16(64, 64)
    with pytest.raises(UnsupportedInputError, match="tensors are on cpu; a CUDA kernel needs"):
        getattr(cutlass_ops, entry)(a, a, config=cutlass_ops.GemmConfig())


def test_norm_functions_with_a_config_refuse_cpu_tensors():
    x, w = bf16(4, 64), bf16(64)
    with pytest.raises(UnsupportedInputError, match="on cpu, not a CUDA device"):
        norms.rms_norm(x, w, config="t128_r1_c1_v8")
    with pytest.raises(UnsupportedInputError, match="on cpu, not a CUDA device"):
        norms.layer_norm(x, w, w, config="t128_r1_c1_v8")


@pytest.mark.parametrize("entry", ["launch_cooperative", "launch_persistent"])
def test_kernel_launchers_refuse_cpu_tensors(entry):
    size = {"grid": 1} if entry == "launch_cooperative" else {"tasks": 1}
    try:
        getattr(custom_kernels, entry)(object(), torch.ones(4), block=32, device=0, **size)
    except UnsupportedInputError as exc:
        assert "cpu" in str(exc)
    except Exception as exc:  # noqa: BLE001 - anything else breaks the rule
        raise AssertionError(f"{entry} raised {type(exc).__name__}: {exc}") from exc


# ---- tensors on different devices raise everywhere ---------------------------------------------

def test_mixed_devices_raise():
    cpu, meta = bf16(64, 64), torch.empty(64, 64, dtype=torch.bfloat16, device="meta")
    with pytest.raises(UnsupportedInputError, match="different devices"):
        cutlass_ops.matmul(cpu, meta)
    with pytest.raises(UnsupportedInputError, match="different devices"):
        cutlass_ops.matmul(cpu, cpu, bias=meta[0])
    with pytest.raises(UnsupportedInputError, match="different devices"):
        cutlass_ops.gemm(cpu, meta, config=cutlass_ops.GemmConfig())
    with pytest.raises(UnsupportedInputError, match="different devices"):
        norms.rms_norm(cpu, meta[0])
    with pytest.raises(UnsupportedInputError, match="different devices"):
        cutlass_ops.nn.RMSNorm(64, dtype=torch.bfloat16)(cpu, meta)
    with pytest.raises(UnsupportedInputError, match="offsets on meta"):
        custom_kernels.segment_sum(cpu, torch.tensor([0, 64], device="meta"))
