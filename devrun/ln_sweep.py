"""LayerNorm forward: every staged candidate at a few sizes, with the weights in registers by the
default rule and never (NORM_WEIGHT_REGS=0); GPU time with the host padded out. Prints the best."""
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
def main():
    global EXTRA
    kind = sys.argv[1] if len(sys.argv) > 1 else "ln"
    sizes = [int(a) for a in sys.argv[2:]] or [256, 1000, 4096, 8192, 65536, 262144]
    extras = [{}, {"NORM_WEIGHT_REGS": 0}] if os.environ.get("WEIGHT_REGS_VARIANT") else [{}]
    for hidden in sizes:
        p = nc.NormProblem(kind, "fwd", hidden, "bfloat16", "bfloat16", "bfloat16")
        configs = norm_tune.candidates(p, "default")
        for e in extras:
            EXTRA = e
            norms.precompile_configs(p, configs, workers=16)
        case = norm_tune._Case(p, norm_tune.default_rows(hidden))
        nbytes = 2 * case.rows * hidden * 2
        res = []
        for e in extras:
            EXTRA = e
            norms._fwd_plan.cache_clear()
            for c in configs:
                try:
                    run = case.runner(c)
                    err = case.error(run())
                    t = do_bench(run, reps=15, pad_host=True).median_ms
                    res.append((t, c.name + ("_wg" if e else ""), err))
                except Exception as exc:
                    print("fail", c.name, e, exc)
        EXTRA = {}
        norms._fwd_plan.cache_clear()
        tt = do_bench(case.torch_fn, reps=15, pad_host=True).median_ms
        res.sort()
        print(f"== {kind} fwd {hidden} heuristic {configs[0].name} eager {nbytes/tt/1e6:.0f} GB/s")
        for t, n, err in res[:6]:
            print(f"   {n:26s} {t*1e3:8.1f} us {nbytes/t/1e6:6.0f} GB/s err {err:.1e}")
        h = [r for r in res if r[1] == configs[0].name]
        if h:
            print(f"   heuristic {h[0][1]} {nbytes/h[0][0]/1e6:.0f} GB/s")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
