"""cutlass_ops.nn.Linear against torch.nn.functional.linear: a training step (forward + backward)
on the LLM shapes, and host overhead per call at a tiny shape.

Step rows: bf16, no bias, y = x W^T then dX = dY W and dW = dY^T X (torch.autograd.grad, so no
gradient accumulation kernel), ours and torch timed interleaved repetition by repetition with an
L2 flush; figures are steps per second. ``--tune quick`` first tunes the forward (tn), dX (tt)
and dW (nt) GEMMs of every shape, so that all three run tuned kernels.
Host rows: a 16 x 256 x 256 forward in eager mode on a CUTLASS kernel, calls per second over
3000 back-to-back calls (host-bound at this size): our functional linear against F.linear (the
issue's reference), our module against nn.Linear, cutlass_ops.matmul against torch.matmul, and
the custom op itself (what torch.compile sees) against F.linear.
Fused rows: inference forward of an MLP's up projection, gelu_tanh(x W^T + b), and of its down
projection with the residual, x + (h W^T + b), each one CUTLASS kernel with the epilogue fused,
against torch eager (cuBLAS addmm, then the elementwise ops; the reference) with torch.compile
in ``detail``; TFLOP/s of the GEMM. ``--tune`` tunes these fused problems too.
Writes benchmarks/results/torch_integration.json.

    python benchmarks/torch_integration.py [--tune quick] [--quick]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import cutlass_ops  # noqa: E402
from benchmarks.common import (copy_bandwidth_gbs, print_table,  # noqa: E402
                               private_cache_with_online_compile, require_gpu, write_result)
from cutlass_ops import GemmOperands, GemmProblem  # noqa: E402
from cutlass_ops.nn import Linear  # noqa: E402
from tuning.timing import do_bench_interleaved  # noqa: E402

SHAPES = [(m, n, k) for m in (128, 1024, 4096) for n, k in ((4096, 4096), (14336, 4096),
                                                             (4096, 14336))]


def step_problems(m, n, k):
    """The three GEMMs of a Linear step, with their layouts."""
    return [GemmProblem(GemmOperands.make("bf16", layout_a="row", layout_b="col"), m, n, k),
            GemmProblem(GemmOperands.make("bf16", layout_a="row", layout_b="row"), m, k, n),
            GemmProblem(GemmOperands.make("bf16", layout_a="col", layout_b="row"), n, k, m)]


# (m, n, k, epilogue): the MLP's up projection (bias + tanh GELU) and down projection (bias +
# residual) at three token counts.
FUSED = [(m, n, k, epilogue) for m in (128, 1024, 4096)
         for n, k, epilogue in ((14336, 4096, "bias,gelu_tanh"), (4096, 14336, "bias,residual"))]


def fused_problems(cases):
    return [GemmProblem(GemmOperands.make("bf16", epilogue=epilogue), m, n, k)
            for m, n, k, epilogue in cases]


def tune(shapes, strategy, fused=()):
    from tuning.backend import GpuBackend
    from tuning.search import tune as run_tune

    problems = [p for shape in shapes for p in step_problems(*shape)] + fused_problems(fused)
    report = run_tune(problems, backend=GpuBackend(), strategy=strategy)
    print(f"tuned {len(problems)} GEMMs: compiled {report.built} kernels in "
          f"{report.build_seconds:.0f} s, measured in {report.measure_seconds:.0f} s", flush=True)
    from cutlass_ops.gemms import dispatch

    dispatch.reset()


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def step_row(m, n, k):
    torch.manual_seed(0)
    theirs = torch.nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
    ours = Linear.from_linear(theirs)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)

    def step(layer):
        return lambda: torch.autograd.grad(layer(x), (x, layer.weight), g)

    got, want = step(ours)(), step(theirs)()
    errors = [rel(a, b) for a, b in zip(got, want)] + [rel(ours(x), theirs(x))]
    with torch.no_grad():  # what the op's GEMMs run (it calls dispatch with grad off)
        decisions = [cutlass_ops.explain(x.detach(), theirs.weight.t()),
                     cutlass_ops.explain(g, theirs.weight), cutlass_ops.explain(g.t(), x.detach())]
    sources = [d.choice.name if d.choice else f"torch ({d.source})" for d in decisions]
    from cutlass_ops.gemms import dispatch

    before = dispatch.call_counts()
    step(ours)()
    ran = {kind: dispatch.call_counts()[kind] - before[kind] for kind in ("cutlass", "torch")}
    timings = do_bench_interleaved({"ours": step(ours), "torch": step(theirs)}, reps=30)
    ours_ms, torch_ms = timings["ours"].median_ms, timings["torch"].median_ms
    return {"case": f"linear fwd+bwd bf16 M={m} N={n} K={k}", "unit": "steps/s",
            "ours": round(1e3 / ours_ms, 1), "reference": round(1e3 / torch_ms, 1),
            "reference_name": "torch.nn.functional.linear",
            "ratio": round(round(1e3 / ours_ms, 1) / round(1e3 / torch_ms, 1), 4),
            "correct": max(errors) < 3e-2,
            "detail": {"ours_ms": round(ours_ms, 4), "reference_ms": round(torch_ms, 4),
                       "dispatch_fwd_dx_dw": sources, "gemms_run_per_step": ran,
                       "max_rel_error": round(max(errors), 5),
                       "tflops_ours": round(6 * m * n * k / ours_ms / 1e9, 1),
                       "tflops_torch": round(6 * m * n * k / torch_ms / 1e9, 1)}}


def fused_row(m, n, k, epilogue):
    torch.manual_seed(0)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
    b = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    if "gelu_tanh" in epilogue:
        def ours():
            return cutlass_ops.ops.linear_fast(x, w, b, "gelu_tanh")

        def eager():
            return F.gelu(F.linear(x, w, b), approximate="tanh")

        kwargs = dict(bias=b, activation="gelu_tanh")
    else:
        residual = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)

        def ours():
            return cutlass_ops.matmul(x, w.t(), bias=b, residual=residual)

        def eager():
            return residual + F.linear(x, w, b)

        kwargs = dict(bias=b, residual=residual)
    compiled = torch.compile(eager)
    with torch.no_grad():
        error = rel(ours(), eager())
        compiled()
        decision = cutlass_ops.explain(x, w.t(), **kwargs)
        timings = do_bench_interleaved({"ours": ours, "eager": eager, "compile": compiled},
                                       reps=50)
    ms = {name: t.median_ms for name, t in timings.items()}
    tflops = {name: round(2 * m * n * k / v / 1e9, 1) for name, v in ms.items()}
    return {"case": f"fused linear {epilogue} fwd bf16 M={m} N={n} K={k}", "unit": "TFLOP/s",
            "ours": tflops["ours"], "reference": tflops["eager"],
            "reference_name": "torch eager (F.linear, then the epilogue ops)",
            "ratio": round(tflops["ours"] / tflops["eager"], 4), "correct": error < 2e-2,
            "detail": {"ours_ms": round(ms["ours"], 4), "reference_ms": round(ms["eager"], 4),
                       "torch.compile": tflops["compile"],
                       "torch.compile_ms": round(ms["compile"], 4),
                       "dispatch": decision.source,
                       "kernel": decision.choice.name if decision.choice else "torch",
                       "max_rel_error": round(error, 5)}}


def calls_per_second(fn, calls=3000):
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return calls / (time.perf_counter() - start)


def host_rows():
    """Calls per second at a tiny shape where the host bounds the rate. The kernel behind our
    calls is CUTLASS (built on first use if needed: online mode "compile"), so the figure is our
    own path: checks memoized per signature, output allocation, argument copy, C++ launch."""
    m, n, k = 16, 256, 256
    theirs = torch.nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
    ours = Linear.from_linear(theirs)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = theirs.weight
    rows = []
    with private_cache_with_online_compile(), torch.no_grad():
        decision = cutlass_ops.explain(x, w.t())
        assert decision.choice is not None, decision.reason
        pairs = [
            ("functional linear", lambda: cutlass_ops.ops.linear_fast(x, w),
             lambda: F.linear(x, w), "torch.nn.functional.linear"),
            ("nn.Linear module", lambda: ours(x), lambda: theirs(x), "torch.nn.Linear"),
            ("matmul", lambda: cutlass_ops.matmul(x, w.t()), lambda: torch.matmul(x, w.t()),
             "torch.matmul"),
            ("custom op cutlass_ops::linear", lambda: cutlass_ops.ops.linear(x, w, None),
             lambda: F.linear(x, w), "torch.nn.functional.linear"),
        ]
        for name, fn, ref_fn, ref_name in pairs:
            fn()  # resolves (and, the first time, builds) the kernel
            cps, ref_cps = calls_per_second(fn), calls_per_second(ref_fn)
            rows.append({
                "case": f"host overhead {name} bf16 {m}x{n}x{k} eager", "unit": "calls/s",
                "ours": round(cps), "reference": round(ref_cps), "reference_name": ref_name,
                "ratio": round(round(cps) / round(ref_cps), 4),
                "correct": rel(fn(), ref_fn()) < 2e-2,
                "detail": {"us_per_call_ours": round(1e6 / cps, 2),
                           "us_per_call_reference": round(1e6 / ref_cps, 2),
                           "dispatch": decision.source,
                           "kernel": decision.choice.name if decision.choice
                           else "torch.matmul"}})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tune", choices=["quick", "default"], help="tune the step GEMMs first")
    parser.add_argument("--quick", action="store_true", help="three shapes, to a _quick file")
    args = parser.parse_args()
    require_gpu()
    shapes = SHAPES[::4] if args.quick else SHAPES
    fused = FUSED[::3] if args.quick else FUSED
    host = host_rows()
    if args.tune:
        tune(shapes, args.tune, fused)
    rows = [step_row(*shape) for shape in shapes] + [fused_row(*case) for case in fused] + host
    print_table(["case", "ours", "torch", "unit", "ratio", "correct"],
                [[r["case"], r["ours"], r["reference"], r["unit"], r["ratio"], r["correct"]]
                 for r in rows])
    path = write_result("torch_integration_quick" if args.quick else "torch_integration", rows,
                        copy_bandwidth_gbs=round(copy_bandwidth_gbs(), 1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
