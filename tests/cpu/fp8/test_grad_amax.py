"""Amaxes handed from the kernel that wrote a tensor to the FP8 quantization that reads it
(tensorwise, issue 38) on the CPU: ``custom_kernels.fp8.grad_amax.GradAmax`` answers only for the
tensor it recorded, unchanged; SwiGLU's AMAX wiring (a torch stand-in for the kernels) reduces
the amaxes of y and d_gate_up and records the latter; ``fp8_linear`` with ``x_amax`` and
``grad_amax`` gives the bits it gives without them when the amaxes are right, uses them (a wrong
one changes the result: the check can fail), ignores a slot recorded for another tensor, and
refuses an ``x_amax`` a recipe does not take. ``quantize_pair(amax=)`` is the pair of
``quantize(amax=)`` calls."""

import pytest
import torch

from cutlass_ops.fp8.linear import fp8_linear
from custom_kernels import swiglu
from custom_kernels.fp8 import fp8_quant
from custom_kernels.core.errors import UnsupportedInputError
from custom_kernels.fp8.grad_amax import GradAmax

import sys  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/cpu: test_swiglu
from test_swiglu import calls, hf_swiglu  # noqa: E402, F401  (the kernels' torch stand-in)


@pytest.fixture(autouse=True)
def quiet(warnings):
    yield  # the CPU rule's log lines, kept out of the output


def test_the_slot_answers_for_the_recorded_tensor_only():
    slot = GradAmax()
    g = torch.randn(4, 8)
    assert slot.amax_of(g) is None  # nothing written yet
    slot.buffer(g).fill_(g.abs().max())
    slot.record(g)
    assert torch.equal(slot.amax_of(g), g.abs().max())
    assert slot.amax_of(g.clone()) is None  # equal values, another tensor
    g.mul_(2)  # changed in place (a hook): the version counter moved
    assert slot.amax_of(g) is None
    slot.buffer(g)  # a new backward forgets the old record
    assert slot.amax_of(g) is None


def test_the_slot_holds_no_reference_to_the_gradient():
    slot = GradAmax()
    g = torch.randn(4, 8)
    slot.buffer(g)
    slot.record(g)
    del g
    assert slot.amax_of(torch.randn(4, 8)) is None


def test_swiglu_amax_wiring_reduces_both_amaxes(calls):  # noqa: F811
    gate_up = (torch.randn(6, 2 * 16) * 3).requires_grad_()
    amax, slot = torch.zeros(()), GradAmax()
    y = swiglu._EagerSwiGLUAmax.apply(gate_up, amax, slot)
    assert torch.equal(y, hf_swiglu(gate_up.detach()))
    assert torch.equal(amax, y.detach().abs().max())
    dy = torch.randn(6, 16)
    (dgu,) = torch.autograd.grad(y, gate_up, dy)
    assert [c[0] for c in calls] == [False, True]
    assert torch.equal(slot.amax_of(dgu), dgu.abs().max())


def test_swiglu_with_amax_off_a_gpu_is_swiglu_and_no_amax():
    gate_up = torch.randn(5, 2 * 8)
    slot = GradAmax()
    y, amax = swiglu.swiglu_with_amax(gate_up, grad_amax=slot)
    assert amax is None and torch.equal(y, hf_swiglu(gate_up))
    assert slot.amax_of(y) is None
    with pytest.raises(UnsupportedInputError, match="even"):
        swiglu.swiglu_with_amax(torch.randn(5, 7))


def test_quantize_pair_with_amax_is_the_pair_of_quantize_calls():
    x = torch.randn(64, 48, dtype=torch.bfloat16)
    amax = fp8_quant.tensor_amax(x)
    (q, s), (qt, st) = fp8_quant.quantize_pair(x, "tensor", amax=amax)
    for (got_q, got_s), transpose in (((q, s), False), ((qt, st), True)):
        want_q, want_s = fp8_quant.quantize(x, "tensor", transpose=transpose, amax=amax)
        assert torch.equal(got_q.view(torch.uint8), want_q.view(torch.uint8))
        assert torch.equal(got_s, want_s)
    # the amax is what sets the scale: twice the amax, twice the scale
    (_, s2), _ = fp8_quant.quantize_pair(x, "tensor", amax=2 * amax)
    assert torch.equal(s2, 2 * s)
    with pytest.raises(UnsupportedInputError, match="granularity 'tensor'"):
        fp8_quant.quantize_pair(x, "row", amax=amax)


def _train(x, w, dy, **amaxes):
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = fp8_linear(x, [w], None, "tensorwise", **amaxes)
    y.backward(dy)
    return y.detach(), x.grad, w.grad


def _slot_for(dy, amax):
    slot = GradAmax()
    slot.buffer(dy).fill_(amax)
    slot.record(dy)
    return slot


@pytest.mark.parametrize("tokens", [32, 24])  # 24: the wgrad's x^T and dy^T padded
def test_fp8_linear_with_the_amaxes_gives_the_same_bits(tokens):
    torch.manual_seed(0)
    x = torch.randn(tokens, 64, dtype=torch.bfloat16)
    w = torch.randn(48, 64, dtype=torch.bfloat16) / 8
    dy = torch.randn(tokens, 48, dtype=torch.bfloat16)
    plain = _train(x, w, dy)
    given = _train(x, w, dy, x_amax=x.float().abs().max(),
                   grad_amax=_slot_for(dy, dy.float().abs().max()))
    for a, b in zip(plain, given):
        assert torch.equal(a, b)


def test_fp8_linear_uses_the_amaxes_it_is_given():
    """A wrong amax changes the result: the amaxes are read, not ignored (3x, not a power of
    two, which FP8 would represent exactly)."""
    torch.manual_seed(1)
    x = torch.randn(32, 64, dtype=torch.bfloat16)
    w = torch.randn(48, 64, dtype=torch.bfloat16) / 8
    dy = torch.randn(32, 48, dtype=torch.bfloat16)
    plain = _train(x, w, dy)
    wrong_x = _train(x, w, dy, x_amax=x.float().abs().max() * 3)
    assert not torch.equal(wrong_x[0], plain[0])
    wrong_dy = _train(x, w, dy, grad_amax=_slot_for(dy, dy.float().abs().max() * 3))
    assert torch.equal(wrong_dy[0], plain[0]) and not torch.equal(wrong_dy[1], plain[1])
    # a slot recorded for another tensor is not consulted
    other = _train(x, w, dy, grad_amax=_slot_for(dy.clone(), 1e-3))
    for a, b in zip(plain, other):
        assert torch.equal(a, b)


@pytest.mark.parametrize("recipe,amax,match", [
    ("rowwise", torch.tensor(1.0), "tensorwise"),
    ("tensorwise", torch.tensor(1.0, dtype=torch.float64), "float32"),
    ("tensorwise", torch.ones(2), "scalar"),
])
def test_fp8_linear_refuses_an_x_amax_it_cannot_take(recipe, amax, match):
    x = torch.randn(32, 64, dtype=torch.bfloat16)
    w = torch.randn(48, 64, dtype=torch.bfloat16)
    with pytest.raises(UnsupportedInputError, match=match):
        fp8_linear(x, [w], None, recipe, x_amax=amax)
