"""Several short rows per warp (issue 5): the direct forward kernel with 8, 16 or 32 lanes per
row and 32..256-thread blocks, against the current heuristic and torch.compile, RMSNorm and
LayerNorm at hidden 256 and 1000; each config checked first on row counts that end mid-warp."""
import os
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
STAGES = tuple(int(v) for v in os.environ.get("STAGES", "0").split(","))
# EXTRA_DEFINES="NORM_STORE_CS=1,...": -D values added to every config (a variant of the kernels).
EXTRA = dict(kv.split("=") for kv in os.environ.get("EXTRA_DEFINES", "").split(",") if kv)
_defines = nc.NormConfig.defines
nc.NormConfig.defines = lambda self, p: {**_defines(self, p), **{k: int(v) for k, v in EXTRA.items()}}


def run(kind, x, w, b, config, residual=None):
    if kind == "rms":
        return norms.rms_norm(x, w, EPS, residual=residual, config=config)
    return norms.layer_norm(x, w, b, EPS, residual=residual, config=config)


def reference(kind, x, w, b, residual=None):
    h = x.float() if residual is None else (x.float() + residual.float()).to(x.dtype).float()
    if kind == "rms":
        return F.rms_norm(h, (x.shape[-1],), w.float(), EPS)
    return F.layer_norm(h, (x.shape[-1],), w.float(), b.float(), EPS)


def first(out):
    return out[0] if isinstance(out, tuple) else out


if __name__ == "__main__":
    kinds = sys.argv[1:] or ["rms", "ln"]
    for kind in kinds:
        for h in [int(v) for v in os.environ.get("HIDDEN", "256,1000").split(",")]:
            p = nc.NormProblem(kind, "fwd", h, "bfloat16", "bfloat16", "bfloat16")
            pr = nc.NormProblem(kind, "fwd", h, "bfloat16", "bfloat16", "bfloat16", residual=True)
            configs = [c for c in nc.space(p) if c.stages in STAGES and c.vec == p.vec
                       and c.cluster == 1 and c.warp_per_row and c.threads <= 256]
            configs = [nc.heuristic(p)] + [c for c in configs if c != nc.heuristic(p)]
            failed = norms.precompile_configs(p, configs, workers=16)
            failed.update(norms.precompile_configs(pr, configs, workers=16))
            print(f"{kind} h={h}: {len(configs)} configs, failed {failed}", flush=True)
            w = (1 + 0.1 * torch.randn(h, device="cuda")).to(torch.bfloat16)
            b = (0.1 * torch.randn(h, device="cuda")).to(torch.bfloat16)
            good = []
            for c in configs:
                if c.name in failed:
                    continue
                ok = True
                for rows in (1, 7, 33, 4099):
                    x = torch.randn(rows, h, device="cuda", dtype=torch.bfloat16)
                    r = torch.randn(rows, h, device="cuda", dtype=torch.bfloat16)
                    for res in (None, r):
                        out = run(kind, x, w, b, c.name, res)
                        ref = reference(kind, x, w, b, res)
                        err = ((first(out).float() - ref).norm() / ref.norm()).item()
                        if not err < 2e-2:
                            print("  WRONG", c.name, rows, res is not None, err, flush=True)
                            ok = False
                        if res is not None and not torch.equal(out[1], (x.float() + r.float()).to(x.dtype)):
                            print("  WRONG residual out", c.name, rows, flush=True)
                            ok = False
                if ok:
                    good.append(c)
            for rows in (32768, 131072):
                x = torch.randn(rows, h, device="cuda", dtype=torch.bfloat16)
                if kind == "rms":
                    tc = torch.compile(lambda x, w: F.rms_norm(x, (h,), w, EPS), dynamic=False)
                    fns = {"torch.compile": lambda: tc(x, w)}
                else:
                    tc = torch.compile(lambda x, w, b: F.layer_norm(x, (h,), w, b, EPS), dynamic=False)
                    fns = {"torch.compile": lambda: tc(x, w, b)}
                for c in good:
                    fns[c.name] = (lambda c=c: run(kind, x, w, b, c.name))
                t = do_bench_interleaved(fns, reps=100 if rows < 100000 else 40, pad_host=True)
                ref_us = t["torch.compile"].median_ms * 1e3
                gb = 2 * rows * h * 2 / 1e3
                print(f"  {kind} h={h} rows={rows}: torch.compile {ref_us:.2f} us ({gb / ref_us:.0f} GB/s);"
                      f" heuristic {nc.heuristic(p).name}")
                for name, v in sorted(t.items(), key=lambda kv: kv[1].median_ms)[:10]:
                    us = v.median_ms * 1e3
                    print(f"    {us:8.2f} us {gb / us:6.0f} GB/s x{ref_us / us:.3f}  {name}", flush=True)
