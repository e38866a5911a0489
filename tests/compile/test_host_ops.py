"""The compiled host path (custom_kernels.host_ops, csrc/host/host_ops.cpp) on a machine without
a GPU: it builds against the installed torch and loads; every call it cannot take returns None
(so the Python path runs); its records are validated; a build that cannot happen leaves the
Python path in place. The launches themselves: tests/gpu/test_host_ops_gpu.py."""

import logging

import pytest
import torch

from custom_kernels import host_ops
from custom_kernels.norms import norm_ops

pytestmark = [pytest.mark.compile, pytest.mark.smoke]


@pytest.fixture(scope="module")
def host():
    loaded = host_ops.ops(wait=True)
    assert loaded is not None, host_ops.why_not()
    assert host_ops.status() == "compiled"
    return loaded


RECORD = dict(kind=0, hidden=64, x_dtype=torch.float32, out_dtype=torch.float32,
              w_dtype=torch.float32, aligned=True, residual=False, device=0, kernel=0x1000,
              threads=128, cluster=1, shared_mem=0, rows_per_unit=1, persistent=False,
              max_units=132)


def test_calls_it_cannot_take_return_none_off_cuda(host):
    x = torch.randn(4, 64, requires_grad=True)
    w, b = torch.ones(64), torch.zeros(64)
    assert host.norm(0, x, w, None, None, 1e-6) == (None, None)
    assert host.norm(1, x, w, b, x.detach(), 1e-5) == (None, None)
    with torch.inference_mode():
        assert host.norm(0, torch.randn(2, 8), torch.ones(8), None, None, 1e-6) == (None, None)


def test_a_record_is_not_a_reason_to_take_a_cpu_call(host):
    host.set_norm_record(**RECORD)
    try:
        assert host.record_count() == 1
        assert host.norm(0, torch.randn(4, 64), torch.ones(64), None, None, 1e-6) == (None, None)
    finally:
        host.clear_records()
    assert host.record_count() == 0


def test_the_kind_and_the_bias_must_agree(host):
    """A LayerNorm call without a bias (or an RMSNorm call with one) is never taken: the kind is
    the caller's, not guessed from the arguments."""
    x, w = torch.randn(4, 64), torch.ones(64)
    assert host.norm(1, x, w, None, None, 1e-5) == (None, None)
    assert host.norm(0, x, w, torch.zeros(64), None, 1e-6) == (None, None)


@pytest.mark.parametrize("field, value", [("kind", 2), ("kernel", 0), ("threads", 0),
                                          ("threads", 2048), ("cluster", 0), ("cluster", 32),
                                          ("rows_per_unit", 0), ("max_units", 0),
                                          ("shared_mem", -1), ("hidden", 0)])
def test_a_record_out_of_range_is_refused(host, field, value):
    with pytest.raises(RuntimeError, match="norm"):
        host.set_norm_record(**{**RECORD, field: value})
    assert host.record_count() == 0


def test_the_driver_is_reported_missing_without_a_gpu(host):
    status = host.driver_status()
    assert status == "ok" or "libcuda" in status


def test_the_public_functions_fall_back_to_the_reference_on_cpu(host):
    x, w = torch.randn(3, 64), 1 + 0.1 * torch.randn(64)
    assert norm_ops.host_norm("rms", x, w, None, None, 1e-6) is None
    torch.testing.assert_close(norm_ops.rms_norm(x, w, 1e-6),
                               norm_ops.rms_norm_reference(x, w, 1e-6))


def test_the_path_can_be_turned_off(monkeypatch):
    monkeypatch.setenv(host_ops.ENV_VAR, "0")
    monkeypatch.setattr(host_ops, "_state", {"ops": None, "thread": None, "why_not": None})
    assert host_ops.status() == f"off: {host_ops.ENV_VAR}=0"  # starts nothing
    assert host_ops.ops(wait=True) is None
    assert host_ops.why_not() == f"{host_ops.ENV_VAR}=0"


def test_a_build_that_fails_leaves_the_python_path(monkeypatch, tmp_path, caplog):
    """A compiler that refuses: the failure is logged once, ops() says None from then on without
    building again, and the norms still run (here: the CPU reference)."""
    monkeypatch.setenv("CUTLASS_OPS_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(host_ops, "_state", {"ops": None, "thread": None, "why_not": None})
    fake = tmp_path / "cxx"
    fake.write_text("#!/bin/sh\necho 'fake: error: no compiler here' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setattr(host_ops, "compiler", lambda: str(fake))
    monkeypatch.setattr(host_ops, "compiler_version", lambda: "fake 1.0")
    with caplog.at_level(logging.WARNING):
        assert host_ops.ops(wait=True) is None
    assert "no compiler here" in host_ops.why_not()
    assert host_ops.ops(wait=True) is None
    x, w = torch.randn(2, 64), torch.ones(64)
    torch.testing.assert_close(norm_ops.rms_norm(x, w), norm_ops.rms_norm_reference(x, w))


GEMM = dict(a_sizes=[16, 256], a_strides=[256, 1], a_dtype=torch.bfloat16, b_sizes=[256, 128],
            b_strides=[1, 256], b_dtype=torch.bfloat16, device=0, aligned=True, run=0x1000,
            last_error=0x2000, off_a=16, off_b=48, off_c=80, off_d=112, swap_ab=False,
            workspace_bytes=0, out_dtype=torch.bfloat16)


def _args(size=200):
    return torch.zeros(size, dtype=torch.uint8)


def test_a_gemm_call_off_cuda_or_without_a_record_returns_none(host):
    a, b = torch.randn(16, 256), torch.randn(256, 128)
    assert host.gemm(a, b) is None
    host.set_gemm_record(args=_args(), **GEMM)
    try:
        assert host.gemm(a.bfloat16(), b.bfloat16().t().contiguous().t()) is None  # CPU
    finally:
        host.clear_records()


def test_a_torch_record_is_not_a_reason_to_take_a_cpu_call_nor_counted(host):
    a, b = torch.randn(16, 256), torch.randn(256, 128)
    host.set_gemm_torch_record(list(a.shape), list(a.stride()), a.dtype, list(b.shape),
                               list(b.stride()), b.dtype, 0, True)
    try:
        assert host.gemm(a, b) is None
        assert host_ops.product_calls() == (0, 0)
    finally:
        host.clear_records()


@pytest.mark.parametrize("change", [dict(off_a=196), dict(off_d=-8), dict(off_b=50),
                                    dict(run=0), dict(last_error=0), dict(workspace_bytes=-1),
                                    dict(a_sizes=[16]), dict(b_strides=[1])])
def test_a_gemm_record_out_of_range_is_refused(host, change):
    with pytest.raises(RuntimeError, match="GEMM record"):
        host.set_gemm_record(args=_args(), **{**GEMM, **change})
    assert host.record_count() == 0


@pytest.mark.parametrize("args", [torch.zeros(200, dtype=torch.int32),
                                  torch.zeros(0, dtype=torch.uint8),
                                  torch.zeros(2, 100, dtype=torch.uint8)])
def test_gemm_launch_arguments_must_be_bytes(host, args):
    with pytest.raises(RuntimeError, match="GEMM record"):
        host.set_gemm_record(args=args, **GEMM)


def test_the_offsets_python_gives_are_the_launchers(host):
    """The pointer offsets come from the ctypes mirror of the launcher's struct: 8-byte aligned,
    inside it, distinct."""
    import ctypes

    from cutlass_ops.gemms.runtime import GemmArgs, pointer_offsets

    offsets = pointer_offsets()
    assert len(set(offsets.values())) == 4
    assert all(o % 8 == 0 and o + 8 <= ctypes.sizeof(GemmArgs) for o in offsets.values())
    host.set_gemm_record(args=_args(ctypes.sizeof(GemmArgs)),
                         **{**GEMM, **{f"off_{k}": v for k, v in offsets.items()}})
    assert host.record_count() == 1
    from cutlass_ops.gemms import dispatch

    dispatch.reset()  # forgets the routes, and with them the compiled path's records
    assert host.record_count() == 0
