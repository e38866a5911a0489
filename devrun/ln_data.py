"""LayerNorm 32768 speed against the values of w and b (the tuner's case draws w = 1 + 0.5 N,
b = N; the benchmark w = 1 + 0.1 N, b = 0.1 N): same kernel, same placement, other data."""
import subprocess
import sys
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import torch  # noqa: E402
from benchmarks.common import copy_bandwidth_gbs  # noqa: E402
from custom_kernels import norms  # noqa: E402
from tuning.timing import do_bench  # noqa: E402

copy = copy_bandwidth_gbs()
hidden = int(sys.argv[1])
kind = sys.argv[2]
cfgs = sys.argv[3:] or [None]
rows = 8192 if hidden >= 262144 else 32768
nbytes = 2 * rows * hidden * 2 + 4 * hidden
x = torch.randn(rows, hidden, device="cuda").to(torch.bfloat16)
n = torch.randn(hidden, device="cuda")
n2 = torch.randn(hidden, device="cuda")
for cfg in cfgs:
    for ws, bs, xs in ((0.1, 0.1, 1), (0.5, 1.0, 1), (0.5, 0.1, 1), (0.1, 1.0, 1), (0.0, 0.0, 1),
                       (0.1, 0.1, 0.01), (0.1, 0.1, 100)):
        w = (1 + ws * n).to(torch.bfloat16)
        b = (bs * n2).to(torch.bfloat16)
        xx = (x * xs) if xs != 1 else x
        f = (lambda: norms._fwd_impl("ln", xx, w, b, None, 1e-5, torch.bfloat16, cfg)) \
            if kind == "ln" else \
            (lambda: norms._fwd_impl("rms", xx, w, None, None, 1e-5, torch.bfloat16, cfg))
        t = do_bench(f, reps=20, pad_host=True).median_ms
        print(f"{kind} {hidden} {cfg} w 1+{ws}N b {bs}N x*{xs}: {nbytes / t / 1e6 / copy:.3f}")
        sys.stdout.flush()
print(subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm,clocks.mem,power.draw,power.limit,"
                      "temperature.gpu,clocks_throttle_reasons.active", "--format=csv"],
                     capture_output=True, text=True).stdout)
