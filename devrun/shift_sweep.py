"""LayerNorm forward, staged candidates (256 to 1024 threads, up to 3 stages) with the shift
staged with the row (NORM_STAGED_SHIFT=1, the default) and loaded per row (0), w and b placed
as benchmarks/norms.py allocates them; then the best few over eight placements. Prints the
fraction of the copy bandwidth and the error against float32. Usage: shift_sweep.py HIDDEN..."""
import os
import sys
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from benchmarks.common import copy_bandwidth_gbs  # noqa: E402
from custom_kernels import norm_config as nc, norms  # noqa: E402
from tuning.timing import do_bench  # noqa: E402
sys.path.insert(0, str(Path(__file__).resolve().parent))
from wb_placement import PLACEMENTS, place, placement_buffer  # noqa: E402

EXTRA = {}
_orig = nc.NormConfig.defines
nc.NormConfig.defines = lambda self, p: {**_orig(self, p), **(EXTRA if self.stages else {})}


def main():
    global EXTRA
    copy = copy_bandwidth_gbs()
    print(f"copy {copy:.0f} GB/s")
    for hidden in [int(a) for a in sys.argv[1:]]:
        p = nc.NormProblem("ln", "fwd", hidden, "bfloat16", "bfloat16", "bfloat16")
        heur = nc.heuristic(p)
        configs = [heur] + [c for c in nc.space(p) if c.stages and c != heur and
                            c.threads >= 256 and c.stages <= 3]
        if os.environ.get("CONFIGS"):  # a comma list instead
            configs = [heur] + [nc.NormConfig.from_name(n)
                                for n in os.environ["CONFIGS"].split(",") if n != heur.name]
        for v in (1, 0):
            EXTRA = {"NORM_STAGED_SHIFT": v}
            norms.precompile_configs(p, configs, workers=16)
        rows = 8192 if hidden >= 262144 else 32768
        nbytes = 2 * rows * hidden * 2 + 4 * hidden
        torch.manual_seed(hidden)
        x = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16)
        w = (1 + 0.1 * torch.randn(hidden, device="cuda")).to(torch.bfloat16)
        b = (0.1 * torch.randn(hidden, device="cuda")).to(torch.bfloat16)
        ref = F.layer_norm(x.float(), (hidden,), w.float(), b.float(), 1e-5)

        def frac(name, w, b):
            f = lambda: norms._fwd_impl("ln", x, w, b, None, 1e-5, torch.bfloat16, name)  # noqa
            return nbytes / do_bench(f, reps=20, pad_host=True).median_ms / 1e6 / copy

        res = []
        for v in (1, 0):
            EXTRA = {"NORM_STAGED_SHIFT": v}
            norms._fwd_plan.cache_clear()
            for c in configs:
                try:
                    y = norms._fwd_impl("ln", x, w, b, None, 1e-5, torch.bfloat16, c.name)[0]
                    err = ((y.float() - ref).norm() / ref.norm()).item()
                    res.append((frac(c.name, w, b), c.name, v, err))
                except Exception as exc:  # noqa: BLE001
                    print("fail", c.name, v, exc)
        res.sort(reverse=True)
        print(f"== ln {hidden} rows {rows} heuristic {heur.name} (benchmark placement)")
        for f, n, v, err in res[:10]:
            print(f"   {n:24s} shift staged {v} {f:.3f} err {err:.1e}")
        for f, n, v, err in res:
            if n == heur.name:
                print(f"   heuristic {n} shift staged {v} {f:.3f} err {err:.1e}")
        top = [(n, v) for _, n, v, _ in res[:3]] + [(heur.name, 1), (heur.name, 0)]
        buf = placement_buffer(hidden)
        table = {}
        for w_off, gap in PLACEMENTS:
            wv, bv = place(buf, w, b, w_off, gap)
            for n, v in dict.fromkeys(top):
                EXTRA = {"NORM_STAGED_SHIFT": v}
                norms._fwd_plan.cache_clear()
                table.setdefault((n, v), []).append(frac(n, wv, bv))
        for (n, v), fs in table.items():
            print(f"   placements {n:24s} shift {v} min {min(fs):.3f} max {max(fs):.3f}: "
                  + " ".join(f"{f:.3f}" for f in fs))
        sys.stdout.flush()
        del x, ref
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
