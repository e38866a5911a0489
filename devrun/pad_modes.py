"""How to time small GEMMs without the host's launch cost (H100 finding at 0d600ba: torch.matmul at
16/128x4096x4096 timed 26-36 us after the L2 flush, 22.5 us with a 200 us spin before it; but the
spin made 1024x14336x4096 and 4096^3 3% slower). Times torch.matmul per shape, interleaved round by
round, in four modes: plain (flush, events, call), a 200 us spin, a 30 us spin, and the call
captured in a CUDA graph and replayed (host cost of one graph launch).

H100 at 0d600ba, median of 8 rounds in us (min-max): 16x4096x4096 plain 22.7 (22.1-25.0), spin200
22.8, spin30 22.9, graph 23.1 (23.0-23.2); 128x4096x4096 plain 22.6 (22.0-41.1), the others
22.4-22.5 (range 0.4); 1024x4096x4096 all 48.5-48.9; 1024x14336x4096 plain 161.5, spin200 170.6,
spin30 165.0, graph 160.0; 4096^3 plain 182.5, spin200 190.4, spin30 183.9, graph 180.3. So the
graph replays remove the host stalls and leave the long kernels' times as they were; the spins
slow them (the tuner times replays since)."""
import statistics
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1])]

import torch  # noqa: E402

from tuning.timing import _flush_buffer  # noqa: E402

SHAPES = [(16, 4096, 4096), (128, 4096, 4096), (16, 14336, 4096), (1024, 4096, 4096),
          (1024, 14336, 4096), (4096, 4096, 4096)]
MODES = {"plain": 0, "spin200": 400_000, "spin30": 60_000, "graph": 0}


def bench(fn, spin, reps=60):
    flush = _flush_buffer(torch.cuda.current_device())
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
          for _ in range(reps)]
    for s, e in ev:
        flush.zero_()
        if spin:
            torch.cuda._sleep(spin)
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in ev) * 1e3


torch.manual_seed(0)
res = {(s, m): [] for s in SHAPES for m in MODES}
for s in SHAPES:
    x = torch.randn(s[0], s[2], device="cuda", dtype=torch.bfloat16)
    w = torch.randn(s[1], s[2], device="cuda", dtype=torch.bfloat16)
    call = lambda: torch.matmul(x, w.t())  # noqa: E731
    call()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        call()
    for _ in range(8):
        for m, spin in MODES.items():
            res[s, m].append(bench(g.replay if m == "graph" else call, spin))
print(torch.cuda.get_device_name(), torch.__version__)
for s in SHAPES:
    print("x".join(map(str, s)), " | ".join(
        f"{m} {statistics.median(res[s, m]):.1f} [{min(res[s, m]):.1f}-{max(res[s, m]):.1f}]"
        for m in MODES))
