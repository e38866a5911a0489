"""Fused RMSNorm (custom_kernels.norms) forward and backward against torch.compile, bf16.

    python benchmarks/norms.py [--quick] [--plot]

Rows: bf16, 32768 rows (8192 at hidden 262144), hidden 256 .. 262144, forward and backward.
GB/s count the minimum bytes: forward x read + y written + weight read; backward x and dy read,
dx written, rstd read, weight read and dweight written. The reference (the issue's) is
torch.compile of F.rms_norm; torch eager and QuACK (when importable) go in ``detail``, all timed
in the same interleaved rounds (tuning.timing.do_bench_interleaved, L2 flushed before each).
Backward times ``torch.autograd.grad`` over a retained graph, the same way for every contender.
Each row carries its correctness check (ours against the float32 reference) and the fraction of
the copy bandwidth measured in the same run. Writes benchmarks/results/norms.json (norms_quick
with --quick) and, with --plot and matplotlib, norms.png beside it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from benchmarks.common import RESULTS, copy_bandwidth_gbs, print_table, write_result  # noqa: E402
from custom_kernels import norms  # noqa: E402
from custom_kernels import norm_config as nc  # noqa: E402
from tuning.timing import do_bench_interleaved  # noqa: E402

HIDDEN = [256, 1000, 4096, 8192, 32768, 65536, 262144]
QUICK_HIDDEN = [1000, 8192, 65536, 262144]
EPS = 1e-6


def rows_for(hidden: int) -> int:
    return 8192 if hidden >= 262144 else 32768


def contenders(hidden):
    """name -> forward function (x, w) -> y; ours first, the reference second."""
    def torch_rms(x, w):
        return F.rms_norm(x, (hidden,), w, EPS)

    fns = {"ours": lambda x, w: norms.rms_norm(x, w, EPS),
           "torch.compile": torch.compile(torch_rms, dynamic=False),
           "torch eager": torch_rms}
    try:
        from quack.rmsnorm import rmsnorm as quack_rmsnorm

        fns["quack"] = lambda x, w: quack_rmsnorm(x, w, eps=EPS)
    except Exception:  # not installed, or another API: the row says so by omission
        pass
    return fns


def bytes_moved(rows, hidden, direction, itemsize=2):
    if direction == "fwd":
        return 2 * rows * hidden * itemsize + hidden * itemsize
    return 3 * rows * hidden * itemsize + rows * 4 + 2 * hidden * itemsize


def check(x, w, dy) -> bool:
    xg = x.detach().requires_grad_()
    wg = w.detach().requires_grad_()
    y = norms.rms_norm(xg, wg, EPS)
    dx, dw = torch.autograd.grad(y, (xg, wg), dy)
    xf = x.detach().float().requires_grad_()
    wf = w.detach().float().requires_grad_()
    ry = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS) * wf
    rdx, rdw = torch.autograd.grad(ry, (xf, wf), dy.float())

    def rel(a, b):
        return ((a.float() - b).norm() / b.norm()).item()

    return max(rel(y, ry), rel(dx, rdx), rel(dw, rdw)) < 2e-2


def measure(hidden: int, reps: int, copy_gbs: float) -> list[dict]:
    rows = rows_for(hidden)
    torch.manual_seed(hidden)
    x = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16)
    w = (1 + 0.1 * torch.randn(hidden, device="cuda")).to(torch.bfloat16)
    dy = torch.randn_like(x)
    correct = check(x, w, dy)
    fns = contenders(hidden)
    fwd = {name: (lambda f=f: f(x, w)) for name, f in fns.items()}
    bwd = {}
    for name, f in fns.items():
        xg, wg = x.detach().requires_grad_(), w.detach().requires_grad_()
        try:
            y = f(xg, wg)
        except Exception as exc:  # a contender that cannot run this size is left out
            print(f"  {name} failed at hidden {hidden}: {exc}", file=sys.stderr)
            fwd.pop(name)
            continue
        bwd[name] = (lambda y=y, xg=xg, wg=wg:
                     torch.autograd.grad(y, (xg, wg), dy, retain_graph=True))
    out = []
    for direction, table in (("fwd", fwd), ("bwd", bwd)):
        timings = do_bench_interleaved(table, reps=reps)
        nbytes = bytes_moved(rows, hidden, direction)
        gbs = {name: nbytes / t.median_ms / 1e6 for name, t in timings.items()}
        ours, ref = gbs["ours"], gbs["torch.compile"]
        out.append({
            "case": f"bf16 rms_norm {direction} rows={rows} hidden={hidden}",
            "hidden": hidden, "direction": direction, "unit": "GB/s",
            "ours": round(ours, 1), "reference": round(ref, 1),
            "reference_name": "torch.compile(F.rms_norm)", "ratio": round(ours / ref, 4),
            "correct": correct,
            "detail": {**{name: round(v, 1) for name, v in gbs.items()
                          if name not in ("ours", "torch.compile")},
                       "ours_ms": round(timings["ours"].median_ms, 4),
                       "reference_ms": round(timings["torch.compile"].median_ms, 4),
                       "fraction_of_copy_bandwidth": round(ours / copy_gbs, 4),
                       "config": nc.heuristic(nc.NormProblem(
                           "rms", direction, hidden, "bfloat16", "bfloat16", "bfloat16")).name},
        })
    return out


def plot(rows: list[dict], path: Path, copy_gbs: float) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot", file=sys.stderr)
        return
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    for ax, direction in zip(axes, ("fwd", "bwd")):
        sel = [r for r in rows if r["direction"] == direction]
        hs = [r["hidden"] for r in sel]
        series = {"ours": [r["ours"] for r in sel],
                  "torch.compile": [r["reference"] for r in sel]}
        for name in ("torch eager", "quack"):
            if all(name in r["detail"] for r in sel):
                series[name] = [r["detail"][name] for r in sel]
        for name, values in series.items():
            ax.plot(hs, values, marker="o", label=name)
        ax.axhline(copy_gbs, color="gray", linestyle="--", label="copy")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("hidden")
        ax.set_title(f"bf16 RMSNorm {direction}")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("GB/s")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help=f"hidden {QUICK_HIDDEN} only")
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--plot", action="store_true", help="also write norms.png")
    args = parser.parse_args()
    hidden_sizes = QUICK_HIDDEN if args.quick else HIDDEN
    problems = [nc.NormProblem("rms", d, h, "bfloat16", "bfloat16", "bfloat16")
                for h in hidden_sizes for d in nc.DIRECTIONS]
    norms.precompile(problems)
    copy_gbs = copy_bandwidth_gbs()
    rows = []
    for hidden in hidden_sizes:
        rows += measure(hidden, args.reps, copy_gbs)
        torch.cuda.empty_cache()
    print(f"copy bandwidth {copy_gbs:.0f} GB/s")
    print_table(["case", "ours GB/s", "torch.compile", "ratio", "of copy", "eager", "quack", "ok"],
                [[r["case"], r["ours"], r["reference"], r["ratio"],
                  r["detail"]["fraction_of_copy_bandwidth"], r["detail"].get("torch eager", "-"),
                  r["detail"].get("quack", "-"), r["correct"]] for r in rows])
    name = "norms_quick" if args.quick else "norms"
    path = write_result(name, rows, copy_bandwidth_gbs=round(copy_gbs, 1))
    print(f"wrote {path}")
    if args.plot:
        plot(rows, RESULTS / f"{name}.png", copy_gbs)


if __name__ == "__main__":
    main()
