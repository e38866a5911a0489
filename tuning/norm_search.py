"""Tuning the fused norms' launch configs (``custom_kernels.norms.norm_config``) on this GPU: the norms'
side of the tuner protocol (``tuning.protocol``), on a small space.

Every candidate of a problem is compiled (in parallel, through the NVRTC cubin cache), run on
random data and checked against the family's float32 reference before it may win
(``custom_kernels.norms.norm_ops.rms_norm_reference`` / ``layer_norm_reference``; autograd through them
for the backward pass), then timed with the GPU queue kept ahead of the host (``tuning.timing``,
``pad_host``); the best few are timed again in one interleaved group with the heuristic's choice
and torch eager, and the fastest is stored. Entries live in the tuning cache of this GPU and
software scope, family ``norms`` (beside the GEMM caches, so GEMM listings stay GEMM only), one
per ``NormProblem`` (kind, direction, hidden, dtypes, alignment, residual).

``custom_kernels.norms.norm_ops`` looks the winner up when it builds a plan for a problem (once per
process and problem): a tuned problem runs its winner, any other the heuristic.

Strategies: ``quick`` (the staged kernel with 1 to 3 stages and at least 256 threads, about 15
candidates), ``default`` (every staged candidate), ``exhaustive`` (the direct kernel's too).
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Callable, Iterable

from custom_kernels.core import tolerances
from custom_kernels.norms import norm_config as nc
from custom_kernels.norms.tuned import NORMS, norm_cache, tuned_config
from tuning import protocol

__all__ = ["NORMS", "STRATEGIES", "candidates", "default_rows", "norm_cache",
           "tuned_config", "tune", "tune_problem"]

STRATEGIES = ("quick", "default", "exhaustive")


def candidates(problem: nc.NormProblem, strategy: str = "default") -> list[nc.NormConfig]:
    """The heuristic's choice first, then the strategy's part of the space."""
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; choose from {STRATEGIES}")
    out = []
    for config in nc.space(problem):
        # Aligned rows: the direct kernel only where it holds whole rows in a warp or less
        # (short rows, where it wins); a block-per-row direct split is the scalar path's.
        if strategy != "exhaustive" and problem.aligned and not config.stages \
                and not config.warp_per_row:
            continue
        if strategy == "quick" and (config.stages > 3 or config.threads < 256):
            continue
        out.append(config)
    first = nc.heuristic(problem)
    return [first] + [c for c in out if c != first]


def default_rows(hidden: int) -> int:
    """Enough rows to fill the GPU many times, within 2^31 elements per tensor."""
    return max(1, min(32768, (1 << 31) // hidden // 4))


def tune_problem(problem: nc.NormProblem, *, strategy: str = "default",
                 rows: int | None = None, reps: int = 20, jobs: int = 8,
                 progress: Callable[[str], None] = lambda message: None) -> dict:
    """Searches ``problem``'s configs on the current GPU; returns the cache entry (not stored)."""
    family = NormFamily(strategy, rows=rows, reps=reps, jobs=jobs, progress=progress)
    return protocol.run([problem], family, cache=None)[0].entry


def tune(problems: Iterable[nc.NormProblem], *, strategy: str = "default", force: bool = False,
         rows: int | None = None, reps: int = 20, jobs: int = 8,
         progress: Callable[[str], None] = print) -> list[tuple[nc.NormProblem, dict]]:
    """Tunes each problem not yet in the cache (all with ``force``); each entry is stored as
    soon as its problem is done, so an interrupted run keeps what it finished."""
    family = NormFamily(strategy, rows=rows, reps=reps, jobs=jobs, progress=progress)
    cache = norm_cache()
    out = []
    for problem in problems:  # one at a time: each problem's progress as soon as it is done
        (result,) = protocol.run([problem], family, cache, force=force)
        entry = result.entry
        if result.cached:
            progress(f"{problem.name}: cached ({entry.get('winner')}); --force re-tunes")
        else:
            progress(f"{problem.name}: {entry['winner']} {entry['winner_ms']:.4f} ms "
                     f"({entry['gbps']} GB/s; heuristic {entry['heuristic']} "
                     f"{entry['heuristic_ms'] or math.nan:.4f} ms, torch "
                     f"{entry['torch_ms']:.4f} ms)")
        out.append((problem, entry))
    return out


class NormFamily:
    """Candidates, NVRTC builds, sessions and entries of norm problems."""

    def __init__(self, strategy: str, *, rows: int | None, reps: int, jobs: int,
                 progress: Callable[[str], None]):
        if strategy not in STRATEGIES:
            raise ValueError(f"unknown strategy {strategy!r}; choose from {STRATEGIES}")
        self.strategy, self.rows, self.jobs, self.progress = strategy, rows, jobs, progress
        # The caller's repetitions (the CLI's --reps). Finals: three plus the heuristic's choice,
        # four kernels as the GEMMs' four, and in one group with torch: these memory-bound
        # kernels do not move the GPU's power-limited clocks as compute-bound GEMMs do, and the
        # stored speedup over the heuristic is then measured side by side.
        self.rounds = protocol.Rounds(first_reps=reps, finalists=3, final_reps=max(reps, 20),
                                      paired=False)
        self.compile_seconds: dict[nc.NormProblem, float] = {}

    def rows_for(self, problem: nc.NormProblem) -> int:
        return self.rows or default_rows(problem.hidden)

    def candidates(self, problem: nc.NormProblem) -> list[nc.NormConfig]:
        return candidates(problem, self.strategy)

    def build(self, plans: dict[nc.NormProblem, list[nc.NormConfig]]) -> dict:
        from custom_kernels.norms import norm_ops as norms

        out = {}
        for problem, configs in plans.items():
            start = time.perf_counter()
            self.progress(f"{problem.name}: compiling {len(configs)} candidates")
            errors = norms.precompile_configs(problem, configs, workers=self.jobs)
            self.compile_seconds[problem] = time.perf_counter() - start
            out[problem] = {config: errors.get(config.name) for config in configs}
        return out

    def session(self, problem: nc.NormProblem) -> NormSession:
        return NormSession(problem, self.rows_for(problem))

    def derived(self, problem: nc.NormProblem, ranked: list) -> list:
        return []  # every launch parameter is compiled in

    def baseline(self, problem: nc.NormProblem, plan: list[nc.NormConfig]) -> nc.NormConfig:
        return plan[0]  # the heuristic's choice: the entry records the winner's gain over it

    def deadline(self) -> None:
        return None

    def entry(self, problem: nc.NormProblem, measured: protocol.Measured) -> dict:
        failures = {f.candidate: f.error[:400] for f in measured.failures}  # as the GEMMs'
        winner = measured.winner
        if winner is None:
            raise RuntimeError(f"{problem.name}: every candidate failed: {failures}")
        heuristic = nc.heuristic(problem)
        rows = self.rows_for(problem)
        winner_ms = measured.final_ms[winner]
        first = sorted(measured.first_ms, key=measured.first_ms.get)
        compile_s = self.compile_seconds.get(problem, 0.0)
        return {
            "winner": winner.name, "winner_ms": winner_ms, "heuristic": heuristic.name,
            "heuristic_ms": measured.final_ms.get(heuristic), "torch_ms": measured.torch_ms,
            "reference": "torch eager", "rows": rows, "strategy": self.strategy,
            "gbps": _gbps(problem, rows, winner_ms),
            "runners_up": [{"config": c.name, "ms": measured.first_ms[c]}
                           for c in first[:self.rounds.runners_up]],
            "failures": failures,
            "timings_s": {"compile": round(compile_s, 2),
                          "total": round(compile_s + measured.seconds, 2)},
        }


def _gbps(problem: nc.NormProblem, rows: int, ms: float) -> float:
    size = nc.DTYPE_SIZES
    per_row = problem.hidden * (size[problem.dtype] + size[problem.out_dtype])
    if problem.direction == "bwd":
        per_row += problem.hidden * size[problem.dtype]  # x, dy read; dx written
    if problem.residual:
        per_row += problem.hidden * size[problem.dtype]
    return round(rows * per_row / ms / 1e6, 1)


@dataclasses.dataclass
class NormSession:
    """One problem on the GPU (``tuning.protocol.Session``): random inputs, the float32
    reference of every output the candidates write, and torch eager's same call."""

    problem: nc.NormProblem
    rows: int

    def __post_init__(self):
        import torch

        from custom_kernels.norms import norm_ops as norms

        p = self.problem
        dt = {name: getattr(torch, name) for name in nc.DTYPE_CODES}
        g = torch.Generator(device="cuda").manual_seed(p.hidden)

        def randn(*shape, dtype):
            return torch.randn(*shape, generator=g, device="cuda").to(dtype)

        offset = 0 if p.aligned else 1  # the scalar path: pointers one element off
        base = randn(self.rows * p.hidden + offset, dtype=dt[p.dtype])
        self.x = base[offset:].view(self.rows, p.hidden)
        self.w = (1 + 0.5 * randn(p.hidden, dtype=torch.float32)).to(dt[p.weight_dtype])
        self.b = randn(p.hidden, dtype=dt[p.weight_dtype]) if p.kind == "ln" else None
        self.res = randn(self.rows, p.hidden, dtype=dt[p.dtype]) if p.residual else None
        self.dy = randn(self.rows, p.hidden, dtype=dt[p.out_dtype])
        self.eps = 1e-6 if p.kind == "rms" else 1e-5
        self.out_dtype = dt[p.out_dtype]
        # The saved statistics the backward candidates read, from the heuristic's forward pass.
        _, res_out, self.mean, self.rstd = norms._fwd_impl(
            p.kind, self.x, self.w, self.b, self.res, self.eps, self.out_dtype,
            nc.heuristic(p).name)
        self.h = res_out if res_out is not None else self.x
        self.reference = self._forward_reference() if p.direction == "fwd" \
            else self._backward_reference()
        self.tolerance = tolerances.relative_tolerance(p.dtype, tolerances.NORMS)
        self.torch_fn = self._torch_fn()

    def _reference(self, x, w, b, residual, out_dtype):
        from custom_kernels.norms import norm_ops as norms

        if self.problem.kind == "rms":
            return norms.rms_norm_reference(x, w, self.eps, residual=residual,
                                            out_dtype=out_dtype)
        return norms.layer_norm_reference(x, w, b, self.eps, residual=residual,
                                          out_dtype=out_dtype)

    def _forward_reference(self) -> list:
        """y in float32 (and the new residual h, with a residual)."""
        import torch

        out = self._reference(self.x, self.w, self.b, self.res, torch.float32)
        return list(out) if self.res is not None else [out]

    def _backward_reference(self) -> list:
        """dx, dW (and dB): autograd through the reference on float32 copies of h and the
        parameters. The residual gradient (dy stands in for it) adds to dx."""
        import torch

        leaves = [t.detach().float().requires_grad_() for t in (self.h, self.w, self.b)
                  if t is not None]
        h, w, b = leaves + [None] * (3 - len(leaves))
        y = self._reference(h, w, b, None, torch.float32)
        grads = list(torch.autograd.grad(y, leaves, self.dy.float()))
        if self.problem.residual:
            grads[0] = grads[0] + self.dy.float()
        return grads

    def _torch_fn(self) -> Callable[[], object]:
        """torch eager's same computation, for the entry's reference time."""
        import torch
        import torch.nn.functional as F

        p = self.problem
        # torch's norms want one dtype: the parameters in x's (a float32 weight is cast once).
        w = self.w.to(self.h.dtype)
        b = self.b.to(self.h.dtype) if self.b is not None else None
        if p.direction == "fwd":
            if p.kind == "rms":
                return lambda: F.rms_norm(self.h, (p.hidden,), w, self.eps)
            return lambda: F.layer_norm(self.h, (p.hidden,), w, b, self.eps)
        hg = self.h.detach().requires_grad_()
        wg = w.detach().requires_grad_()
        dy = self.dy.to(self.h.dtype)
        if p.kind == "rms":
            y = F.rms_norm(hg, (p.hidden,), wg, self.eps)
        else:
            y = F.layer_norm(hg, (p.hidden,), wg, b, self.eps)
        return lambda: torch.autograd.grad(y, (hg, wg), dy, retain_graph=True)

    def _runner(self, config: nc.NormConfig) -> Callable[[], tuple]:
        from custom_kernels.norms import norm_ops as norms

        p = self.problem
        if p.direction == "fwd":
            return lambda: norms._fwd_impl(p.kind, self.x, self.w, self.b, self.res, self.eps,
                                           self.out_dtype, config.name)
        dres = self.dy if p.residual else None
        return lambda: norms._bwd_impl(p.kind, self.dy, self.h, self.w, self.mean, self.rstd,
                                       dres, config.name)

    def verify(self, config: nc.NormConfig) -> str | None:
        try:
            out = self._runner(config)()
        except Exception as exc:  # noqa: BLE001 - a failing candidate is a result
            return f"launch: {type(exc).__name__}: {exc}"[:300]
        # Forward: (y, h, mean, rstd); backward: (dx, dW, dB): the outputs a reference has.
        return protocol.check(out, self.reference, self.tolerance)

    def time_ms(self, config: nc.NormConfig, reps: int) -> float:
        from tuning.timing import do_bench

        return do_bench(self._runner(config), reps=reps, pad_host=True).median_ms

    def torch_ms(self, reps: int) -> float:
        from tuning.timing import do_bench

        return do_bench(self.torch_fn, reps=reps, pad_host=True).median_ms

    def compare_ms(self, configs: list, reps: int) -> tuple[dict, float]:
        from tuning.timing import do_bench_interleaved

        fns: dict = {config: self._runner(config) for config in configs}
        fns["torch"] = self.torch_fn
        timings = do_bench_interleaved(fns, reps=reps, pad_host=True)
        torch_ms = timings.pop("torch").median_ms
        return {config: t.median_ms for config, t in timings.items()}, torch_ms

    def close(self) -> None:
        import torch

        self.x = self.w = self.b = self.res = self.dy = self.h = self.mean = self.rstd = None
        self.reference = self.torch_fn = None
        torch.cuda.empty_cache()
