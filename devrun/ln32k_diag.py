"""Why LayerNorm at hidden 32768 measures 0.936 of copy in long_sweep.py and 0.896 in
benchmarks/norms.py: the same kernel timed in each context."""
import sys
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from benchmarks.common import copy_bandwidth_gbs  # noqa: E402
from custom_kernels import norms  # noqa: E402
from tuning.timing import do_bench, do_bench_interleaved  # noqa: E402

EPS = 1e-6
copy = copy_bandwidth_gbs()
print(f"copy {copy:.0f}")
for hidden in [int(a) for a in sys.argv[1:]]:
    rows = 8192 if hidden >= 262144 else 32768
    torch.manual_seed(hidden)
    x = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16)
    w = (1 + 0.1 * torch.randn(hidden, device="cuda")).to(torch.bfloat16)
    b = (0.1 * torch.randn(hidden, device="cuda")).to(torch.bfloat16)
    nbytes = 2 * rows * hidden * 2 + 4 * hidden

    def frac(ms):
        return f"{ms*1e3:7.1f} us {nbytes/ms/1e6/copy:.3f}"

    def ours():
        return norms.layer_norm(x, w, b, EPS)

    def tfn(x, w, b):
        return F.layer_norm(x, (hidden,), w, b, EPS)
    tc = torch.compile(tfn, dynamic=False)
    tcall = lambda: tc(x, w, b)  # noqa: E731
    eager = lambda: tfn(x, w, b)  # noqa: E731
    cfgs = ["t512_r1_c1_v8_s1", "t1024_r1_c1_v8_s1", "t1024_r1_c1_v8_s2", "t256_r1_c2_v8_s1",
            "t512_r1_c2_v8_s1", "t512_r1_c8_v8_s1", "t256_r1_c16_v8_s1"]
    named = {c: (lambda c=c: norms._fwd_impl("ln", x, w, b, None, EPS, torch.bfloat16, c))
             for c in cfgs}
    for c, f in list(named.items()):
        try:
            f()
        except Exception as exc:
            print("skip", c, exc)
            named.pop(c)
    print(f"== ln {hidden}")
    for label, table in (("bench-like ours/tc/eager", {"ours": ours, "tc": tcall, "eager": eager}),
                         ("ours/tc", {"ours": ours, "tc": tcall}),
                         ("ours alone interleaved", {"ours": ours}),
                         ("configs interleaved", named),
                         ("bench-like again", {"ours": ours, "tc": tcall, "eager": eager})):
        t = do_bench_interleaved(table, reps=30, pad_host=True)
        print(f"  {label}: " + ", ".join(f"{k} {frac(v.median_ms)}" for k, v in t.items()))
    for c, f in named.items():
        print(f"  do_bench {c}: {frac(do_bench(f, reps=30, pad_host=True).median_ms)}")
    print(f"  do_bench ours: {frac(do_bench(ours, reps=30, pad_host=True).median_ms)}")
    sys.stdout.flush()
