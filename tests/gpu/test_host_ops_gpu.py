"""The compiled host path's launches (custom_kernels.host_ops, marker gpu): the first call of a
signature runs the Python path and records its plan; the next runs in C++ (proved by making the
Python launcher fail) and equals it bit for bit, forward and backward, for both norms, with and
without a residual, on the direct, persistent and cluster kernels; inside a CUDA graph; and the
calls it must not take (strided inputs, another output dtype, a config override) still run on
the Python path, correctly."""

import threading

import pytest
import torch

from custom_kernels import host_ops
from custom_kernels.core.errors import UnsupportedInputError
from custom_kernels.norms import modules
from custom_kernels.norms import norm_ops as norms

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def host():
    loaded = host_ops.ops(wait=True)
    assert loaded is not None, host_ops.why_not()
    assert loaded.driver_status() == "ok"
    return loaded


@pytest.fixture
def python_launch_forbidden(monkeypatch):
    """Calling this fixture's result makes the Python launcher raise: a call that still succeeds
    ran in C++."""
    def forbid():
        def refuse(*args, **kwargs):
            raise AssertionError("the Python launcher ran")
        monkeypatch.setattr(norms, "_launch_fwd", refuse)
    return forbid


def _inputs(rows, hidden, dtype, residual, layer, grad=False):
    kw = {"device": "cuda", "dtype": dtype}
    x = torch.randn(rows, hidden, **kw).requires_grad_(grad)
    w = (1 + 0.1 * torch.randn(hidden, **kw)).requires_grad_(grad)
    b = torch.randn(hidden, **kw).requires_grad_(grad) if layer else None
    r = torch.randn(rows, hidden, **kw).requires_grad_(grad) if residual else None
    return x, w, b, r


def _call(layer, x, w, b, r):
    if layer:
        return norms.layer_norm(x, w, b, 1e-5, residual=r)
    return norms.rms_norm(x, w, 1e-6, residual=r)


def _flat(out):
    return out if isinstance(out, tuple) else (out,)


# hidden 4096: the direct kernel; 32768: staged (persistent); 262144: a cluster of blocks
@pytest.mark.parametrize("hidden", [4096, 32768, 262144])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("layer", [False, True])
def test_the_second_call_runs_in_cpp_and_equals_the_first(host, python_launch_forbidden, hidden,
                                                          dtype, residual, layer):
    x, w, b, r = _inputs(64, hidden, dtype, residual, layer)
    first = _flat(_call(layer, x, w, b, r))
    python_launch_forbidden()
    second = _flat(_call(layer, x, w, b, r))
    for a, c in zip(first, second):
        assert a.dtype == c.dtype and a.shape == c.shape
        assert torch.equal(a, c)


@pytest.mark.parametrize("hidden", [4096, 262144])
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("layer", [False, True])
def test_gradients_through_the_cpp_node_equal_the_python_path(host, python_launch_forbidden,
                                                              hidden, residual, layer):
    """The backward of the C++ node runs the same custom ops as the Python autograd.Function, so
    every gradient is equal bit for bit; run on the autograd engine's own thread."""
    x, w, b, r = _inputs(32, hidden, torch.bfloat16, residual, layer, grad=True)
    out = _flat(_call(layer, x, w, b, r))  # Python path: records the plan
    dys = [torch.randn_like(o) for o in out]
    torch.autograd.backward(out, dys)
    leaves = [t for t in (x, w, b, r) if t is not None]
    expected = [t.grad.clone() for t in leaves]
    for t in leaves:
        t.grad = None
    python_launch_forbidden()
    out2 = _flat(_call(layer, x, w, b, r))
    assert out2[0].grad_fn is not None and "CutlassOpsNormBackward" in out2[0].grad_fn.name()
    torch.autograd.backward(out2, dys)
    for t, e in zip(leaves, expected):
        assert torch.equal(t.grad, e)


def test_the_modules_take_it_too(host, python_launch_forbidden):
    x = torch.randn(16, 4096, device="cuda", dtype=torch.bfloat16)
    rms = modules.RMSNorm(4096, eps=1e-6, device="cuda", dtype=torch.bfloat16)
    ln = modules.LayerNorm(4096, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        first = rms(x), ln(x)
    python_launch_forbidden()
    with torch.no_grad():
        assert torch.equal(rms(x), first[0]) and torch.equal(ln(x), first[1])
    with torch.inference_mode():
        assert torch.equal(rms(x), first[0])


def test_inside_a_cuda_graph(host):
    x = torch.randn(16, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(4096, device="cuda", dtype=torch.bfloat16)
    expected = norms.rms_norm(x, w)  # records
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        norms.rms_norm(x, w)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = norms.rms_norm(x, w)
    x.copy_(torch.randn_like(x))
    graph.replay()
    assert torch.equal(y, norms.rms_norm(x, w))
    assert not torch.equal(y, expected)


def test_a_call_on_another_thread_binds_its_context(host):
    """A thread whose first CUDA work is ours has no current driver context: the C++ path binds
    the primary context, as the Python launcher does."""
    x = torch.randn(8, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.ones(4096, device="cuda", dtype=torch.bfloat16)
    expected = norms.rms_norm(x, w)
    found = {}

    def work():
        found["y"] = norms.rms_norm(x, w)
        torch.cuda.synchronize()

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    assert torch.equal(found["y"], expected)


def test_calls_outside_its_rule_run_on_the_python_path(host):
    """Rows that are not contiguous (a column slice), another output dtype: the C++ op declines
    them and the Python path runs them, correctly; a call the Python rule refuses is refused by
    name, the recorded signature notwithstanding."""
    wide = torch.randn(64, 8192, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(4096, device="cuda", dtype=torch.bfloat16)
    rows = wide[:, :4096]  # unit last stride, row stride 8192
    norms.rms_norm(rows.contiguous(), w)  # a record for the contiguous signature
    ref = norms.rms_norm_reference(rows, w)
    torch.testing.assert_close(norms.rms_norm(rows, w), ref.to(torch.bfloat16), atol=2e-2,
                               rtol=2e-2)
    out = norms.rms_norm(rows.contiguous(), w, out_dtype=torch.float32)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, ref.float(), atol=2e-2, rtol=2e-2)
    with pytest.raises(UnsupportedInputError, match="non-contiguous last dimension"):
        norms.rms_norm(wide[:, ::2], w)


@pytest.fixture
def online_compile():
    """Dispatch builds the heuristic CUTLASS kernel of an untuned shape (about a minute)."""
    from cutlass_ops.gemms import dispatch
    from tuning.online import ONLINE

    dispatch.register_online_tuner(ONLINE)
    dispatch.set_online("compile")
    yield dispatch
    dispatch.set_online(None)
    dispatch.reset()


def _replayed_with_new_input(call, x):
    """``call()`` captured in a CUDA graph, ``x`` refilled with new values, the graph replayed:
    the captured output."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = call()
    x.copy_(torch.randn_like(x))
    graph.replay()
    return y


def test_a_plain_product_runs_in_cpp_once_its_route_is_prepared(host, online_compile,
                                                                  monkeypatch):
    import cutlass_ops
    import cutlass_ops.nn

    dispatch = online_compile
    x = torch.randn(16, 256, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(256, 256, device="cuda", dtype=torch.bfloat16)
    layer = cutlass_ops.nn.Linear(256, 256, bias=False, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        layer.weight.copy_(weight)
        assert cutlass_ops.explain(x, weight.t()).source != "torch"
        before = host.record_count()
        first = cutlass_ops.matmul(x, weight.t())  # the Python route: prepares and records
        first_layer = layer(x)
        assert host.record_count() == before + 1  # one signature: the layer's is the same

        def refuse(*args, **kwargs):
            raise AssertionError("the Python route ran")
        monkeypatch.setattr(dispatch, "route", refuse)
        counted = dispatch.call_counts()
        assert torch.equal(cutlass_ops.matmul(x, weight.t()), first)
        now = dispatch.call_counts()  # counted as what it ran: the CUTLASS kernel
        assert (now["torch"], now["cutlass"]) == (counted["torch"], counted["cutlass"] + 1)
        assert torch.equal(layer(x), first_layer)
        # CUDA graphs capture the C++ launch like any other
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            cutlass_ops.matmul(x, weight.t())
        torch.cuda.current_stream().wait_stream(stream)
        y = _replayed_with_new_input(lambda: cutlass_ops.matmul(x, weight.t()), x)
        assert torch.equal(y, cutlass_ops.matmul(x, weight.t()))
        torch.testing.assert_close(y.float(), x.float() @ weight.t().float(), atol=0.5,
                                   rtol=2e-2)
    monkeypatch.undo()
    # A gradient wanted, another dtype of output, another shape: the Python route, correct.
    a = torch.randn(16, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    assert host.gemm(a, weight.t()) is None
    with torch.no_grad():
        out = cutlass_ops.matmul(x, weight.t(), out_dtype=torch.float32)
        assert out.dtype == torch.float32
        torch.testing.assert_close(out, x.float() @ weight.t().float(), atol=0.5, rtol=2e-2)
    dispatch.reset()
    assert host.record_count() == 0  # reset forgets the routes, the compiled path's too


def test_an_eager_only_product_runs_its_kernel_eagerly_and_torch_inside_a_graph(
        host, online_compile, monkeypatch):
    """An eager-only decision (GemmEntry.eager_prefers_kernel: torch's kernel faster, the
    winner's whole eager call too): eager calls take the C++ record and run the kernel; under
    stream capture the op declines the record, and the Python route captures torch.matmul."""
    import dataclasses

    import cutlass_ops

    dispatch = online_compile
    decided = dispatch.decide
    monkeypatch.setattr(dispatch, "decide", lambda *args, **kwargs: dataclasses.replace(
        decided(*args, **kwargs), eager_only=True))
    x = torch.randn(16, 256, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(256, 256, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        assert cutlass_ops.explain(x, weight.t()).eager_only
        before = host.record_count()
        first = cutlass_ops.matmul(x, weight.t())  # the Python route: prepares and records
        assert host.record_count() == before + 1
        counted = dispatch.call_counts()
        assert torch.equal(cutlass_ops.matmul(x, weight.t()), first)
        assert dispatch.call_counts()["cutlass"] == counted["cutlass"] + 1  # the C++ record
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            cutlass_ops.matmul(x, weight.t())
        torch.cuda.current_stream().wait_stream(stream)
        counted = dispatch.call_counts()
        y = _replayed_with_new_input(lambda: cutlass_ops.matmul(x, weight.t()), x)
        now = dispatch.call_counts()  # the capture: the Python route's torch.matmul
        assert (now["eager only"], now["cutlass"]) == (counted["eager only"] + 1,
                                                       counted["cutlass"])
        torch.testing.assert_close(y.float(), x.float() @ weight.t().float(), atol=0.5,
                                   rtol=2e-2)
    dispatch.reset()


@pytest.mark.parametrize("leading", [(16,), (2, 8)])
def test_a_linear_with_gradients_runs_its_cpp_node_and_equals_the_python_path(
        host, online_compile, leading, monkeypatch):
    """Linear without bias, x of 2 or 3 dimensions: the first call (Python: _EagerLinear)
    records the product; the next runs the C++ node, whose backward products go through
    cutlass_ops::mm as _EagerLinear's go through dispatch: every gradient equal bit for bit."""
    import cutlass_ops.nn
    from cutlass_ops import ops

    monkeypatch.setattr(ops, "HOST_LINEAR_WITH_GRAD", True)
    layer = cutlass_ops.nn.Linear(256, 256, bias=False, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(*leading, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(*leading, 256, device="cuda", dtype=torch.bfloat16)
    first = layer(x)
    assert "CutlassOpsLinearBackward" not in first.grad_fn.name()
    first.backward(dy)
    expected = x.grad.clone(), layer.weight.grad.clone()
    x.grad = layer.weight.grad = None
    second = layer(x)
    assert "CutlassOpsLinearBackward" in second.grad_fn.name()
    assert torch.equal(second, first)
    second.backward(dy)
    assert torch.equal(x.grad, expected[0]) and torch.equal(layer.weight.grad, expected[1])
    assert not second._is_view()  # an in-place op on the output stays legal
    second.detach().add_(1)
    with torch.no_grad():  # and without gradients: the same product
        assert torch.equal(layer(x), first)


def test_a_product_dispatch_sends_to_torch_runs_in_cpp_as_torch_matmul(host, monkeypatch):
    """``dispatch.HOST_TORCH_RECORDS``: a plain product whose route is torch's (nothing tuned or
    built, online off) is recorded on its first call; the next runs ``at::matmul_out`` in C++
    and equals torch.matmul bit for bit, eagerly, inside a CUDA graph, and through a Linear
    with and without gradients."""
    import cutlass_ops
    import cutlass_ops.nn
    from cutlass_ops.gemms import dispatch

    monkeypatch.setattr(dispatch, "HOST_TORCH_RECORDS", True)
    # Nothing built counts (an earlier test may have built a kernel that fits), and the shape is
    # tuned for nothing: dispatch's route is torch's, as where a tune found torch faster.
    monkeypatch.setattr(dispatch, "built_choices", lambda operands, arch: [])
    dispatch.reset()
    x = torch.randn(24, 136, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(72, 136, device="cuda", dtype=torch.bfloat16)
    assert cutlass_ops.explain(x, weight.t()).source == "torch"
    with torch.no_grad():
        before = host.record_count()
        first = cutlass_ops.matmul(x, weight.t())
        assert host.record_count() == before + 1

        def refuse(*args, **kwargs):
            raise AssertionError("the Python route ran")
        monkeypatch.setattr(dispatch, "route", refuse)
        counted = dispatch.call_counts()
        assert torch.equal(cutlass_ops.matmul(x, weight.t()), first)
        now = dispatch.call_counts()  # counted as what it ran: torch's product
        assert (now["torch"], now["cutlass"]) == (counted["torch"] + 1, counted["cutlass"])
        assert torch.equal(first, torch.matmul(x, weight.t()))
        y = _replayed_with_new_input(lambda: cutlass_ops.matmul(x, weight.t()), x)
        assert torch.equal(y, torch.matmul(x, weight.t()))
    monkeypatch.undo()  # the route back
    monkeypatch.setattr(dispatch, "HOST_TORCH_RECORDS", True)
    monkeypatch.setattr(dispatch, "built_choices", lambda operands, arch: [])
    layer = cutlass_ops.nn.Linear(136, 72, bias=False, device="cuda", dtype=torch.bfloat16)
    inputs = torch.randn(2, 12, 136, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    for _ in range(2):  # the first records, the second runs the C++ node
        out = layer(inputs)
        out.sum().backward()
    assert torch.equal(out.detach(), torch.matmul(inputs.detach(), layer.weight.detach().t()))
    assert inputs.grad is not None and layer.weight.grad is not None
    dispatch.reset()
