"""When the compiled host path (custom_kernels.host_ops) is asked for at all: only for plain CUDA
tensors, so that a CPU-only user, or a CPU test run, never starts its C++ build; and a path
switched off stays off without another lookup. The C++ ops themselves: tests/compile/
test_host_ops.py (their decisions), tests/gpu/test_host_ops_gpu.py (their launches)."""

import pytest
import torch

import cutlass_ops
import cutlass_ops.nn
from custom_kernels import host_ops
from custom_kernels.norms import norm_ops


@pytest.fixture
def no_build(monkeypatch):
    asked = []

    def ops(wait=None):
        asked.append(wait)
        return None
    monkeypatch.setattr(host_ops, "ops", ops)
    return asked


def test_cpu_calls_never_ask_for_the_compiled_path(no_build):
    x, w = torch.randn(4, 64), torch.ones(64)
    norm_ops.rms_norm(x, w)
    norm_ops.layer_norm(x, w, torch.zeros(64))
    cutlass_ops.nn.RMSNorm(64)(x)
    cutlass_ops.matmul(x, torch.randn(64, 8))
    layer = cutlass_ops.nn.Linear(64, 8, bias=False)
    layer(x)
    layer(x.requires_grad_()).sum().backward()
    assert no_build == []


def test_traced_and_subclass_tensors_never_ask(no_build):
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x, w = torch.empty(4, 64, device="cuda"), torch.empty(64, device="cuda")
        assert norm_ops.host_norm("rms", x, w, None, None, 1e-6) is None
    assert no_build == []


def test_a_path_that_is_off_stays_off_without_lookups(monkeypatch):
    calls = []
    monkeypatch.setattr(host_ops, "ops", lambda wait=None: calls.append(1))
    monkeypatch.setattr(host_ops, "why_not", lambda: "built for another torch")
    monkeypatch.setattr(norm_ops, "HOST_NORM", host_ops.LazyOp("norm"))
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    x, w = torch.randn(2, 64), torch.ones(64)
    assert norm_ops.host_norm("rms", x, w, None, None, 1e-6) is None
    assert norm_ops.host_norm("rms", x, w, None, None, 1e-6) is None
    assert calls == [1] and norm_ops.HOST_NORM.off is True


def test_call_counts_add_the_host_path_s_products_by_what_they_ran(monkeypatch):
    """The hot path leaves the products the C++ op takes uncounted in Python; the op counts
    them, apart by record kind, and ``call_counts`` adds them where they belong."""
    from cutlass_ops.gemms import dispatch

    monkeypatch.setattr(dispatch, "calls", dispatch.collections.Counter(cutlass=5, torch=2))
    monkeypatch.setattr(host_ops, "product_calls", lambda: (4, 3))
    assert dispatch.call_counts() == {"cutlass": 9, "torch": 5}
    assert dispatch.calls == {"cutlass": 5, "torch": 2}  # the counter itself untouched
    monkeypatch.setattr(host_ops, "product_calls", lambda: (0, 0))
    assert dispatch.call_counts() == {"cutlass": 5, "torch": 2}


def test_product_calls_are_none_before_the_library_loads(monkeypatch):
    monkeypatch.setitem(host_ops._state, "ops", None)
    assert host_ops.product_calls() == (0, 0)