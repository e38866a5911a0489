"""Runs one norm forward a few times (for ncu):

    python devrun/norm_one_kind.py rms|ln HIDDEN [config]
"""
import sys
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import torch  # noqa: E402
from custom_kernels import norms  # noqa: E402

kind, hidden = sys.argv[1], int(sys.argv[2])
config = sys.argv[3] if len(sys.argv) > 3 else None
rows = 8192 if hidden >= 262144 else 32768
x = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16)
w = torch.ones(hidden, device="cuda", dtype=torch.bfloat16)
b = torch.zeros(hidden, device="cuda", dtype=torch.bfloat16)
for _ in range(3):
    y = norms.rms_norm(x, w, 1e-6, config=config) if kind == "rms" else \
        norms.layer_norm(x, w, b, 1e-6, config=config)
torch.cuda.synchronize()
