"""Fused RMSNorm and LayerNorm (custom_kernels.norms.norm_ops), forward and backward, against
torch.compile, bf16.

    python benchmarks/norms.py [--quick] [--plot] [--kinds rms ln]

Rows: bf16, 32768 rows (8192 at hidden 262144), hidden 256 .. 262144, forward and backward.
GB/s count the minimum bytes: forward x read + y written + weight (and bias) read; backward x
and dy read, dx written, statistics read, weight read and dweight (and dbias) written. The
reference (the issue's) is torch.compile of F.rms_norm / F.layer_norm; torch eager and QuACK's
RMSNorm (when importable) go in ``detail``, all timed in the same interleaved rounds
(tuning.timing.do_bench_interleaved, L2 flushed before each) with the GPU queue kept ahead of
the host (``pad_host``): the figures are the kernels' GPU time, not Python's. The per-call host
cost of each contender is measured apart (a small input, wall clock per call, no sync) and
written as ``host_us``. Backward times ``torch.autograd.grad`` over a retained graph, the same
way for every contender. Each row carries its correctness check (ours against the float32
reference), the config that ran and the fraction of the copy bandwidth measured in the same
run. Writes benchmarks/results/norms.json (norms_quick with --quick) and, with --plot and
matplotlib, norms.png beside it.

Run with a clean CUTLASS_OPS_CACHE_DIR to measure the heuristic's configs; with a tuned cache
(``cutlass-tune norms tune``) the tuned ones run, and the rows say which.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from benchmarks.common import (RESULTS, copy_bandwidth_gbs, print_table, require_gpu,  # noqa: E402
                               write_result)
from custom_kernels.norms import norm_ops as norms  # noqa: E402
from custom_kernels.norms import norm_config as nc  # noqa: E402
from tuning.timing import do_bench_interleaved  # noqa: E402

HIDDEN = [256, 1000, 4096, 8192, 32768, 65536, 262144]
QUICK_HIDDEN = [1000, 8192, 65536, 262144]
EPS = 1e-6


def rows_for(hidden: int) -> int:
    return 8192 if hidden >= 262144 else 32768


def contenders(kind, hidden):
    """name -> forward function (x, w, b) -> y; ours first, the reference second."""
    if kind == "rms":
        def torch_fn(x, w, b):
            return F.rms_norm(x, (hidden,), w, EPS)

        def ours(x, w, b):
            return norms.rms_norm(x, w, EPS)
    else:
        def torch_fn(x, w, b):
            return F.layer_norm(x, (hidden,), w, b, EPS)

        def ours(x, w, b):
            return norms.layer_norm(x, w, b, EPS)

    fns = {"ours": ours, "torch.compile": torch.compile(torch_fn, dynamic=False),
           "torch eager": torch_fn}
    if kind == "rms":
        try:
            from quack.rmsnorm import rmsnorm as quack_rmsnorm

            fns["quack"] = lambda x, w, b: quack_rmsnorm(x, w, eps=EPS)
        except Exception:  # not installed, or another API: the row says so by omission
            pass
    return fns


def bytes_moved(kind, rows, hidden, direction, itemsize=2):
    params = hidden * itemsize * (2 if kind == "ln" else 1)
    stats = rows * 4 * (2 if kind == "ln" else 1)
    if direction == "fwd":
        return 2 * rows * hidden * itemsize + params
    return 3 * rows * hidden * itemsize + stats + 2 * params


def reference(kind, x, w, b):
    xf = x.detach().float().requires_grad_()
    wf = w.detach().float().requires_grad_()
    bf = b.detach().float().requires_grad_()
    if kind == "rms":
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS) * wf
    else:
        y = F.layer_norm(xf, (x.shape[-1],), wf, bf, EPS)
    return y, ((xf, wf, bf) if kind == "ln" else (xf, wf))


def check(kind, x, w, b, dy) -> bool:
    leaves = [x.detach().requires_grad_(), w.detach().requires_grad_(),
              b.detach().requires_grad_()]
    y = contenders_ours(kind)(*leaves)
    grads = torch.autograd.grad(y, leaves[:3 if kind == "ln" else 2], dy)
    ry, rleaves = reference(kind, x, w, b)
    rgrads = torch.autograd.grad(ry, rleaves, dy.float())

    def rel(a, b):
        return ((a.float() - b).norm() / b.norm()).item()

    return max([rel(y, ry)] + [rel(g, r) for g, r in zip(grads, rgrads)]) < 2e-2


def contenders_ours(kind):
    if kind == "rms":
        return lambda x, w, b: norms.rms_norm(x, w, EPS)
    return lambda x, w, b: norms.layer_norm(x, w, b, EPS)


def config_used(kind, direction, hidden) -> str:
    plan = (norms._fwd_plan if direction == "fwd" else norms._bwd_plan)(
        kind, hidden, "bfloat16", "bfloat16", "bfloat16", True, False, None,
        torch.cuda.current_device())
    tuned = norms._tuned(nc.NormProblem(kind, direction, hidden, "bfloat16", "bfloat16",
                                        "bfloat16"), torch.cuda.current_device())
    return plan.config.name + (" (tuned)" if tuned else "")


def measure(kind: str, hidden: int, reps: int, copy_gbs: float) -> list[dict]:
    rows = rows_for(hidden)
    torch.manual_seed(hidden)
    x = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16)
    w = (1 + 0.1 * torch.randn(hidden, device="cuda")).to(torch.bfloat16)
    b = (0.1 * torch.randn(hidden, device="cuda")).to(torch.bfloat16)
    dy = torch.randn_like(x)
    correct = check(kind, x, w, b, dy)
    fns = contenders(kind, hidden)
    fwd = {name: (lambda f=f: f(x, w, b)) for name, f in fns.items()}
    bwd = {}
    for name, f in fns.items():
        leaves = (x.detach().requires_grad_(), w.detach().requires_grad_(),
                  b.detach().requires_grad_())
        wrt = leaves if kind == "ln" else leaves[:2]
        try:
            y = f(*leaves)
        except Exception as exc:  # a contender that cannot run this size is left out
            print(f"  {name} failed at hidden {hidden}: {exc}", file=sys.stderr)
            fwd.pop(name)
            continue
        bwd[name] = (lambda y=y, wrt=wrt:
                     torch.autograd.grad(y, wrt, dy, retain_graph=True))
    out = []
    for direction, table in (("fwd", fwd), ("bwd", bwd)):
        timings = do_bench_interleaved(table, reps=reps, pad_host=True)
        nbytes = bytes_moved(kind, rows, hidden, direction)
        gbs = {name: nbytes / t.median_ms / 1e6 for name, t in timings.items()}
        ours, ref = gbs["ours"], gbs["torch.compile"]
        op = "rms_norm" if kind == "rms" else "layer_norm"
        out.append({
            "case": f"bf16 {op} {direction} rows={rows} hidden={hidden}",
            "kind": kind, "hidden": hidden, "direction": direction, "unit": "GB/s",
            "ours": round(ours, 1), "reference": round(ref, 1),
            "reference_name": f"torch.compile(F.{op})", "ratio": round(ours / ref, 4),
            "correct": correct,
            "detail": {**{name: round(v, 1) for name, v in gbs.items()
                          if name not in ("ours", "torch.compile")},
                       "ours_ms": round(timings["ours"].median_ms, 4),
                       "reference_ms": round(timings["torch.compile"].median_ms, 4),
                       "fraction_of_copy_bandwidth": round(ours / copy_gbs, 4),
                       "config": config_used(kind, direction, hidden)},
        })
    return out


def host_costs(kinds) -> dict:
    """Wall-clock microseconds per call on a small input (16 x 4096), no sync inside the loop:
    what a call costs the host, which bounds small eager calls (CUDA graphs remove it)."""
    x = torch.randn(16, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.ones(4096, device="cuda", dtype=torch.bfloat16)
    b = torch.zeros(4096, device="cuda", dtype=torch.bfloat16)
    out = {}
    for kind in kinds:
        for name, f in contenders(kind, 4096).items():
            calls = {f"{kind} {name}": lambda f=f: f(x, w, b)}
            if name == "ours":
                xg = x.detach().requires_grad_()
                calls[f"{kind} ours (grad enabled)"] = lambda f=f, xg=xg: f(xg, w, b)
            for label, call in calls.items():
                for _ in range(20):
                    call()
                torch.cuda.synchronize()
                n = 500
                start = time.perf_counter()
                for _ in range(n):
                    call()
                elapsed = time.perf_counter() - start
                torch.cuda.synchronize()
                out[label] = round(elapsed / n * 1e6, 1)
    return out


def plot(rows: list[dict], path: Path, copy_gbs: float) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot", file=sys.stderr)
        return
    kinds = sorted({r.get("kind", "rms") for r in rows}, reverse=True)
    fig, axes = plt.subplots(len(kinds), 2, figsize=(12, 4.5 * len(kinds)), sharey=True,
                             squeeze=False)
    for ax, (kind, direction) in zip(axes.flat, [(k, d) for k in kinds for d in ("fwd", "bwd")]):
        sel = [r for r in rows if r["direction"] == direction and r.get("kind", "rms") == kind]
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
        ax.set_title(f"bf16 {'RMSNorm' if kind == 'rms' else 'LayerNorm'} {direction}")
        ax.grid(alpha=0.3)
    for ax in axes[:, 0]:
        ax.set_ylabel("GB/s")
    axes[0, 0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help=f"hidden {QUICK_HIDDEN} only")
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--kinds", nargs="+", default=["rms", "ln"], choices=["rms", "ln"])
    parser.add_argument("--plot", action="store_true", help="also write norms.png")
    args = parser.parse_args()
    require_gpu()
    hidden_sizes = QUICK_HIDDEN if args.quick else HIDDEN
    problems = [nc.NormProblem(k, d, h, "bfloat16", "bfloat16", "bfloat16")
                for k in args.kinds for h in hidden_sizes for d in nc.DIRECTIONS]
    norms.precompile(problems)
    copy_gbs = copy_bandwidth_gbs()
    rows = []
    for kind in args.kinds:
        for hidden in hidden_sizes:
            rows += measure(kind, hidden, args.reps, copy_gbs)
            torch.cuda.empty_cache()
    host_us = host_costs(args.kinds)
    print(f"copy bandwidth {copy_gbs:.0f} GB/s")
    print_table(["case", "ours GB/s", "torch.compile", "ratio", "of copy", "eager", "quack",
                 "config", "ok"],
                [[r["case"], r["ours"], r["reference"], r["ratio"],
                  r["detail"]["fraction_of_copy_bandwidth"], r["detail"].get("torch eager", "-"),
                  r["detail"].get("quack", "-"), r["detail"]["config"], r["correct"]]
                 for r in rows])
    print("host us per call (16x4096):", host_us)
    name = "norms_quick" if args.quick else "norms"
    path = write_result(name, rows, copy_bandwidth_gbs=round(copy_gbs, 1), host_us=host_us)
    print(f"wrote {path}")
    if args.plot:
        plot(rows, RESULTS / f"{name}.png", copy_gbs)


if __name__ == "__main__":
    main()
