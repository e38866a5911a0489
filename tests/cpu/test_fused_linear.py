"""cutlass_ops.fused_linear on the CPU (torch behind dispatch): merged projections and the
residual epilogue against separate nn.Linear calls, forward and backward, eagerly and compiled;
packing keeps Parameters and values; the backward keeps no copy of the weights; the kept view
follows moved weights; opcheck."""

import pytest
import torch

from cutlass_ops import fused_linear


def _layers(bias=True, widths=(8, 4, 4)):
    torch.manual_seed(0)
    return [torch.nn.Linear(16, n, bias=bias) for n in widths]


@pytest.mark.parametrize("packed", [True, False])
@pytest.mark.parametrize("bias", [True, False])
def test_merged_linear_matches_separate_layers(packed, bias):
    layers = _layers(bias)
    if packed:
        fused_linear.pack(layers)
    assert fused_linear.is_packed(layers) == packed
    x = torch.randn(2, 3, 16, requires_grad=True)
    y = fused_linear.merged_linear(x, [l.weight for l in layers], fused_linear.merged_bias(layers))
    expected = torch.cat([l(x) for l in layers], -1)
    torch.testing.assert_close(y, expected)
    grad = torch.randn_like(y)
    mine = torch.autograd.grad(y, [x, *(p for l in layers for p in l.parameters())], grad)
    theirs = torch.autograd.grad(expected, [x, *(p for l in layers for p in l.parameters())],
                                 grad)
    for a, b in zip(mine, theirs):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("packed", [True, False])
def test_the_grad_x_reduction_runs_between_the_two_gradient_gemms(monkeypatch, packed):
    """Tensor parallelism's all-reduce of dX starts right after dX's GEMM and is waited for
    after dW's (so that it overlaps dW's GEMM); what it does to dX in place is the gradient x
    gets. Here it doubles dX, and the order of events is recorded."""
    from cutlass_ops.gemms import dispatch

    layers = _layers(bias=False)
    if packed:
        fused_linear.pack(layers)
    weights = [layer.weight for layer in layers]
    events, real = [], dispatch.matmul
    monkeypatch.setattr(dispatch, "matmul",
                        lambda a, b, **kw: events.append(tuple(a.shape)) or real(a, b, **kw))

    class Pending:
        def wait(self):
            events.append("wait")

    def reduction(grad_x):
        events.append("start")
        grad_x.mul_(2)
        return Pending()

    x = torch.randn(2, 3, 16, requires_grad=True)
    y = fused_linear.merged_linear(x, weights, grad_x_reduction=reduction)
    grad = torch.randn_like(y)
    events.clear()
    got = torch.autograd.grad(y, [x, *weights], grad)
    expected = torch.autograd.grad(torch.cat([x @ w.t() for w in weights], -1), [x, *weights],
                                   grad)
    torch.testing.assert_close(got[0], 2 * expected[0])
    for a, b in zip(got[1:], expected[1:]):
        torch.testing.assert_close(a, b)
    # dX's GEMM (dispatch's when packed; unpacked weights' sum of torch.mm), then dW's
    assert events == ([(6, 16)] if packed else []) + ["start", (16, 6), "wait"], events


def test_a_grad_x_reduction_outside_eager_autograd_is_refused():
    from torch.distributed.tensor import DeviceMesh  # noqa: F401  (DTensor importable)

    class Wrapped(torch.Tensor):  # any tensor subclass takes the registered op
        pass

    x = torch.randn(3, 16).as_subclass(Wrapped)
    with pytest.raises(ValueError, match="grad_x_reduction"):
        fused_linear.merged_linear(x, [l.weight for l in _layers()],
                                   grad_x_reduction=lambda g: None)
    assert not fused_linear.uses_eager_autograd(x)
    assert fused_linear.uses_eager_autograd(torch.randn(3, 16), None)


@pytest.mark.parametrize("packed", [True, False])
def test_the_backward_keeps_no_copy_of_the_weights(packed):
    """Autograd keeps the weights (or their packed view), never a merged copy: a kept copy
    would hold every layer's merged weights from its forward to its backward (FSDP2 frees its
    gathered weights after each layer's forward)."""
    layers = _layers()
    if packed:
        fused_linear.pack(layers)
    weights = [layer.weight for layer in layers]
    x = torch.randn(3, 16, requires_grad=True)
    storages = {t.untyped_storage().data_ptr() for t in (x, *weights)}
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = fused_linear.merged_linear(x, weights)
    assert saved and all(t.untyped_storage().data_ptr() in storages for t in saved)
    y.sum().backward()
    assert x.grad is not None and all(w.grad is not None for w in weights)


@pytest.mark.parametrize("grad", [True, False])
@pytest.mark.parametrize("bias", [True, False])
def test_unpacked_weights_are_never_concatenated(monkeypatch, grad, bias):
    """FSDP2's gathered weights are separate tensors: each weight's GEMM writes its columns of
    the output in place, and dX sums the weights' GEMMs, so no pass copies the weights (a
    concatenation copied 272 MB of a Llama-3-8B layer each way). Same values as the layers."""
    layers = _layers(bias, widths=(8, 4, 12))
    assert not fused_linear.is_packed(layers)
    x = torch.randn(2, 5, 16, requires_grad=grad)
    expected = torch.cat([l(x) for l in layers], -1)
    params = [p for l in layers for p in l.parameters()]
    theirs = torch.autograd.grad(expected, [x, *params], torch.ones_like(expected)) \
        if grad else None

    def no_cat(*args, **kwargs):
        raise AssertionError("the weights were concatenated")

    with torch.set_grad_enabled(grad):
        merged_bias = fused_linear.merged_bias(layers)  # (the biases are concatenated: small)
        monkeypatch.setattr(torch, "cat", no_cat)
        y = fused_linear.merged_linear(x, [l.weight for l in layers], merged_bias)
        torch.testing.assert_close(y, expected.detach())
        if grad:
            mine = torch.autograd.grad(y, [x, *params], torch.ones_like(y))
            for a, b in zip(mine, theirs):
                torch.testing.assert_close(a, b)


def test_pack_keeps_parameters_and_values():
    layers = _layers()
    params = [p for l in layers for p in l.parameters()]
    values = [p.detach().clone() for p in params]
    fused_linear.pack(layers)
    assert [p for l in layers for p in l.parameters()] == params
    assert all(torch.equal(p, v) for p, v in zip(params, values))
    view = fused_linear.merged_view([l.weight for l in layers])
    assert view.shape == (16, 16) and view.data_ptr() == layers[0].weight.data_ptr()


def test_the_kept_view_follows_replaced_weights():
    layers = _layers()
    fused_linear.pack(layers)
    kept = fused_linear.MergedView()
    first = kept([l.weight for l in layers])
    assert kept([l.weight for l in layers]) is first
    layers[1].weight.data = layers[1].weight.data.clone()  # no longer packed
    assert kept([l.weight for l in layers]) is None
    x = torch.randn(4, 16)
    y = fused_linear.merged_linear(x, [l.weight for l in layers], None, kept)
    torch.testing.assert_close(y, torch.cat([x @ l.weight.t() for l in layers], -1))


def test_linear_residual_matches_linear_plus_residual():
    layer = _layers(widths=(8,))[0]
    x = torch.randn(5, 16, requires_grad=True)
    r = torch.randn(5, 8, requires_grad=True)
    y = fused_linear.linear_residual(x, layer.weight, layer.bias, r)
    expected = layer(x) + r
    torch.testing.assert_close(y, expected)
    grad = torch.randn_like(y)
    inputs = [x, r, layer.weight, layer.bias]
    for a, b in zip(torch.autograd.grad(y, inputs, grad), torch.autograd.grad(expected, inputs,
                                                                             grad)):
        torch.testing.assert_close(a, b)


def test_compiled_paths_match():
    layers = _layers()
    fused_linear.pack(layers)
    x = torch.randn(3, 16, requires_grad=True)
    r = torch.randn(3, 8)

    def f(x):
        y = fused_linear.merged_linear(x, [l.weight for l in layers],
                                       fused_linear.merged_bias(layers))
        return fused_linear.linear_residual(y, layers[0].weight, layers[0].bias, r)

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(x), f(x))
    compiled(x).sum().backward()
    assert x.grad is not None and layers[2].weight.grad is not None


def test_opcheck():
    layers = _layers()
    x = torch.randn(3, 16, requires_grad=True)
    weights = [l.weight for l in layers]
    torch.library.opcheck(fused_linear.merged_linear_op, (x, weights, None))
    torch.library.opcheck(fused_linear.linear_residual_op,
                          (x, layers[0].weight, layers[0].bias, torch.randn(3, 8)))
