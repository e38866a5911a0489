"""LayerNorm / RMSNorm forward at hidden 262144 (8192 rows, bf16; HIDDEN overrides), configs
with extra -D values; prints the fraction of the copy bandwidth over four placements of w and b,
the grid's row units and the error against float32. Usage: ln262_sweep.py ln rms | lnh rmsh
(lnh / rmsh: the heuristic's config with the cluster-barrier reduction beside the default).

Earlier rounds (H200) ran experiment hooks since removed from the kernels:
  1. 3 stages with w in registers and b from global 0.71, w and b in registers 0.51 (spills),
     clusters of 16 (7 clusters fit) 0.57-0.59, against the heuristic's 0.870; RMSNorm 3 stages
     0.900 as 2.
  2/3. kernels for rows of exactly NORM_ITERS vectors (no bounds branch) -1% to -5%; split
     accumulators no change; two-FMA LayerNorm output +1%.
  4. with the copy addressing of e0e06a6: the two-FMA output 0.875 -> 0.888 (now the default).
"""
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
nc.NormConfig.defines = lambda self, p: {**_orig(self, p), **EXTRA}
# the four placements every round measured
FOUR = tuple(PLACEMENTS[i] for i in (0, 1, 3, 6))
SYNC = {"NORM_ASYNC_REDUCE": 0}
ITEMS = {  # round 5: the cluster reduction through st.async and mbarriers against barriers
    "ln": [("t512_r1_c8_v8_s2_m", {}), ("t512_r1_c8_v8_s2_m", SYNC)],
    "rms": [("t512_r1_c8_v8_s2", {}), ("t512_r1_c8_v8_s2", SYNC)],
}


def main():
    global EXTRA
    hidden = int(os.environ.get("HIDDEN", 262144))
    rows = 8192 if hidden >= 262144 else 32768
    copy = copy_bandwidth_gbs()
    print(f"copy {copy:.0f} GB/s", flush=True)
    for kind in sys.argv[1:] or ["ln", "rms"]:
        key = kind
        kind = kind.rstrip("h")
        p = nc.NormProblem(kind, "fwd", hidden, "bfloat16", "bfloat16", "bfloat16")
        # "lnh" / "rmsh": the heuristic's config with and without the FMA form
        heur = nc.heuristic(p).name
        items = ITEMS[key] if key in ITEMS else [(heur, {}), (heur, SYNC)]
        for name, extra in items:
            EXTRA = extra
            err = norms.precompile_configs(p, [nc.NormConfig.from_name(name)], workers=16)
            if err:
                print("build", name, extra, err)
        torch.manual_seed(1)
        x = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16)
        w = (1 + 0.1 * torch.randn(hidden, device="cuda")).to(torch.bfloat16)
        b = (0.1 * torch.randn(hidden, device="cuda")).to(torch.bfloat16)
        if kind == "ln":
            ref = F.layer_norm(x.float(), (hidden,), w.float(), b.float(), 1e-5)
        else:
            ref = F.rms_norm(x.float(), (hidden,), w.float(), 1e-5)
        nbytes = 2 * rows * hidden * 2
        buf = placement_buffer(hidden)

        def call(name, wv, bv):
            if kind == "ln":
                return norms._fwd_impl("ln", x, wv, bv, None, 1e-5, torch.bfloat16, name)[0]
            return norms._fwd_impl("rms", x, wv, None, None, 1e-5, torch.bfloat16, name)[0]

        print(f"== {kind} {hidden} rows {rows}", flush=True)
        for name, extra in items:
            EXTRA = extra
            norms._fwd_plan.cache_clear()
            try:
                y = call(name, w, b)
                e = ((y.float() - ref).norm() / ref.norm()).item()
                plan = norms._fwd_plan(kind, hidden, "bfloat16", "bfloat16", "bfloat16", True,
                                       False, name, 0)
                fs = []
                for w_off, gap in FOUR:
                    wv, bv = place(buf, w, b, w_off, gap)
                    t = do_bench(lambda: call(name, wv, bv), reps=20, pad_host=True).median_ms
                    fs.append(nbytes / t / 1e6 / copy)
                print(f"   {name:22s} {str(extra):28s} units {plan.max_units:4d} min {min(fs):.3f}"
                      f" max {max(fs):.3f} err {e:.1e}: " + " ".join(f"{f:.3f}" for f in fs),
                      flush=True)
            except Exception as exc:  # noqa: BLE001
                print("fail", name, extra, str(exc)[:300], flush=True)
        x = ref = None
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
