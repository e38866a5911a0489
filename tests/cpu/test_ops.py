"""The custom ops and modules on a CPU: schema, fake implementations, autograd formulas and
torch.compile tracing (the kernels themselves fall back to torch off the GPU; tests/gpu runs
them for real)."""

import copy
import dataclasses

import pytest
import torch
from torch import nn

import cutlass_ops
from cutlass_ops import ops
from cutlass_ops.nn import Linear


def rand(*shape):
    return torch.randn(*shape, dtype=torch.float64, requires_grad=True)


@pytest.mark.parametrize("op,args", [
    (ops.mm, (rand(8, 16), rand(16, 4))),
    (ops.bmm, (rand(2, 8, 16), rand(2, 16, 4))),
    (ops.linear, (rand(2, 3, 16), rand(4, 16), rand(4))),
    (ops.linear, (rand(5, 16), rand(4, 16), None)),
])
def test_opcheck(op, args):
    torch.library.opcheck(op, args)


def test_autograd_matches_torch():
    x, w, b = rand(3, 5, 16), rand(8, 16), rand(8)
    torch.autograd.gradcheck(lambda x, w, b: ops.linear(x, w, b), (x, w, b))
    torch.autograd.gradcheck(lambda a, b: ops.mm(a, b), (rand(4, 6), rand(6, 3)))


def test_eager_fast_path_matches_the_op():
    x, w, b = rand(3, 5, 16), rand(8, 16), rand(8)
    torch.autograd.gradcheck(lambda x, w, b: ops.linear_fast(x, w, b), (x, w, b))
    with torch.no_grad():
        torch.testing.assert_close(ops.linear_fast(x, w, b), ops.linear(x, w, b))
    layer = Linear(16, 8)
    y = layer(torch.randn(2, 16, requires_grad=True))
    assert y.grad_fn is not None and "_EagerLinear" in type(y.grad_fn).__name__


def test_bad_shapes_raise():
    with pytest.raises(ValueError, match="does not match"):
        ops.linear(torch.randn(2, 16), torch.randn(4, 15))
    with pytest.raises(ValueError, match="2-D"):
        ops.mm(torch.randn(2, 3, 4), torch.randn(4, 5))
    with pytest.raises(ValueError, match="does not match"), torch.no_grad():
        ops.linear_fast(torch.randn(2, 16), torch.randn(4, 15))
    with pytest.raises(ValueError, match="does not match"):  # the autograd path checks too
        ops.linear_fast(torch.randn(2, 16, requires_grad=True), torch.randn(4, 15))
    with pytest.raises(ValueError, match="3-D"):
        ops.bmm(torch.randn(2, 3), torch.randn(3, 4))


def test_compiles_without_graph_breaks():
    layer = Linear(16, 8)
    x = torch.randn(4, 16)
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(x), nn.functional.linear(x, layer.weight, layer.bias))


def test_linear_state_dict_is_torch_s():
    theirs = nn.Linear(16, 8)
    ours = Linear(16, 8)
    ours.load_state_dict(theirs.state_dict())
    again = nn.Linear(16, 8)
    again.load_state_dict(ours.state_dict())
    torch.testing.assert_close(again.weight, theirs.weight)
    shared = Linear.from_linear(theirs)
    assert shared.weight is theirs.weight and shared.bias is theirs.bias
    x = torch.randn(3, 16)
    torch.testing.assert_close(shared(x), theirs(x))


def test_convert_reports_why_layers_stay():
    class Custom(nn.Linear):
        pass

    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), Custom(32, 8))
    before = copy.deepcopy(model)
    report = cutlass_ops.convert(model)
    assert report.converted == []
    assert "move the model to a CUDA device" in report.skipped["0"]
    assert "subclasses Linear" in report.skipped["2"]
    assert "converted 0 of 2" in str(report)
    assert type(model[0]) is nn.Linear  # nothing swapped
    x = torch.randn(2, 16)
    torch.testing.assert_close(model(x), before(x))
    assert cutlass_ops.nn.Linear is Linear  # lazy attribute


ACTIVATIONS = ["identity", "relu", "gelu", "gelu_tanh", "silu"]


def torch_linear_act(x, w, b, activation):
    y = nn.functional.linear(x, w, b)
    return {"identity": lambda y: y, "relu": torch.relu, "silu": nn.functional.silu,
            "gelu": nn.functional.gelu,
            "gelu_tanh": lambda y: nn.functional.gelu(y, approximate="tanh")}[activation](y)


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_linear_with_activation_matches_torch(activation):
    x, w, b = rand(3, 5, 16), rand(8, 16), rand(8)
    torch.library.opcheck(ops.linear, (x, w, b, activation))
    # The op's own formula (recomputes z) and the eager path (keeps z) both differentiate right.
    torch.autograd.gradcheck(lambda x, w, b: ops.linear(x, w, b, activation), (x, w, b))
    torch.autograd.gradcheck(lambda x, w, b: ops.linear_fast(x, w, b, activation), (x, w, b))
    with torch.no_grad():
        torch.testing.assert_close(ops.linear_fast(x, w, b, activation),
                                   torch_linear_act(x, w, b, activation))


def test_unknown_activation_raises():
    with pytest.raises(ValueError, match="tanh"), torch.no_grad():
        ops.linear_fast(torch.randn(2, 16), torch.randn(4, 16), None, "tanh")
    with pytest.raises(ValueError):
        Linear(16, 8, activation="tanh")


def test_fused_linear_module_compiles_and_keeps_torch_state_dict():
    layer = Linear(16, 8, activation="gelu_tanh")
    assert "activation=gelu_tanh" in repr(layer)
    assert set(layer.state_dict()) == {"weight", "bias"}
    x = torch.randn(4, 16, requires_grad=True)
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    expected = torch_linear_act(x, layer.weight, layer.bias, "gelu_tanh")
    torch.testing.assert_close(compiled(x), expected)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), expected)


def test_convert_fuses_activations_that_follow_in_sequential(monkeypatch):
    monkeypatch.setattr(cutlass_ops.nn, "_why_not", lambda layer: None)  # as on an sm90 GPU
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(approximate="tanh"), nn.Linear(32, 32),
                          nn.Dropout(0.0), nn.ReLU(), nn.Linear(32, 8), nn.SiLU())
    before = copy.deepcopy(model)
    report = cutlass_ops.convert(model)
    assert report.converted == ["0", "2", "5"]
    assert [getattr(model[i], "activation", None) for i in (0, 2, 5)] == \
        ["gelu_tanh", "identity", "silu"]
    assert isinstance(model[1], nn.Identity) and isinstance(model[6], nn.Identity)
    assert isinstance(model[4], nn.ReLU)  # after a Dropout: not directly after the Linear
    assert "fused as gelu_tanh" in report.decisions[0].reason
    x = torch.randn(3, 16)
    torch.testing.assert_close(model(x), before(x))
    plain = copy.deepcopy(before)
    cutlass_ops.convert(plain, fuse_activations=False)
    assert isinstance(plain[1], nn.GELU) and plain[0].activation == "identity"
    configured = copy.deepcopy(before)  # the same option as a ConvertConfig
    cutlass_ops.convert(configured, cutlass_ops.nn.ConvertConfig(fuse_activations=False))
    assert isinstance(configured[1], nn.GELU) and configured[0].activation == "identity"


def test_convert_takes_a_config_or_keywords_and_refuses_unknown_options():
    model = nn.Sequential(nn.Linear(16, 8))
    config = cutlass_ops.nn.ConvertConfig(norms=False, exclude=("0",))
    assert cutlass_ops.convert(model, config).skipped["0"] == "excluded by the caller"
    with pytest.raises(TypeError, match="not both"):
        cutlass_ops.convert(model, config, norms=True)
    with pytest.raises(TypeError, match="fused_norms"):
        cutlass_ops.convert(model, fused_norms=False)
    with pytest.raises(ValueError, match="float16"):  # an unknown recipe, before any swap
        cutlass_ops.convert(model, fp8="float16")
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.norms = True


def test_convert_swaps_norms_where_the_kernels_apply(monkeypatch):
    model = nn.Sequential(nn.LayerNorm(16), nn.RMSNorm(16), nn.LayerNorm(16, bias=False),
                          nn.LayerNorm((4, 4)))
    report = cutlass_ops.convert(model)
    assert "move the model to a CUDA device" in report.skipped["0"]
    assert "without bias" in report.skipped["2"] and "multi-dimensional" in report.skipped["3"]
    monkeypatch.setattr(torch.Tensor, "device", property(lambda t: torch.device("cuda", 0)))
    report = cutlass_ops.convert(model, norms=True)
    assert report.converted == ["0", "1"]
    assert type(model[0]) is cutlass_ops.nn.LayerNorm and type(model[1]) is cutlass_ops.nn.RMSNorm
    assert model[0].weight is not None and set(model[0].state_dict()) == {"weight", "bias"}
