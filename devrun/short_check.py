"""The short-row forward heuristic against the previous one and torch.compile (issue 5)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from custom_kernels import norm_config as nc  # noqa: E402
from custom_kernels import norms  # noqa: E402
from tuning.timing import do_bench_interleaved  # noqa: E402

EPS = 1e-6
if __name__ == "__main__":
    for h in (256, 1000):
        p = nc.NormProblem("rms", "fwd", h, "bfloat16", "bfloat16", "bfloat16")
        for rows in (32768, 131072, 524288):
            x = torch.randn(rows, h, device="cuda", dtype=torch.bfloat16)
            w = (1 + 0.1 * torch.randn(h, device="cuda")).to(torch.bfloat16)
            tc = torch.compile(lambda x, w: F.rms_norm(x, (h,), w, EPS), dynamic=False)
            fns = {"torch.compile": lambda: tc(x, w), "new " + nc.heuristic(p).name:
                   lambda: norms.rms_norm(x, w, EPS),
                   "old t256_r8_c1_v8_s3": lambda: norms.rms_norm(x, w, EPS,
                                                                  config="t256_r8_c1_v8_s3")}
            t = do_bench_interleaved(fns, reps=150, pad_host=True)
            ref = t["torch.compile"].median_ms
            print(f"h={h} rows={rows}: " + "  ".join(
                f"{k} {v.median_ms * 1e3:.2f}us x{ref / v.median_ms:.3f}" for k, v in t.items()),
                flush=True)
