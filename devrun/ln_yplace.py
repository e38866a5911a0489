"""Same kernel, same data, y in different allocations: y lands in a fresh block each trial
(earlier blocks held by dummies). Prints y - x and the fraction of copy."""
import sys
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import torch  # noqa: E402
from benchmarks.common import copy_bandwidth_gbs  # noqa: E402
from custom_kernels import norms  # noqa: E402
from tuning.timing import do_bench  # noqa: E402

copy = copy_bandwidth_gbs()
hidden, kind = int(sys.argv[1]), sys.argv[2]
cfg = sys.argv[3] if len(sys.argv) > 3 and sys.argv[3] != "-" else None
trials = int(sys.argv[4]) if len(sys.argv) > 4 else 8
rows = 8192 if hidden >= 262144 else 32768
nbytes = 2 * rows * hidden * 2 + 4 * hidden
x = torch.randn(rows, hidden, device="cuda").to(torch.bfloat16)
w = (1 + 0.1 * torch.randn(hidden, device="cuda")).to(torch.bfloat16)
b = (0.1 * torch.randn(hidden, device="cuda")).to(torch.bfloat16) if kind == "ln" else None
held = []
for trial in range(trials):
    f = lambda: norms._fwd_impl(kind, x, w, b, None, 1e-5, torch.bfloat16, cfg)  # noqa: E731
    y = f()[0]
    d = y.data_ptr() - x.data_ptr()
    del y
    t = do_bench(f, reps=20, pad_host=True).median_ms
    y2 = f()[0]
    same = y2.data_ptr() - x.data_ptr() == d
    print(f"{kind} {hidden} {cfg} trial {trial}: y-x {d / 2**20:+10.1f} MiB (same block {same}) "
          f"{nbytes / t / 1e6 / copy:.3f}")
    sys.stdout.flush()
    held.append(y2)  # the next trial's y comes from another block
