"""Short-row forward diagnostic (issue 5): torch.compile's generated kernel for RMSNorm at hidden
256 / 1000, and ours against it at several row counts (is the gap a fixed cost or a rate?).

    python devrun/short_rows.py            # timing + inductor code
    python devrun/short_rows.py ncu H      # one call of each, for ncu
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from custom_kernels import norms  # noqa: E402
from tuning.timing import do_bench_interleaved  # noqa: E402

EPS = 1e-6

if len(sys.argv) > 1 and sys.argv[1] == "ncu":
    h = int(sys.argv[2])
    x = torch.randn(32768, h, device="cuda", dtype=torch.bfloat16)
    w = torch.ones(h, device="cuda", dtype=torch.bfloat16)
    tc = torch.compile(lambda x, w: F.rms_norm(x, (h,), w, EPS), dynamic=False)
    for _ in range(3):
        tc(x, w)
        norms.rms_norm(x, w, EPS)
    torch.cuda.synchronize()
    sys.exit()

from torch._inductor.utils import run_and_get_code  # noqa: E402

for h in (256, 1000):
    x = torch.randn(32768, h, device="cuda", dtype=torch.bfloat16)
    w = torch.ones(h, device="cuda", dtype=torch.bfloat16)
    fn = torch.compile(lambda x, w: F.rms_norm(x, (h,), w, EPS), dynamic=False)
    _, code = run_and_get_code(fn, x, w)
    src = code[0]
    keep = [ln for ln in src.splitlines() if any(k in ln for k in (
        "@triton_heuristics", "triton_meta", "inductor_meta", "def triton_", "XBLOCK", "R0_BLOCK",
        "RBLOCK", "num_warps", "grid=", ".run(", "xnumel", "r0_numel", "tl.load", "tl.store"))]
    print(f"==== inductor, hidden {h}\n" + "\n".join(keep[:60]))

for h in (256, 1000):
    for rows in (8192, 32768, 131072, 524288):
        x = torch.randn(rows, h, device="cuda", dtype=torch.bfloat16)
        w = torch.ones(h, device="cuda", dtype=torch.bfloat16)
        tc = torch.compile(lambda x, w: F.rms_norm(x, (h,), w, EPS), dynamic=False)
        fns = {"ours": lambda: norms.rms_norm(x, w, EPS), "torch.compile": lambda: tc(x, w)}
        t = do_bench_interleaved(fns, reps=200, pad_host=True)
        o, r = t["ours"].median_ms * 1e3, t["torch.compile"].median_ms * 1e3
        gb = 2 * rows * h * 2 / 1e3
        print(f"h={h:5d} rows={rows:7d}: ours {o:8.2f} us ({gb / o:6.0f} GB/s)  tc {r:8.2f} us "
              f"({gb / r:6.0f} GB/s)  ratio {r / o:.3f}  diff {o - r:+.2f} us", flush=True)
