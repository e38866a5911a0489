"""Is LayerNorm 32768's speed a matter of where x and y sit in memory? The same kernel on x
placed at several offsets inside one allocation, and with y's allocation shifted by a spacer."""
import sys
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import torch  # noqa: E402
from benchmarks.common import copy_bandwidth_gbs  # noqa: E402
from custom_kernels import norms  # noqa: E402
from custom_kernels import norm_config as nc  # noqa: E402
from tuning import norm_tune  # noqa: E402
from tuning.timing import do_bench  # noqa: E402

EPS = 1e-6
copy = copy_bandwidth_gbs()
hidden = int(sys.argv[1]) if len(sys.argv) > 1 else 32768
cfgs = sys.argv[2:] or [None]
rows = 8192 if hidden >= 262144 else 32768
nbytes = 2 * rows * hidden * 2 + 4 * hidden
w = (1 + 0.1 * torch.randn(hidden, device="cuda")).to(torch.bfloat16)
b = (0.1 * torch.randn(hidden, device="cuda")).to(torch.bfloat16)
for cfg in cfgs:
    print(f"== ln {hidden} config {cfg}")
    for off_kb in (0, 4, 64, 1024, 2048 + 4, 8192 + 64):
        off = off_kb * 512  # elements of 2 bytes
        base = torch.randn(rows * hidden + off, device="cuda").to(torch.bfloat16)
        x = base[off:].view(rows, hidden)
        res = []
        for spacer_mb in (0, 2, 34):
            torch.cuda.empty_cache()  # y's next block comes from a fresh cudaMalloc
            spacer = torch.empty(spacer_mb << 20, dtype=torch.uint8, device="cuda") \
                if spacer_mb else None
            t = do_bench(lambda x=x: norms._fwd_impl("ln", x, w, b, None, EPS, torch.bfloat16, cfg),
                         reps=20, pad_host=True).median_ms
            res.append(f"spacer {spacer_mb}MB {nbytes / t / 1e6 / copy:.3f}")
            del spacer
        print(f"  x offset {off_kb:5d} KB: " + ", ".join(res))
        del base, x
        torch.cuda.empty_cache()
    sys.stdout.flush()
p = nc.NormProblem("ln", "fwd", hidden, "bfloat16", "bfloat16", "bfloat16")
case = norm_tune._Case(p, rows)
for cfg in cfgs:
    run = case.runner(nc.NormConfig.from_name(cfg) if cfg else nc.heuristic(p))
    t = do_bench(run, reps=20, pad_host=True).median_ms
    print(f"tuner case {cfg}: {nbytes / t / 1e6 / copy:.3f}")
