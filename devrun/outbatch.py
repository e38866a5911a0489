"""Forward output loop: weight (and bias) loads issued NORM_OUT_BATCH iterations ahead of their
use, 1 (load-use per vector) against 2 / 4 / all, for the heuristic's config, RMSNorm and
LayerNorm, bf16, against torch.compile in the same interleaved run.

    python devrun/outbatch.py [rms|ln ...]   (HIDDEN=1000,4096 to pick sizes)

NORM_OUT_BATCH exists only at commit 32bf735 (the kernels dropped it after this measurement):
run it on a checkout of that commit. NORM_MIN_BLOCKS (VARIANTS="2:3") was a local patch to the
staged kernel's __launch_bounds__, never committed; it spilled 548 to 792 bytes.
"""
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from custom_kernels import norm_config as nc  # noqa: E402
from custom_kernels import norms  # noqa: E402
from tuning.timing import do_bench_interleaved  # noqa: E402

EPS = 1e-6
BATCHES = (1, 2, 4, 64)
CURRENT = [1]  # the batch the next plan is built (or looked up) for
_defines = nc.NormConfig.defines
nc.NormConfig.defines = lambda self, p: {**_defines(self, p), "NORM_OUT_BATCH": CURRENT[0]}
_real_plan = norms._fwd_plan.__wrapped__
_plans = {}


def _plan_per_batch(*args):
    key = (args, CURRENT[0])
    if key not in _plans:
        _plans[key] = _real_plan(*args)
    return _plans[key]


norms._fwd_plan = _plan_per_batch


def main():
    kinds = sys.argv[1:] or ["rms", "ln"]
    hiddens = [int(v) for v in
               os.environ.get("HIDDEN", "1000,4096,8192,32768,65536,262144").split(",")]
    for kind in kinds:
        for h in hiddens:
            rows = 8192 if h >= 262144 else 32768
            p = nc.NormProblem(kind, "fwd", h, "bfloat16", "bfloat16", "bfloat16")
            cfg = nc.heuristic(p).name
            x = torch.randn(rows, h, device="cuda", dtype=torch.bfloat16)
            w = (1 + 0.1 * torch.randn(h, device="cuda")).to(torch.bfloat16)
            b = (0.1 * torch.randn(h, device="cuda")).to(torch.bfloat16)
            if kind == "rms":
                ref = F.rms_norm(x.float(), (h,), w.float(), EPS)
                tc = torch.compile(lambda x, w: F.rms_norm(x, (h,), w, EPS), dynamic=False)
                fns = {"torch.compile": lambda: tc(x, w)}
            else:
                ref = F.layer_norm(x.float(), (h,), w.float(), b.float(), EPS)
                tc = torch.compile(lambda x, w, b: F.layer_norm(x, (h,), w, b, EPS),
                                   dynamic=False)
                fns = {"torch.compile": lambda: tc(x, w, b)}

            def run(batch):
                CURRENT[0] = batch
                if kind == "rms":
                    return norms.rms_norm(x, w, EPS, config=cfg)
                return norms.layer_norm(x, w, b, EPS, config=cfg)

            for batch in BATCHES:
                try:
                    y = run(batch)
                except Exception as exc:  # a variant that does not build or launch
                    print(f"  {kind} h={h} batch={batch}: failed {exc}")
                    continue
                err = ((y.float() - ref).norm() / ref.norm()).item()
                if not err < 2e-2:
                    print(f"  WRONG {kind} h={h} batch={batch} err={err}")
                    continue
                fns[f"{cfg} b{batch}"] = (lambda batch=batch: run(batch))
            t = do_bench_interleaved(fns, reps=30 if h < 65536 else 15, pad_host=True)
            ref_us = t["torch.compile"].median_ms * 1e3
            gb = 2 * rows * h * 2 / 1e3
            print(f"{kind} h={h} rows={rows}: torch.compile {ref_us:.1f} us "
                  f"({gb / ref_us:.0f} GB/s)")
            for name, v in sorted(t.items(), key=lambda kv: kv[1].median_ms):
                us = v.median_ms * 1e3
                print(f"    {us:9.1f} us {gb / us:6.0f} GB/s x{ref_us / us:.3f}  {name}",
                      flush=True)


if __name__ == "__main__":
    main()
