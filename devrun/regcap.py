"""Short-row forward with capped registers (issue 5): the kernels compiled to fit
65536 / (REGS * threads) blocks per SM (NORM_MIN_BLOCKS), optionally without weights in
registers (NORM_WEIGHT_REGS=0), so that more rows are in flight per SM; against torch.compile.
Usage: regcap.py REGS WEIGHT_REGS [PRELOAD_W] (REGS 0: no cap; WEIGHT_REGS -1: the kernel's rule)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from custom_kernels import norm_config as nc  # noqa: E402
from custom_kernels import norms  # noqa: E402
from tuning.timing import do_bench_interleaved  # noqa: E402

REGS, WEIGHT_REGS = int(sys.argv[1]), int(sys.argv[2])
PRELOAD_W = int(sys.argv[3]) if len(sys.argv) > 3 else 0
nc.THREAD_CHOICES = (32,) + tuple(nc.THREAD_CHOICES)
_defines = nc.NormConfig.defines


def defines(self, problem):
    d = dict(_defines(self, problem))
    if REGS and problem.direction == "fwd":
        d["NORM_MIN_BLOCKS"] = max(1, min(32, 65536 // (REGS * self.threads)))
    if PRELOAD_W:
        d["NORM_PRELOAD_W"] = 1
    if WEIGHT_REGS >= 0:
        d["NORM_WEIGHT_REGS"] = WEIGHT_REGS
    return d


nc.NormConfig.defines = defines
EPS = 1e-6
CONFIGS = ["t32_r1_c1_v8_s1", "t64_r2_c1_v8_s1", "t128_r4_c1_v8_s1", "t256_r8_c1_v8_s1",
           "t256_r8_c1_v8_s3", "t64_r2_c1_v8_s3", "t256_r8_c1_v8", "t64_r2_c1_v8", "t32_r1_c1_v8",
           "t128_r4_c1_v8"]


def run(kind, x, w, b, config):
    if kind == "rms":
        return norms.rms_norm(x, w, EPS, config=config)
    return norms.layer_norm(x, w, b, EPS, config=config)


if __name__ == "__main__":
    print(f"== REGS {REGS} WEIGHT_REGS {WEIGHT_REGS} PRELOAD_W {PRELOAD_W}")
    for kind in ("rms", "ln"):
        for h in (256, 1000):
            p = nc.NormProblem(kind, "fwd", h, "bfloat16", "bfloat16", "bfloat16")
            configs = [nc.NormConfig.from_name(n) for n in CONFIGS]
            configs = [c for c in configs if c.why_invalid(p) is None]
            failed = norms.precompile_configs(p, configs, workers=16)
            w = (1 + 0.1 * torch.randn(h, device="cuda")).to(torch.bfloat16)
            b = (0.1 * torch.randn(h, device="cuda")).to(torch.bfloat16)
            for rows in (32768, 131072):
                x = torch.randn(rows, h, device="cuda", dtype=torch.bfloat16)
                if kind == "rms":
                    ref = F.rms_norm(x.float(), (h,), w.float(), EPS)
                    tc = torch.compile(lambda x, w: F.rms_norm(x, (h,), w, EPS), dynamic=False)
                    fns = {"torch.compile": lambda: tc(x, w)}
                else:
                    ref = F.layer_norm(x.float(), (h,), w.float(), b.float(), EPS)
                    tc = torch.compile(lambda x, w, b: F.layer_norm(x, (h,), w, b, EPS), dynamic=False)
                    fns = {"torch.compile": lambda: tc(x, w, b)}
                for c in configs:
                    if c.name in failed:
                        continue
                    err = ((run(kind, x, w, b, c.name).float() - ref).norm() / ref.norm()).item()
                    if not err < 2e-2:
                        print("  WRONG", c.name, err)
                        continue
                    fns[c.name] = (lambda c=c: run(kind, x, w, b, c.name))
                t = do_bench_interleaved(fns, reps=100 if rows < 100000 else 40, pad_host=True)
                ref_us = t["torch.compile"].median_ms * 1e3
                line = " ".join(f"{n.replace('_c1_v8', '')}:{ref_us / v.median_ms / 1e3:.3f}"
                                for n, v in sorted(t.items(), key=lambda kv: kv[1].median_ms)
                                if n != "torch.compile")
                print(f"  {kind} h={h} rows={rows} tc {ref_us:.2f}us | {line}", flush=True)
