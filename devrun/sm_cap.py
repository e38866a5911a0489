"""Is the long-row forward capped by the SMs it occupies? Clusters of 8 of 512-thread blocks fit
15 at once on an H200 (120 of 132 SMs). Times, as fractions of the copy bandwidth over two w/b
placements: the 65536 and 262144 heuristic configs with their grid cut to fewer row units, and
262144 splits that occupy other SM counts (clusters of 16 with two 256-thread blocks an SM,
clusters of 4 of 1024 threads). Prints each config's resident row units.
H200, before bee0a25's alignment fix: 65536 lost with fewer units (RMSNorm 0.925 / 0.914 /
0.891 at 66 / 60 / 54), but at 262144 14 clusters beat 15 (LayerNorm 0.906 against 0.890,
RMSNorm 0.915 against 0.898; 13: 0.878); clusters of 16 with two 256-thread blocks an SM (14
units) 0.84-0.85, clusters of 4 of 1024 threads (one stage, w/b from L2) 0.72-0.82."""
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

CAP = {"units": None}
_orig_max_units = norms._max_units
norms._max_units = lambda *a: min(_orig_max_units(*a), CAP["units"] or 1 << 30)
ITEMS = [  # (kind, hidden, config, unit caps)
    ("rms", 65536, "t512_r1_c2_v8_s2", (None, 60, 54)),
    ("ln", 65536, "t512_r1_c2_v8_s2_m", (None, 60, 54)),
    ("rms", 262144, "t512_r1_c8_v8_s2", (None, 14, 13)),
    ("ln", 262144, "t512_r1_c8_v8_s2_m", (None, 14, 13)),
    ("rms", 262144, "t256_r1_c16_v8_s2", (None,)),
    ("ln", 262144, "t256_r1_c16_v8_s2_m", (None,)),
    ("rms", 262144, "t1024_r1_c4_v8_s1", (None,)),
    ("ln", 262144, "t1024_r1_c4_v8_s1", (None,)),
]


def main():
    copy = copy_bandwidth_gbs()
    print(f"copy {copy:.0f} GB/s", flush=True)
    for kind, hidden, name, caps in ITEMS:
        rows = 8192 if hidden >= 262144 else 32768
        p = nc.NormProblem(kind, "fwd", hidden, "bfloat16", "bfloat16", "bfloat16")
        err = norms.precompile_configs(p, [nc.NormConfig.from_name(name)], workers=16)
        if err:
            print("build", name, err, flush=True)
            continue
        torch.manual_seed(1)
        x = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16)
        w = (1 + 0.1 * torch.randn(hidden, device="cuda")).to(torch.bfloat16)
        b = (0.1 * torch.randn(hidden, device="cuda")).to(torch.bfloat16) if kind == "ln" \
            else None
        ref = F.layer_norm(x.float(), (hidden,), w.float(), b.float(), 1e-5) if kind == "ln" \
            else F.rms_norm(x.float(), (hidden,), w.float(), 1e-5)
        nbytes = 2 * rows * hidden * 2
        buf = placement_buffer(hidden)
        for cap in caps:
            CAP["units"] = cap
            norms._fwd_plan.cache_clear()
            try:
                def call(wv, bv):
                    return norms._fwd_impl(kind, x, wv, bv, None, 1e-5, torch.bfloat16, name)[0]
                y = call(w, b)
                e = ((y.float() - ref).norm() / ref.norm()).item()
                plan = norms._fwd_plan(kind, hidden, "bfloat16", "bfloat16", "bfloat16", True,
                                       False, name, 0)
                fs = []
                for w_off, gap in (PLACEMENTS[0], PLACEMENTS[3]):
                    wv, bv = place(buf, w, b, w_off, gap)
                    t = do_bench(lambda: call(wv, bv), reps=20, pad_host=True).median_ms
                    fs.append(nbytes / t / 1e6 / copy)
                print(f"{kind:3s} {hidden:6d} {name:22s} units {plan.max_units:4d} "
                      f"persistent {int(plan.persistent)} blocks {plan.blocks(rows):5d} "
                      f"frac {' '.join(f'{f:.3f}' for f in fs)} err {e:.1e}", flush=True)
            except Exception as exc:  # noqa: BLE001
                print("fail", kind, hidden, name, cap, str(exc)[:300], flush=True)
        x = ref = y = None
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
