"""Runs one norm problem a few times (for ncu): python devrun/norm_one.py HIDDEN fwd|bwd [config]"""
import sys
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import torch  # noqa: E402
from custom_kernels import norms  # noqa: E402

hidden, direction = int(sys.argv[1]), sys.argv[2]
config = sys.argv[3] if len(sys.argv) > 3 else None
rows = 8192 if hidden >= 262144 else 32768
x = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
w = torch.ones(hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
for _ in range(3):
    y = norms.rms_norm(x, w, 1e-6, config=config)
    if direction == "bwd":
        torch.autograd.grad(y, (x, w), torch.randn_like(y))
torch.cuda.synchronize()
