"""Same kernel, same x and values, w and b at different addresses (views into one buffer, b
`gap` bytes after w's end): is LayerNorm's long-row speed a matter of where its weights sit?"""
import sys
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import torch  # noqa: E402
from benchmarks.common import copy_bandwidth_gbs  # noqa: E402
from custom_kernels import norms  # noqa: E402
from tuning.timing import do_bench  # noqa: E402

copy = copy_bandwidth_gbs()
hidden, kind = int(sys.argv[1]), sys.argv[2]
cfgs = [c if c != "-" else None for c in sys.argv[3:]] or [None]
rows = 8192 if hidden >= 262144 else 32768
nbytes = 2 * rows * hidden * 2 + 4 * hidden
x = torch.randn(rows, hidden, device="cuda").to(torch.bfloat16)
wv = (1 + 0.1 * torch.randn(hidden, device="cuda")).to(torch.bfloat16)
bv = (0.1 * torch.randn(hidden, device="cuda")).to(torch.bfloat16)
buf = torch.empty(4 * hidden + (1 << 20), dtype=torch.bfloat16, device="cuda")
print(f"buf at {buf.data_ptr():#x}")
for (w_off, gap), cfg in ((p, c) for p in (
        (0, 0), (64, 0), (512, 0), (0, 1024), (0, 4096), (0, 65536), (0, 1 << 19),
        (2048, 8192), (1 << 18, 0), (4096, 3 << 16), (1 << 16, 7 << 16), (384, 100000))
        for c in cfgs):
    wo = w_off // 2
    w = buf[wo:wo + hidden]
    bo = wo + hidden + gap // 2
    b = buf[bo:bo + hidden] if kind == "ln" else None
    w.copy_(wv)
    if b is not None:
        b.copy_(bv)
    f = lambda: norms._fwd_impl(kind, x, w, b, None, 1e-5, torch.bfloat16, cfg)  # noqa: E731
    t = do_bench(f, reps=20, pad_host=True).median_ms
    print(f"{kind} {hidden} {cfg} w at +{w_off} B, b {gap} B after w: "
          f"{nbytes / t / 1e6 / copy:.3f}")
    sys.stdout.flush()
