"""Short-row forward, this checkout's kernels against another csrc directory (argument), each
against torch.compile in the same process: python devrun/ab_short.py [CSRC_DIR]."""
import sys
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from custom_kernels import jit  # noqa: E402
if len(sys.argv) > 1:
    jit.CSRC = Path(sys.argv[1]).resolve()
    jit.include_dirs.cache_clear()
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from custom_kernels import norms  # noqa: E402
from tuning.timing import do_bench_interleaved  # noqa: E402

tag = sys.argv[1] if len(sys.argv) > 1 else "this checkout"
for kind in ("rms", "ln"):
    for hidden in (256, 1000):
        x = torch.randn(32768, hidden, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(hidden, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(hidden, device="cuda", dtype=torch.bfloat16)
        if kind == "rms":
            ours = lambda: norms._fwd_impl("rms", x, w, None, None, 1e-6,  # noqa: E731
                                           torch.bfloat16, None, stats=False)
            tc = torch.compile(lambda: F.rms_norm(x, (hidden,), w, 1e-6))
        else:
            ours = lambda: norms._fwd_impl("ln", x, w, b, None, 1e-6,  # noqa: E731
                                           torch.bfloat16, None, stats=False)
            tc = torch.compile(lambda: F.layer_norm(x, (hidden,), w, b, 1e-6))
        t = do_bench_interleaved({"ours": ours, "tc": tc}, reps=200, pad_host=True)
        ours_ms, tc_ms = t["ours"].median_ms, t["tc"].median_ms
        print(f"{tag:20s} {kind} {hidden}: ours {ours_ms * 1e3:.2f} us, "
              f"torch.compile {tc_ms * 1e3:.2f} us, x{tc_ms / ours_ms:.3f}", flush=True)
