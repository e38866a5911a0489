"""Tuning the fused norms' launch configs (custom_kernels/norm_config.py) on this GPU.

The same protocol as the GEMM search, on a smaller space: every candidate of a problem is
compiled (in parallel, through the NVRTC cubin cache), run on random data and checked against a
float32 reference before it may win (failures are recorded, never fatal), then timed with the GPU
queue kept ahead of the host (``tuning.timing``); the best few are timed again, interleaved with
the heuristic's choice, and the fastest is stored. Entries live in the tuning cache of this GPU
and software scope, in a ``norms`` directory beside the GEMM caches (so GEMM listings stay GEMM
only), one per ``NormProblem`` (kind, direction, hidden, dtypes, alignment, residual).

``custom_kernels.norms.ops`` looks the winner up when it builds a plan for a problem (once per
process and problem): a tuned problem runs its winner, any other the heuristic.

Strategies: ``quick`` (the staged kernel with 1 to 3 stages and at least 256 threads, about 15
candidates), ``default`` (every staged candidate), ``exhaustive`` (the direct kernel's too).
"""

from __future__ import annotations

import dataclasses
import math
import time
from pathlib import Path
from typing import Callable, Iterable, Optional

from custom_kernels.norms import config as nc
from custom_kernels.norms.tuned import NORMS, norm_cache, tuned_config_name  # noqa: F401

NORMS = "norms"  # the tuning cache family of these kernels (a key of custom_kernels.core.tuned_store.FAMILIES)
STRATEGIES = ("quick", "default", "exhaustive")
FINALISTS = 3
# Relative Frobenius error allowed against the float32 reference, by input dtype.
TOLERANCE = {"float32": 1e-4, "float16": 5e-3, "bfloat16": 2e-2}


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


@dataclasses.dataclass
class _Case:
    """Inputs, the float32 reference and a runner per config for one problem."""
    problem: nc.NormProblem
    rows: int

    def __post_init__(self):
        import torch

        from custom_kernels.norms import ops as norms

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
        eps = 1e-6 if p.kind == "rms" else 1e-5
        self.eps = eps
        out_dtype = dt[p.out_dtype]
        # Forward reference, and the saved statistics for the backward candidates.
        y, res_out, mean, rstd = norms._fwd_impl(p.kind, self.x, self.w, self.b, self.res, eps,
                                                 out_dtype, nc.heuristic(p).name)
        self.h = res_out if res_out is not None else self.x
        self.mean, self.rstd = mean, rstd
        hf = self.h.float()
        self.ref_h = (self.x.float() + self.res.float()).to(self.x.dtype) if p.residual else None
        if p.kind == "rms":
            self.ref_y = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps) * self.w.float()
        else:
            self.ref_y = torch.nn.functional.layer_norm(hf, (p.hidden,), self.w.float(),
                                                        self.b.float(), eps)
        if p.direction == "bwd":
            self.ref_grads = self._reference_grads(hf)
        self.torch_fn = self._torch_fn()

    def _reference_grads(self, hf):
        import torch

        p = self.problem
        hg = hf.detach().requires_grad_()
        wg = self.w.float().requires_grad_()
        bg = self.b.float().requires_grad_() if self.b is not None else None
        if p.kind == "rms":
            y = hg * torch.rsqrt(hg.pow(2).mean(-1, keepdim=True) + self.eps) * wg
        else:
            y = torch.nn.functional.layer_norm(hg, (p.hidden,), wg, bg, self.eps)
        inputs = [hg, wg] + ([bg] if bg is not None else [])
        grads = torch.autograd.grad(y, inputs, self.dy.float())
        dres = self.dy if p.residual else None  # the residual gradient stands in as dres
        dx = grads[0] + (dres.float() if dres is not None else 0)
        return (dx, *grads[1:])

    def _torch_fn(self) -> Callable[[], object]:
        """torch eager's same computation, for the entry's reference time."""
        import torch.nn.functional as F

        p = self.problem
        # torch's norms want one dtype: the parameters in x's (a float32 weight is cast once).
        w = self.w.to(self.h.dtype)
        b = self.b.to(self.h.dtype) if self.b is not None else None
        if p.direction == "fwd":
            if p.kind == "rms":
                return lambda: F.rms_norm(self.h, (p.hidden,), w, self.eps)
            return lambda: F.layer_norm(self.h, (p.hidden,), w, b, self.eps)
        import torch

        hg = self.h.detach().requires_grad_()
        wg = w.detach().requires_grad_()
        dy = self.dy.to(self.h.dtype)
        if p.kind == "rms":
            y = F.rms_norm(hg, (p.hidden,), wg, self.eps)
        else:
            y = F.layer_norm(hg, (p.hidden,), wg, b, self.eps)
        return lambda: torch.autograd.grad(y, (hg, wg), dy, retain_graph=True)

    def runner(self, config: nc.NormConfig) -> Callable[[], object]:
        from custom_kernels.norms import ops as norms

        p = self.problem
        if p.direction == "fwd":
            import torch

            out_dtype = getattr(torch, p.out_dtype)
            return lambda: norms._fwd_impl(p.kind, self.x, self.w, self.b, self.res, self.eps,
                                           out_dtype, config.name)
        dres = self.dy if p.residual else None
        return lambda: norms._bwd_impl(p.kind, self.dy, self.h, self.w, self.mean, self.rstd,
                                       dres, config.name)

    def error(self, out) -> float:
        if self.problem.direction == "fwd":
            pairs = [(out[0], self.ref_y)]
            if self.ref_h is not None:
                pairs.append((out[1], self.ref_h.float()))
        else:
            pairs = list(zip(out, self.ref_grads))
        return max(((a.float() - b).norm() / b.norm().clamp_min(1e-30)).item() for a, b in pairs)


def tune_problem(problem: nc.NormProblem, *, strategy: str = "default",
                 rows: int | None = None, reps: int = 20, jobs: int = 8,
                 progress: Callable[[str], None] = lambda message: None) -> dict:
    """Searches ``problem``'s configs on the current GPU; returns the cache entry (not stored)."""
    import torch

    from custom_kernels.norms import ops as norms
    from tuning.timing import do_bench, do_bench_interleaved

    start = time.perf_counter()
    configs = candidates(problem, strategy)
    rows = rows or default_rows(problem.hidden)
    progress(f"{problem.name}: compiling {len(configs)} candidates")
    compile_failures = norms.precompile_configs(problem, configs, workers=jobs)
    compile_s = time.perf_counter() - start
    case = _Case(problem, rows)
    tolerance = TOLERANCE[problem.dtype]
    timed, failures = {}, dict(compile_failures)
    for config in configs:
        if config.name in failures:
            continue
        try:
            run = case.runner(config)
            err = case.error(run())
            if not err <= tolerance:
                failures[config.name] = f"wrong result: relative error {err:.2e} > {tolerance}"
                continue
            timed[config.name] = do_bench(run, reps=reps, pad_host=True).median_ms
        except Exception as exc:  # noqa: BLE001 - a failing candidate is a result
            failures[config.name] = f"{type(exc).__name__}: {exc}"[:300]
    if not timed:
        raise RuntimeError(f"{problem.name}: every candidate failed: {failures}")
    heuristic = configs[0].name
    ranked = sorted(timed, key=timed.get)
    finalists = list(dict.fromkeys(ranked[:FINALISTS] + ([heuristic] if heuristic in timed
                                                          else [])))
    fns = {name: case.runner(nc.NormConfig.from_name(name)) for name in finalists}
    fns["torch"] = case.torch_fn
    final = {k: t.median_ms for k, t in
             do_bench_interleaved(fns, reps=max(reps, 20), pad_host=True).items()}
    torch_ms = final.pop("torch")
    winner = min(final, key=final.get)
    torch.cuda.empty_cache()
    return {
        "winner": winner, "winner_ms": final[winner], "heuristic": heuristic,
        "heuristic_ms": final.get(heuristic), "torch_ms": torch_ms, "reference": "torch eager",
        "rows": rows, "strategy": strategy,
        "gbps": _gbps(problem, rows, final[winner]),
        "runners_up": [{"config": name, "ms": timed[name]} for name in ranked[:8]],
        "failures": failures,
        "timings_s": {"compile": round(compile_s, 2),
                      "total": round(time.perf_counter() - start, 2)},
    }


def _gbps(problem: nc.NormProblem, rows: int, ms: float) -> float:
    size = nc.DTYPE_SIZES
    per_row = problem.hidden * (size[problem.dtype] + size[problem.out_dtype])
    if problem.direction == "bwd":
        per_row += problem.hidden * size[problem.dtype]  # x, dy read; dx written
    if problem.residual:
        per_row += problem.hidden * size[problem.dtype]
    return round(rows * per_row / ms / 1e6, 1)


def tune(problems: Iterable[nc.NormProblem], *, strategy: str = "default", force: bool = False,
         rows: int | None = None, reps: int = 20, jobs: int = 8,
         progress: Callable[[str], None] = print) -> list[tuple[nc.NormProblem, dict]]:
    """Tunes each problem not yet in the cache (all with ``force``); each entry is stored as
    soon as its problem is done, so an interrupted run keeps what it finished."""
    cache = norm_cache()
    out = []
    for problem in problems:
        entry = cache.get(problem)
        if entry is not None and not force:
            progress(f"{problem.name}: cached ({entry.get('winner')}); --force re-tunes")
            out.append((problem, entry))
            continue
        entry = tune_problem(problem, strategy=strategy, rows=rows, reps=reps, jobs=jobs,
                             progress=progress)
        cache.put(problem, entry)
        progress(f"{problem.name}: {entry['winner']} {entry['winner_ms']:.4f} ms "
                 f"({entry['gbps']} GB/s; heuristic {entry['heuristic']} "
                 f"{entry['heuristic_ms'] or math.nan:.4f} ms, torch {entry['torch_ms']:.4f} ms)")
        out.append((problem, entry))
    return out
