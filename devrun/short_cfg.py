"""Short-row forward configs (issue 5), with one-warp blocks allowed (as torch.compile's Triton
kernel runs them), against torch.compile at a moderate and a large row count."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from custom_kernels import norm_config as nc  # noqa: E402
from custom_kernels import norms  # noqa: E402
from tuning.timing import do_bench_interleaved  # noqa: E402

nc.THREAD_CHOICES = (32,) + tuple(nc.THREAD_CHOICES)
EPS = 1e-6

if __name__ == "__main__":
    for h in (256, 1000):
        p = nc.NormProblem("rms", "fwd", h, "bfloat16", "bfloat16", "bfloat16")
        configs = [c for c in nc.space(p) if c.threads <= 128 and c.vec == p.vec and c.cluster == 1]
        configs = [nc.heuristic(p)] + [c for c in configs if c != nc.heuristic(p)]
        failed = norms.precompile_configs(p, configs, workers=16)
        print(f"h={h}: {len(configs)} configs, failed {failed}", flush=True)
        for rows in (32768, 524288):
            x = torch.randn(rows, h, device="cuda", dtype=torch.bfloat16)
            w = (1 + 0.1 * torch.randn(h, device="cuda")).to(torch.bfloat16)
            ref = F.rms_norm(x.float(), (h,), w.float(), EPS)
            tc = torch.compile(lambda x, w: F.rms_norm(x, (h,), w, EPS), dynamic=False)
            fns = {"torch.compile": lambda: tc(x, w)}
            for c in configs:
                if c.name in failed:
                    continue
                y = norms.rms_norm(x, w, EPS, config=c.name)
                err = ((y.float() - ref).norm() / ref.norm()).item()
                if not err < 2e-2:
                    print("  WRONG", c.name, err)
                    continue
                fns[c.name] = (lambda c=c: norms.rms_norm(x, w, EPS, config=c.name))
            t = do_bench_interleaved(fns, reps=100 if rows < 100000 else 40, pad_host=True)
            ref_us = t["torch.compile"].median_ms * 1e3
            gb = 2 * rows * h * 2 / 1e3
            print(f"  rows={rows}: torch.compile {ref_us:.2f} us ({gb / ref_us:.0f} GB/s)")
            for name, v in sorted(t.items(), key=lambda kv: kv[1].median_ms)[:12]:
                us = v.median_ms * 1e3
                print(f"    {us:8.2f} us {gb / us:6.0f} GB/s x{ref_us / us:.3f}  {name}", flush=True)
