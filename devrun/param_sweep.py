"""Forward long rows: the heuristic's config against every `_m` config (parameters in shared
memory), first with w and b placed as benchmarks/norms.py allocates them, then the best few
again over eight placements of w and b (views into one buffer, ln_wplace.py's worst included).
Prints fraction of the copy bandwidth. Usage: param_sweep.py ln|rms HIDDEN..."""
import sys
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import torch  # noqa: E402
from benchmarks.common import copy_bandwidth_gbs  # noqa: E402
from custom_kernels import norm_config as nc, norms  # noqa: E402
from tuning.timing import do_bench  # noqa: E402
sys.path.insert(0, str(Path(__file__).resolve().parent))
from wb_placement import PLACEMENTS, place, placement_buffer  # noqa: E402



def main():
    copy = copy_bandwidth_gbs()
    kind = sys.argv[1]
    print(f"copy {copy:.0f} GB/s")
    for hidden in [int(a) for a in sys.argv[2:]]:
        p = nc.NormProblem(kind, "fwd", hidden, "bfloat16", "bfloat16", "bfloat16")
        heur = nc.heuristic(p)
        configs = [heur] + [c for c in nc.space(p) if c.param_smem and c != heur]
        failed = norms.precompile_configs(p, configs, workers=16)
        configs = [c for c in configs if c.name not in failed]
        rows = 8192 if hidden >= 262144 else 32768
        nbytes = 2 * rows * hidden * 2 + 4 * hidden
        torch.manual_seed(hidden)
        x = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16)
        w = (1 + 0.1 * torch.randn(hidden, device="cuda")).to(torch.bfloat16)
        b = (0.1 * torch.randn(hidden, device="cuda")).to(torch.bfloat16) if kind == "ln" else None
        ref = norms._fwd_impl(kind, x, w, b, None, 1e-5, torch.bfloat16, heur.name)[0]

        def frac(cfg, w, b):
            f = lambda: norms._fwd_impl(kind, x, w, b, None, 1e-5, torch.bfloat16, cfg)  # noqa
            return nbytes / do_bench(f, reps=20, pad_host=True).median_ms / 1e6 / copy

        res = []
        for c in configs:
            try:
                y = norms._fwd_impl(kind, x, w, b, None, 1e-5, torch.bfloat16, c.name)[0]
                same = torch.equal(y, ref)
                res.append((frac(c.name, w, b), c.name, same))
            except Exception as exc:  # noqa: BLE001
                print("fail", c.name, exc)
        res.sort(reverse=True)
        print(f"== {kind} {hidden} rows {rows} heuristic {heur.name} (benchmark placement)")
        for f, n, same in res[:8]:
            print(f"   {n:24s} {f:.3f} {'same as heuristic' if same else 'DIFFERS'}")
        print(f"   heuristic {heur.name} {[r[0] for r in res if r[1] == heur.name][0]:.3f}")
        top = [n for _, n, _ in res[:4]]
        if heur.name not in top:
            top.append(heur.name)
        buf = placement_buffer(hidden)
        table = {n: [] for n in top}
        for w_off, gap in PLACEMENTS:
            wv, bv = place(buf, w, b, w_off, gap)
            for n in top:
                table[n].append(frac(n, wv, bv))
        for n, fs in table.items():
            print(f"   placements {n:24s} min {min(fs):.3f} max {max(fs):.3f}: "
                  + " ".join(f"{f:.3f}" for f in fs))
        sys.stdout.flush()
        del x, ref
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
