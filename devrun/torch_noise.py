"""Is torch.matmul's time at a 4096x4096 weight bimodal? The H100 warm re-tune at 0d600ba recorded
torch.matmul 25-35% slower at 128x4096x4096 and 1024x4096x4096 than the benchmark process did a
minute later (other shapes agreed within 2%). Times torch.matmul (x @ W^T, the benchmark's call)
with tuning.timing.do_bench, 12 rounds of 60 reps per shape, cycling through the shapes as a tune
does, and prints every round's median: one process, no CUTLASS kernel involved.

H100 at 0d600ba, two processes: 16x4096x4096 plain 28-34 us a round in the first, 26-37 in the
second, 22.5-24.0 with pad_host; 128x4096x4096 plain 25-30 / 22.5-31, padded 22.4-22.7; the
shapes of 48 us and more agree within 1% plain or padded (the 200 us pad slows 1024x14336x4096
by 3% and 4096^3 by 2-3%)."""
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1])]

import torch  # noqa: E402

from tuning.timing import do_bench  # noqa: E402

SHAPES = [(16, 4096, 4096), (128, 4096, 4096), (128, 14336, 4096), (1024, 4096, 4096),
          (1024, 14336, 4096), (4096, 4096, 4096)]
torch.manual_seed(0)
data = {s: (torch.randn(s[0], s[2], device="cuda", dtype=torch.bfloat16),
            torch.randn(s[1], s[2], device="cuda", dtype=torch.bfloat16)) for s in SHAPES}
rounds = {s: [] for s in SHAPES}
padded = {s: [] for s in SHAPES}
for _ in range(12):
    for s, (x, w) in data.items():
        rounds[s].append(do_bench(lambda: torch.matmul(x, w.t()), reps=60).median_ms * 1e3)
        padded[s].append(do_bench(lambda: torch.matmul(x, w.t()), reps=60,
                                  pad_host=True).median_ms * 1e3)
print(torch.cuda.get_device_name(), torch.__version__)
for s in SHAPES:
    print("x".join(map(str, s)), "plain us:", " ".join(f"{v:.1f}" for v in rounds[s]))
    print("x".join(map(str, s)), "pad   us:", " ".join(f"{v:.1f}" for v in padded[s]))
