"""Long-row forward sweep: every staged candidate of a norm at the benchmark's row counts, with
the staged kernel's weight rule as given (NORM_WEIGHT_REGS variants, env WEIGHT_REGS: comma list
of -1 / 0 / 1; -1 is the default rule), printing GB/s, fraction of copy, row units resident and
the heuristic's line. Usage: long_sweep.py rms|ln HIDDEN..."""
import os
import sys
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import torch  # noqa: E402
from custom_kernels import norm_config as nc, norms  # noqa: E402
from tuning import norm_tune  # noqa: E402
from tuning.timing import do_bench  # noqa: E402

EXTRA = {}
_orig = nc.NormConfig.defines
nc.NormConfig.defines = lambda self, p: {**_orig(self, p), **(EXTRA if self.stages else {})}


def copy_gbs() -> float:
    a = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    t = do_bench(lambda: b.copy_(a), reps=20).median_ms
    return 2 * a.numel() / t / 1e6


def main():
    global EXTRA
    kind = sys.argv[1]
    sizes = [int(a) for a in sys.argv[2:]]
    variants = [int(v) for v in os.environ.get("WEIGHT_REGS", "-1").split(",")]
    copy = copy_gbs()
    print(f"copy {copy:.0f} GB/s")
    for hidden in sizes:
        p = nc.NormProblem(kind, "fwd", hidden, "bfloat16", "bfloat16", "bfloat16")
        configs = norm_tune.candidates(p, "default")
        for v in variants:
            EXTRA = {} if v == -1 else {"NORM_WEIGHT_REGS": v}
            norms.precompile_configs(p, configs, workers=16)
        rows = 8192 if hidden >= 262144 else 32768
        case = norm_tune._Case(p, rows)
        nbytes = 2 * case.rows * hidden * 2
        res = []
        for v in variants:
            EXTRA = {} if v == -1 else {"NORM_WEIGHT_REGS": v}
            norms._fwd_plan.cache_clear()
            for c in configs:
                try:
                    run = case.runner(c)
                    err = case.error(run())
                    t = do_bench(run, reps=20, pad_host=True).median_ms
                    plan = norms._fwd_plan(kind, hidden, "bfloat16", "bfloat16", "bfloat16",
                                           True, False, c.name, 0)
                    res.append((t, c.name + ("" if v == -1 else f"_wr{v}"), err,
                                plan.max_units if plan.persistent else -1))
                except Exception as exc:
                    print("fail", c.name, v, exc)
        EXTRA = {}
        norms._fwd_plan.cache_clear()
        tt = do_bench(case.torch_fn, reps=20, pad_host=True).median_ms
        res.sort()
        print(f"== {kind} fwd {hidden} rows {rows} heuristic {configs[0].name} "
              f"eager {nbytes/tt/1e6:.0f} GB/s")
        for t, n, err, units in res[:10]:
            print(f"   {n:26s} {t*1e3:8.1f} us {nbytes/t/1e6:6.0f} GB/s {nbytes/t/1e6/copy:.3f}"
                  f" units {units} err {err:.1e}")
        for r in res:
            if r[1] == configs[0].name:
                print(f"   heuristic {r[1]} {nbytes/r[0]/1e6:.0f} GB/s {nbytes/r[0]/1e6/copy:.3f}")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
