"""A kernel cache that other users can write to, on the GPU: cutlass_ops.matmul runs torch.matmul
and says why (the path and the fix), never "run cutlass-tune tune"."""

import os

import pytest
import torch

import cutlass_ops
from cutlass_ops.gemms import dispatch
from custom_kernels.core import cache_trust, fallback

pytestmark = pytest.mark.gpu


def test_matmul_on_an_unsafe_cache_runs_torch_and_names_the_fix(tmp_path, monkeypatch):
    root = tmp_path / "shared-cache"
    root.mkdir(mode=0o700)
    monkeypatch.setenv("CUTLASS_OPS_CACHE_DIR", str(root))
    os.chmod(root, 0o777)  # as a shared cache directory often is
    cache_trust.forget()
    dispatch.reset()
    monkeypatch.setattr(fallback, "logged", set())
    a = torch.randn(128, 256, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(256, 64, device="cuda", dtype=torch.bfloat16)
    decision = cutlass_ops.explain(a, b)
    assert decision.choice is None and "chmod go-w" in decision.reason, decision.reason
    torch.testing.assert_close(cutlass_ops.matmul(a, b), torch.matmul(a, b))
