"""Norm launch-config sweep: forward configs of the fused norms against the heuristic's choice.

Every forward config of the fused RMSNorm / LayerNorm that the norm tuner would consider (or the
whole space), checked against the float32 reference and timed against the heuristic's choice, a
copy of the same bytes and torch.compile.

Two rounds per problem: every candidate alone (``do_bench``), then the best few beside the
heuristic's config, the copy and torch.compile in one interleaved group with more repetitions.
GPU time with the host kept out (``pad_host``, as benchmarks/norms.py times). ``--placements``
then times those few again with the weight and bias at eight places in memory (views into one
buffer, same values): LayerNorm's long rows once depended on where its parameters sat. The
rows' reference is the heuristic's config (ratio above 1: a config beats the heuristic); the copy
and torch.compile figures are in ``detail``. Prints a table per problem and writes
``benchmarks/results/sweep_norms.json``.

    python benchmarks/sweeps/norm_configs.py --kind rms ln --hidden 4096 32768
    python benchmarks/sweeps/norm_configs.py --kind ln --hidden 262144 --strategy quick --placements
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.common import (copy_bandwidth_gbs, print_table, require_gpu,  # noqa: E402
                               write_result)
from custom_kernels.norms import norm_config as nc  # noqa: E402

DTYPES = ("bfloat16", "float16", "float32")
# (weight offset, gap from the weight's end to the bias) in bytes: spans the placements that moved
# LayerNorm's long rows between 0.70 and 0.94 of the copy bandwidth (docs/measurements.md).
PLACEMENTS = ((0, 0), (64, 0), (0, 4096), (0, 65536), (2048, 8192), (1 << 18, 0),
              (4096, 3 << 16), (1 << 16, 7 << 16))


def candidates(problem: nc.NormProblem, strategy: str) -> list[nc.NormConfig]:
    """The heuristic's config first, then the tuner's candidates (or every valid config)."""
    if strategy == "space":
        return list(nc.space(problem))
    from tuning.norm_search import candidates as tuner_candidates

    return tuner_candidates(problem, strategy)


class Case:
    """One problem's tensors, its reference and its calls."""

    def __init__(self, problem: nc.NormProblem, rows: int, eps: float):
        import torch

        from custom_kernels.norms import layer_norm_reference, rms_norm_reference

        self.problem, self.rows, self.eps = problem, rows, eps
        dtype, wdtype = getattr(torch, problem.dtype), getattr(torch, problem.weight_dtype)
        hidden, ln = problem.hidden, problem.kind == "ln"
        torch.manual_seed(hidden)
        self.x = torch.randn(rows, hidden, device="cuda", dtype=dtype)
        self.residual = torch.randn_like(self.x) if problem.residual else None
        self.w = (1 + 0.1 * torch.randn(hidden, device="cuda")).to(wdtype)
        self.b = (0.1 * torch.randn(hidden, device="cuda")).to(wdtype) if ln else None
        if ln:
            self.reference = layer_norm_reference(self.x, self.w, self.b, eps, self.residual)
        else:
            self.reference = rms_norm_reference(self.x, self.w, eps, self.residual)
        if isinstance(self.reference, tuple):
            self.reference = self.reference[0]
        self.reference = self.reference.float()
        self.copy_src = torch.empty(self.nbytes // 2, dtype=torch.uint8, device="cuda").random_()
        self.copy_dst = torch.empty_like(self.copy_src)

    @property
    def nbytes(self) -> int:
        """Each input read once, each output written once: x, y (and the residual in, the new
        residual out), the weight (and the bias)."""
        p, rows = self.problem, self.rows
        size = nc.DTYPE_SIZES[p.dtype]
        streams = 2 + (2 if p.residual else 0)
        params = (2 if p.kind == "ln" else 1) * nc.DTYPE_SIZES[p.weight_dtype]
        return rows * p.hidden * size * streams + p.hidden * params

    def run(self, config: str | None, w=None, b=None):
        from custom_kernels.norms import layer_norm, rms_norm

        w = self.w if w is None else w
        if self.problem.kind == "ln":
            b = self.b if b is None else b
            return layer_norm(self.x, w, b, self.eps, residual=self.residual, config=config)
        return rms_norm(self.x, w, self.eps, residual=self.residual, config=config)

    def error(self, config: str) -> float:
        y = self.run(config)
        y = y[0] if isinstance(y, tuple) else y
        return ((y.float() - self.reference).norm() / self.reference.norm()).item()

    def copy(self):
        self.copy_dst.copy_(self.copy_src)

    def torch_compile(self):
        import torch
        import torch.nn.functional as F

        hidden, eps, ln = self.problem.hidden, self.eps, self.problem.kind == "ln"

        def norm(x, residual, w, b):
            h = x if residual is None else x + residual
            return F.layer_norm(h, (hidden,), w, b, eps) if ln else \
                F.rms_norm(h, (hidden,), w, eps)
        compiled = torch.compile(norm, dynamic=False)
        return lambda: compiled(self.x, self.residual, self.w, self.b)


def gbs(nbytes: int, ms: float) -> float:
    return nbytes / ms / 1e6


def sweep_problem(problem, rows, args) -> list[dict]:
    from custom_kernels.core.tolerances import NORMS, relative_tolerance
    from custom_kernels.norms.norm_ops import precompile_configs
    from tuning.timing import do_bench, do_bench_interleaved

    configs = candidates(problem, args.strategy)
    heuristic = configs[0].name
    start = time.time()
    failed = precompile_configs(problem, configs, workers=args.jobs)
    print(f"== {problem.name}, {rows} rows: {len(configs)} configs built in "
          f"{time.time() - start:.0f} s, {len(failed)} failed", flush=True)
    case = Case(problem, rows, args.eps)
    errors, first = dict(failed), {}
    for config in configs:
        if config.name in errors:
            continue
        try:
            error = case.error(config.name)
        except Exception as exc:  # noqa: BLE001 -- a config that does not launch is a result
            errors[config.name] = f"{type(exc).__name__}: {exc}"[:300]
            continue
        if not error < relative_tolerance(problem.dtype, NORMS):
            errors[config.name] = f"wrong result: relative error {error:.3g}"
            continue
        first[config.name] = do_bench(lambda c=config.name: case.run(c), reps=20,
                                      pad_host=True).median_ms
    if heuristic not in first:
        print(f"  the heuristic's {heuristic} did not run: {errors.get(heuristic)}", flush=True)
        return []
    best = sorted(first, key=first.get)[:args.top]
    finalists = list(dict.fromkeys([heuristic, *best]))
    group = {name: (lambda c=name: case.run(c)) for name in finalists}
    group["copy"] = case.copy
    if not args.no_compile:
        group["torch.compile"] = case.torch_compile()
    final = do_bench_interleaved(group, reps=args.reps, pad_host=True)
    copy_ms = final["copy"].median_ms
    compile_ms = final["torch.compile"].median_ms if "torch.compile" in final else None
    placements = place_sweep(case, finalists, args.reps) if args.placements else {}
    ref_ms = final[heuristic].median_ms
    ref = round(gbs(case.nbytes, ref_ms), 1)
    rows_out = []
    for config in configs:
        name = config.name
        ms = final[name].median_ms if name in final else first.get(name)
        ours = round(gbs(case.nbytes, ms), 1) if ms else 0.0
        detail = {"config": name, "heuristic": name == heuristic, "finalist": name in final,
                  "ours_ms": round(ms, 5) if ms else None, "reference_ms": round(ref_ms, 5),
                  "fraction_of_copy": round(copy_ms / ms, 4) if ms else None,
                  "error": errors.get(name)}
        if compile_ms is not None:
            detail["torch.compile"] = round(gbs(case.nbytes, compile_ms), 1)
            detail["x_torch_compile"] = round(compile_ms / ms, 4) if ms else None
        if name in placements:
            detail["fraction_of_copy_by_placement"] = [round(copy_ms / t, 4)
                                                       for t in placements[name]]
        rows_out.append({"case": f"{problem.name} rows={rows} {name}", "unit": "GB/s",
                         "ours": ours, "reference": ref,
                         "reference_name": f"heuristic {heuristic}",
                         "ratio": round(ours / ref, 4), "correct": ms is not None,
                         "detail": detail})
    rows_out.sort(key=lambda r: (not r["detail"]["finalist"], -r["ours"]))
    print(f"   copy {gbs(case.nbytes, copy_ms):.0f} GB/s for the same bytes"
          + (f", torch.compile {gbs(case.nbytes, compile_ms):.0f} GB/s" if compile_ms else ""))
    shown = [r for r in rows_out if r["ours"]][:args.top + 6]
    print_table(["GB/s", "x heuristic", "of copy", "x torch.compile", "placements", "config"],
                [[r["ours"], r["ratio"], r["detail"]["fraction_of_copy"],
                  r["detail"].get("x_torch_compile", ""),
                  _span(r["detail"].get("fraction_of_copy_by_placement")),
                  r["detail"]["config"] + (" (heuristic)" if r["detail"]["heuristic"] else "")
                  + ("" if r["detail"]["finalist"] else " (first round)")] for r in shown])
    return rows_out


def place_sweep(case: Case, names: list[str], reps: int) -> dict[str, list[float]]:
    """{config: [median ms per placement]} with w (and b) copied to each place in one buffer."""
    import torch

    from tuning.timing import do_bench_interleaved

    hidden = case.problem.hidden
    buf = torch.empty(4 * hidden + (1 << 20), dtype=case.w.dtype, device="cuda")
    size = case.w.element_size()
    out = {name: [] for name in names}
    for w_off, gap in PLACEMENTS:
        w = buf[w_off // size:w_off // size + hidden]
        w.copy_(case.w)
        b = None
        if case.b is not None:
            start = w_off // size + hidden + gap // size
            b = buf[start:start + hidden]
            b.copy_(case.b)
        timings = do_bench_interleaved({n: (lambda n=n: case.run(n, w, b)) for n in names},
                                       reps=reps, pad_host=True)
        for name in names:
            out[name].append(timings[name].median_ms)
    return out


def _span(values) -> str:
    return f"{min(values):.3f}-{max(values):.3f}" if values else ""


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        epilog="example: python benchmarks/sweeps/norm_configs.py --kind ln --hidden 32768 "
               "--placements")
    parser.add_argument("--kind", nargs="+", choices=nc.KINDS, default=["rms", "ln"])
    parser.add_argument("--hidden", nargs="+", type=int,
                        default=[256, 1000, 4096, 8192, 32768, 65536, 262144])
    parser.add_argument("--rows", type=int,
                        help="rows per problem (default: 32768, 8192 from hidden 262144)")
    parser.add_argument("--dtype", choices=DTYPES, default="bfloat16",
                        help="x, y and the parameters (default: bfloat16)")
    parser.add_argument("--residual", action="store_true", help="with a fused residual add")
    parser.add_argument("--strategy", choices=("quick", "default", "exhaustive", "space"),
                        default="default",
                        help="the norm tuner's candidates of that strategy, or the whole valid "
                             "space (default: default)")
    parser.add_argument("--top", type=int, default=4,
                        help="configs of the first round timed again, interleaved (default: 4)")
    parser.add_argument("--reps", type=int, default=50,
                        help="repetitions of the interleaved round, at least 20 (default: 50)")
    parser.add_argument("--placements", action="store_true",
                        help="also time the finalists over eight weight / bias placements")
    parser.add_argument("--no-compile", action="store_true", help="leave torch.compile out")
    parser.add_argument("--eps", type=float, default=1e-5)
    parser.add_argument("--jobs", type=int, default=8, help="parallel NVRTC compiles (default: 8)")
    args = parser.parse_args()
    if args.reps < 20:
        parser.error("--reps must be at least 20 (BENCHMARKS.md)")
    problems = []
    for kind in args.kind:
        for hidden in args.hidden:
            try:
                problems.append(nc.NormProblem(kind, "fwd", hidden, args.dtype, args.dtype,
                                               args.dtype, residual=args.residual))
            except ValueError as exc:
                parser.error(str(exc))
    require_gpu()
    copy_gbs = copy_bandwidth_gbs()
    print(f"copy bandwidth {copy_gbs:.0f} GB/s", flush=True)
    rows = []
    for problem in problems:
        count = args.rows or (8192 if problem.hidden >= 262144 else 32768)
        rows += sweep_problem(problem, count, args)
    path = write_result("sweep_norms", rows, copy_bandwidth_gbs=round(copy_gbs, 1),
                        timing="GPU time (pad_host), finalists interleaved with a copy of the "
                               "same bytes and torch.compile, L2 flushed")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
