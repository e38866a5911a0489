"""One small and one clustered norm size, forward and backward, for compute-sanitizer:

    compute-sanitizer --tool memcheck  python tests/gpu/sanitize_norms.py
    compute-sanitizer --tool racecheck python tests/gpu/sanitize_norms.py
    compute-sanitizer --tool synccheck python tests/gpu/sanitize_norms.py

Compile first without the sanitizer (NVRTC under memcheck is slow): run the script once plainly
with the same CUTLASS_OPS_CACHE_DIR. Exits non-zero if a result is wrong.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from custom_kernels.norms import norm_ops as norms  # noqa: E402

CASES = [  # (rows, hidden, dtype[, forward config[, LayerNorm forward config, weight dtype]])
    (37, 1000, torch.bfloat16),  # forward: the direct kernel, a warp per row; backward staged
    (13, 256, torch.bfloat16),  # forward: the direct kernel, 16 lanes a row, ending in a warp
    (13, 264, torch.bfloat16, "t64_r2_c1_v8_p4"),  # 4 rows a thread, ending in a block
    (5, 4097, torch.float16),  # the direct kernel's scalar path
    (21, 4096, torch.bfloat16),  # staged, a block per row (1 stage forward, 2 backward)
    (9, 65536, torch.bfloat16),  # staged clusters of 2 (forward) and 4 (backward)
    (3, 262144, torch.bfloat16),  # clusters of 8 (forward) and 16 (backward, non-portable)
    # LayerNorm's bias in shared memory (its heuristic at 32768 with bf16 parameters): more rows
    # than blocks, so that blocks reuse it; and in clusters of 2
    (140, 32768, torch.bfloat16, None, None, torch.bfloat16),
    (9, 65536, torch.bfloat16, None, "t512_r1_c2_v8_s2_m", torch.bfloat16),
    (17, 262144, torch.bfloat16, None, None, torch.bfloat16),  # clusters of 8, bias in smem
]


def run(rows, hidden, dtype, config=None, ln_config=None, weight_dtype=torch.float32):
    torch.manual_seed(0)
    x = torch.randn(rows, hidden, device="cuda", dtype=dtype, requires_grad=True)
    res = torch.randn_like(x, requires_grad=True)
    w = torch.rand(hidden, device="cuda", dtype=weight_dtype, requires_grad=True)
    b = torch.randn(hidden, device="cuda", dtype=weight_dtype, requires_grad=True)
    y, h = norms.rms_norm(x, w, residual=res, config=config)
    z = norms.layer_norm(h, w, b, config=ln_config or config)
    ((y.float() ** 2).sum() + (z.float() * 3).sum() + h.float().sum()).backward()
    torch.cuda.synchronize()
    ry, rh = norms.rms_norm_reference(x.detach(), w.detach(), 1e-6, residual=res.detach())
    ok = torch.allclose(y.float(), ry.float(), atol=5e-2, rtol=5e-2) and torch.equal(h, rh)
    rz = norms.layer_norm_reference(h.detach(), w.detach(), b.detach())
    ok = ok and torch.allclose(z.float(), rz.float(), atol=5e-2, rtol=5e-2)
    ok = ok and bool(torch.isfinite(x.grad).all() and torch.isfinite(w.grad).all())
    print(f"rows={rows} hidden={hidden} {dtype}: {'ok' if ok else 'WRONG'}", flush=True)
    return ok


if __name__ == "__main__":
    sys.exit(0 if all([run(*case) for case in CASES]) else 1)
