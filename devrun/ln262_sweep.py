"""LayerNorm / RMSNorm forward at hidden 262144 (8192 rows, bf16): pipeline depth and parameter
homes. Each item is a config with extra -D values (NORM_WEIGHT_REGS=1: w and b in registers,
NORM_WEIGHT_ALONE=1: the weight in registers and the bias from global); prints the fraction of
the copy bandwidth over four placements of w and b, the grid's row units and the error."""
import os
import sys
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from benchmarks.common import copy_bandwidth_gbs  # noqa: E402
from custom_kernels import norm_config as nc, norms  # noqa: E402
from tuning.timing import do_bench  # noqa: E402

EXTRA = {}
_orig = nc.NormConfig.defines
nc.NormConfig.defines = lambda self, p: {**_orig(self, p), **EXTRA}
PLACEMENTS = ((0, 0), (64, 0), (0, 65536), (4096, 3 << 16))
A = {"NORM_WEIGHT_ALONE": 1}
R = {"NORM_WEIGHT_REGS": 1}
FMA = {"NORM_FMA_FORM": 1}
FULL = {"NORM_FULL_ROW": 1}
SPLIT = {"NORM_SPLIT_ACC": 1}
SYNC = {"NORM_ASYNC_REDUCE": 0}
ITEMS = {  # round 1 (H200): every one of these but the heuristic's lost 15 to 40%
    "ln1": [("t512_r1_c8_v8_s2_m", {}), ("t512_r1_c8_v8_s3", A), ("t512_r1_c8_v8_s3", {}),
            ("t512_r1_c8_v8_s3", R), ("t512_r1_c8_v8_s2", A), ("t512_r1_c16_v8_s3", R),
            ("t512_r1_c16_v8_s4", R), ("t512_r1_c16_v8_s4_m", {}), ("t256_r1_c16_v8_s4_m", {})],
    "rms1": [("t512_r1_c8_v8_s2", {}), ("t512_r1_c8_v8_s3", {}), ("t512_r1_c16_v8_s4", {}),
             ("t512_r1_c16_v8_s3", {})],
    # round 3 (H200): NORM_FULL_ROW lost 1-5% everywhere (ptxas hoists loads across vectors);
    # NORM_FMA_FORM gained 1% at LayerNorm 262144
    "ln3": [("t512_r1_c8_v8_s2_m", {}), ("t512_r1_c8_v8_s2_m", FULL),
            ("t512_r1_c8_v8_s2_m", {**FULL, **FMA}),
            ("t512_r1_c8_v8_s2_m", {**FULL, **FMA, **SPLIT}),
            ("t512_r1_c8_v8_s2_m", FMA), ("t1024_r1_c8_v8_s2_m", {**FULL, **FMA})],
    "rms3": [("t512_r1_c8_v8_s2", {}), ("t512_r1_c8_v8_s2", FULL),
             ("t512_r1_c8_v8_s2", {**FULL, **SPLIT}), ("t1024_r1_c8_v8_s2", FULL)],
    # round 4 (H200): NORM_FMA_FORM 0.875 -> 0.888 at LayerNorm 262144 (now the default)
    "ln4": [("t512_r1_c8_v8_s2_m", {}), ("t512_r1_c8_v8_s2_m", FMA),
            ("t512_r1_c8_v8_s2_m", {**FMA, **SPLIT})],
    "rms4": [("t512_r1_c8_v8_s2", {}), ("t512_r1_c8_v8_s2", SPLIT)],
    # round 5: the cluster reduction through st.async and mbarriers against cluster barriers
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
        kind = kind.rstrip("1h")
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
        buf = torch.empty(4 * hidden + (1 << 20), dtype=torch.bfloat16, device="cuda")

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
                for w_off, gap in PLACEMENTS:
                    wo = w_off // 2
                    wv = buf[wo:wo + hidden]
                    wv.copy_(w)
                    bo = wo + hidden + gap // 2
                    bv = buf[bo:bo + hidden]
                    bv.copy_(b)
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
