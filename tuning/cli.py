"""``cutlass-tune``: search, inspect and share tuned GEMM configs.

    cutlass-tune tune 16x4096x4096 4096x14336x4096 [--strategy quick|default|exhaustive]
    cutlass-tune tune --model mypkg.models:build --tokens 4096 [--backward]
    cutlass-tune bench | list | show SHAPE | export FILE | import FILE... | merge A B -o OUT
    cutlass-tune clear --yes | doctor | compile --dry-run SHAPES --gpu H100 | report
    cutlass-tune norms tune --hidden 4096 8192 [--kind rms ln] [--direction fwd bwd]
    cutlass-tune norms list | norms clear --yes

Listing commands take ``--json``. Nothing is written to the working directory unless a path is
given: reports go to the cache directory by default. An error is one line on stderr (exit code 2
for bad input, 1 otherwise); ``cutlass-tune --debug ...`` shows its traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from cutlass_ops.gemms.config import DType, GemmOperands, GemmProblem
from custom_kernels.core.elements import FLOATS, element

from tuning import cache_commands, tuned_families
from tuning.cli_output import EXIT_FAILED, EXIT_OK, EXIT_USAGE
from tuning.cli_output import emit as _emit, fmt_ms as _fmt


# ---- helpers ---------------------------------------------------------------------------------

_LAYOUT_LETTERS = {"t": "row", "n": "col"}  # BLAS-style: t row-major, n column-major


def _operands(args) -> GemmOperands:
    if getattr(args, "fp8", None):
        return _scaled_operands(args)
    layout = args.layout.lower()
    if len(layout) == 2:
        layout += "t"
    letters = _LAYOUT_LETTERS
    if len(layout) != 3 or any(c not in letters for c in layout):
        raise ValueError(f"--layout takes 2 or 3 letters of t (row-major) / n (column-major), "
                         f"got {args.layout!r}")
    return GemmOperands.make(args.dtype, layout_a=letters[layout[0]],
                             layout_b=letters[layout[1]], layout_c=letters[layout[2]],
                             out_dtype=args.out_dtype, epilogue=getattr(args, "epilogue", None))


def _scaled_operands(args) -> GemmOperands:
    """``--fp8 RECIPE``: the operands of ``cutlass_ops.scaled_mm`` (e4m3 A and B, K-major; D
    bf16 unless --out-dtype f32; --epilogue bias fuses a bias; --fast-accum torch's flag)."""
    from cutlass_ops.gemms.config import BiasMode, Epilogue
    from cutlass_ops.fp8.fp8_plan import scaled_operands

    epilogue = Epilogue.parse(args.epilogue)
    if args.layout.lower() not in ("tn", "tnt") or args.dtype != "bf16" or \
            epilogue.activation.value != "identity" or epilogue.residual or \
            epilogue.bias is BiasMode.M:
        raise ValueError("--fp8 tunes scaled_mm's GEMMs: FP8 A row-major and B column-major "
                         "(layout tn), an optional bias, and --out-dtype bf16 or f32")
    out = args.out_dtype or "bf16"
    if out not in ("bf16", "f32"):
        raise ValueError(f"--fp8 writes bf16 or f32, not {out}")
    return scaled_operands(args.fp8, out_dtype=out, bias=epilogue.bias is BiasMode.N,
                           fast_accum=args.fast_accum)


def _fp8_model_problems(args, model) -> list[GemmProblem]:
    """The FP8 GEMMs ``convert(model, fp8=RECIPE)`` runs (``cutlass_ops.fp8.recipes``): each
    Linear's forward, and with --backward its dgrad and wgrad, with the recipe's element types
    and accumulation, at the shapes of the model's (fused) Linear GEMMs on --tokens rows (the
    wgrad's reduction over tokens padded as the layer pads it)."""
    from cutlass_ops.fp8 import recipes
    from cutlass_ops.fp8.fp8_plan import scaled_operands
    from tuning import shapes

    recipe = recipes.get(args.fp8)
    forward = {(m, n, k) for (m, n, k, batch), layout, _ in
               shapes.harvest_linear_gemms(model, args.tokens) if layout.startswith("tn")}
    problems = []
    for m, n, k in sorted(forward):
        tokens = m + -m % recipe.token_multiple
        gemms = [(recipe.forward, (m, n, k))]
        if args.backward:
            gemms += [(recipe.dgrad, (m, k, n)), (recipe.wgrad, (n, k, tokens))]
        for gemm, (gm, gn, gk) in gemms:
            operands = scaled_operands(args.fp8, element_a=gemm.a.fp8, element_b=gemm.b.fp8,
                                       fast_accum=gemm.fast_accum)
            problems.append(GemmProblem(operands, gm, gn, gk))
    return problems


def _problems(args) -> list[GemmProblem]:
    from tuning import shapes

    operands = _operands(args)
    found = [shapes.parse_shape(s) for s in args.shapes]
    for path in args.file or []:
        found += _read_shapes_file(path)
    problems = [GemmProblem(operands, m, n, k, batch) for m, n, k, batch in found]
    if getattr(args, "problems_file", None):  # a --gpus worker's share
        from tuning.multi_gpu import read_problems_file

        problems += read_problems_file(args.problems_file)
    if getattr(args, "model", None):
        if not args.tokens:
            raise ValueError("--model needs --tokens (rows of activations per call, e.g. batch "
                             "x sequence length)")
        model = _load_model(args.model)
        if getattr(args, "fp8", None):
            problems += _fp8_model_problems(args, model)
        else:
            problems += shapes.model_problems(model, args.tokens, dtype=args.dtype,
                                              out_dtype=args.out_dtype,
                                              backward=args.backward)
    return list(dict.fromkeys(problems))


def _read_shapes_file(path: str) -> list[tuple[int, int, int, int]]:
    from tuning import shapes

    try:
        return shapes.read_shapes_file(path)
    except OSError as exc:
        raise ValueError(f"--file {path}: cannot read it ({exc.strerror})") from exc
    except UnicodeDecodeError as exc:
        raise ValueError(f"--file {path}: not UTF-8 text (byte {exc.start})") from exc


def _shape_label(problem: dict | GemmProblem) -> str:
    from tuning.shapes import format_shape

    p = problem if isinstance(problem, GemmProblem) else GemmProblem.from_dict(problem)
    return format_shape(p.m, p.n, p.k, p.batch)


def _gemm_entries(args) -> list[tuple]:
    """(cache, record) of every valid GEMM entry, for the GPUs ``--gpu`` names."""
    return [(cache, entry) for cache in tuned_families.caches("gemm", getattr(args, "gpu", None))
            for _, entry in sorted(cache.entries().items())]


# Builds show a count and the time, no rate or ETA: kernels found in the cache finish in
# microseconds and nvcc builds in tens of seconds, so a rate over both means nothing.
_BUILD_BAR = "{desc}: {n_fmt}/{total_fmt} kernels |{bar}| {elapsed}{postfix}"


def _progress(args):
    """A tqdm progress bar for builds and one for problems (stderr); none with --json."""
    if args.json or args.no_progress:
        return None
    from tqdm import tqdm

    bars: dict[str, Any] = {}

    def update(what: str, done: int, total: int, label: str) -> None:
        bar = bars.get(what)
        if bar is None:
            style = ({"desc": "compile", "bar_format": _BUILD_BAR} if what == "build"
                     else {"desc": "tune", "unit": "shape"})
            bar = bars[what] = tqdm(total=total, file=sys.stderr, leave=True, **style)
        bar.total = total
        bar.n = done
        bar.set_postfix_str(label[-60:], refresh=True)
        if done >= total:
            bar.close()

    return update


def make_backend(args):
    """The measuring backend (a seam: tests substitute a fake one)."""
    from tuning.backend import GpuBackend

    return GpuBackend(jobs=args.jobs)


# ---- commands --------------------------------------------------------------------------------

def cmd_tune(args) -> int:
    from tuning.search import tune

    if args.grouped:
        return _tune_grouped(args)
    problems = _problems(args)
    grouped = _model_grouped_problems(args)
    if not problems and not grouped:
        raise ValueError("no shapes: give MxNxK arguments, --file or --model")
    if not problems:
        return _tune_grouped(args, grouped)
    if args.gpus:
        code = _tune_on_gpus(args, problems)
        # The grouped GEMMs of --model's experts tune after, on this process's GPU.
        return _tune_grouped(args, grouped) if grouped and code == EXIT_OK else code
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1 and "RANK" in os.environ
    if distributed:  # under torchrun: this rank's share, on its local GPU
        import torch

        from custom_kernels.core.device import current_spec
        from tuning import multi_gpu

        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        problems = multi_gpu.rank_share(problems, current_spec())
    backend = make_backend(args)
    report = tune(problems, backend=backend, strategy=args.strategy, budget_s=args.budget,
                  force=args.force, use_heuristics=not args.no_heuristics,
                  progress=_progress(args))
    if distributed:
        _gather_ranks(backend)
    from cutlass_ops.gemms import dispatch

    dispatch.reset()
    rows = []
    for result in report.results:
        e = result.entry
        rows.append({"shape": _shape_label(result.problem), "operands":
                     result.problem.operands.name, "winner": e.get("winner_name"),
                     "winner_ms": e.get("winner_ms"), "torch_ms": e.get("torch_ms"),
                     "speedup": round(e["torch_ms"] / e["winner_ms"], 3)
                     if e.get("winner_ms") else None,
                     "prefer": e.get("prefer"), "cached": result.cached,
                     "complete": e.get("complete", True), "failures": len(e.get("failures", [])),
                     "tune_seconds": e.get("tune_seconds")})
    summary = {"results": rows, "build_seconds": round(report.build_seconds, 1),
               "measure_seconds": round(report.measure_seconds, 1),
               "kernels_compiled": report.built, "kernels_reused": report.reused}
    _emit(args, summary,
          (["shape", "winner", "ms", "torch ms", "speedup", "uses", "failures", "cached"],
           [[r["shape"], r["winner"] or "-", _fmt(r["winner_ms"]), _fmt(r["torch_ms"]),
             r["speedup"] or "-", r["prefer"], r["failures"], r["cached"]] for r in rows]),
          f"compiled {report.built} kernels, reused {report.reused}, build "
          f"{report.build_seconds:.0f} s, measurement {report.measure_seconds:.0f} s")
    if grouped and (not distributed or os.environ["RANK"] == "0"):
        # The model's mixture-of-experts GEMMs, after its dense ones (under torchrun on rank 0
        # only: they are few, and not sharded).
        return _tune_grouped(args, grouped)
    return EXIT_OK


def _model_grouped_problems(args) -> list:
    """--model's mixture-of-experts GEMMs (``tuning.shapes.model_grouped_problems``), if any."""
    if not getattr(args, "model", None):
        return []
    from tuning import shapes

    return shapes.model_grouped_problems(_load_model(args.model), args.tokens,
                                         dtype=args.dtype, backward=args.backward)


_models: dict = {}


def _load_model(spec: str):
    """--model's module, built once per process (its dense and its grouped GEMMs both read it)."""
    from tuning import shapes

    if spec not in _models:
        _models[spec] = shapes.load_model(spec)
    return _models[spec]


def _tune_on_gpus(args, problems) -> int:
    """``--gpus``: one worker process per GPU on its share of the problems, one cache."""
    import torch

    from tuning import multi_gpu

    devices = multi_gpu.parse_gpus(args.gpus, torch.cuda.device_count())
    options = ["--strategy", args.strategy, "--no-progress"]
    options += ["--force"] * args.force + ["--no-heuristics"] * args.no_heuristics
    if args.budget:
        options += ["--budget", str(args.budget)]
    if args.jobs:
        options += ["--jobs", str(args.jobs)]
    parts, codes = multi_gpu.tune_on_gpus(problems, devices, options)
    _emit(args, {"gpus": devices, "problems_per_gpu": [len(p) for p in parts],
                 "exit_codes": codes},
          text=f"tuned {len(problems)} problems on GPUs {devices} "
               f"({', '.join(str(len(p)) for p in parts)} each); worker exit codes {codes}")
    from cutlass_ops.gemms import dispatch

    dispatch.reset()
    return EXIT_OK if all(code == 0 for code in codes) else EXIT_FAILED


def _gather_ranks(backend) -> None:
    """Under torchrun: rank 0's cache gets every rank's entries (torch.distributed, gloo)."""
    import torch.distributed as dist

    from cutlass_ops.gemms.gemm_entries import gemm_cache
    from tuning import multi_gpu

    if not dist.is_initialized():
        dist.init_process_group("gloo")
    changed = multi_gpu.gather_entries(gemm_cache(backend.scope()))
    if dist.get_rank() == 0:
        print(f"rank 0 merged {changed} entries of the other ranks", file=sys.stderr)
    dist.barrier()


def _tune_grouped(args, problems: list | None = None) -> int:
    """``tune --grouped E:N:K --tokens ROWS``: the grouped (MoE expert) GEMMs, forward and with
    --backward dX and dW, over ROWS routed rows (tokens x top-k); or ``problems`` (--model's)."""
    from tuning import grouped_search

    from cutlass_ops.gemms.grouped.grouped_build import ELEMENTS

    if getattr(args, "fp8", None) and problems is None:
        return _tune_grouped_fp8(args)
    if args.dtype not in ELEMENTS:
        raise ValueError(f"grouped GEMMs are {' or '.join(ELEMENTS)}, not {args.dtype}")
    if problems is None:
        shapes = [grouped_search.parse(spec) for spec in args.grouped]
        if not args.tokens:
            raise ValueError("--grouped needs --tokens: the routed rows (tokens x top-k)")
        problems = [p for shape in shapes for p in grouped_search.moe_problems(
            *shape, args.tokens, backward=args.backward, element=args.dtype)]
    results = grouped_search.tune(problems, strategy=args.strategy, force=args.force,
                                  progress=lambda message: print(message, file=sys.stderr))
    rows = [{"problem": r.problem.name, "winner": r.entry.get("winner"),
             "path": r.entry.get("backend") or ("cutlass" if r.entry.get("winner") else None),
             "winner_ms": r.entry.get("winner_ms"), "torch_ms": r.entry.get("torch_ms"),
             "speedup": round(r.entry["torch_ms"] / r.entry["winner_ms"], 3)
             if r.entry.get("winner_ms") else None, "prefer": r.entry.get("prefer"),
             "other_path_best": r.entry.get("other_backend_best"),
             "failures": len(r.entry.get("failures", [])), "cached": r.cached} for r in results]
    _emit(args, {"results": rows},
          (["problem", "winner", "path", "ms", "torch._grouped_mm ms", "speedup", "uses",
            "other path best ms", "failures", "cached"],
           [[r["problem"], r["winner"] or "-", r["path"] or "-", _fmt(r["winner_ms"]),
             _fmt(r["torch_ms"]), r["speedup"] or "-", r["prefer"],
             _fmt((r["other_path_best"] or {}).get("ms")), r["failures"], r["cached"]]
            for r in rows]))
    return EXIT_OK


def _tune_grouped_fp8(args) -> int:
    """``tune --grouped E:N:K --tokens ROWS --fp8 blockwise|rowwise``: the FP8 grouped kernels of
    ``cutlass_ops.scaled_grouped_mm`` (the forward), timed beside torch's call
    (``tuning.grouped_fp8_search``)."""
    from tuning import grouped_fp8_search, grouped_search

    if args.backward:
        raise ValueError("--fp8 with --grouped tunes the forward (scaled_grouped_mm's 2d-3d form); "
                         "leave out --backward")
    if not args.tokens:
        raise ValueError("--grouped needs --tokens: the routed rows (tokens x top-k)")
    problems = [p for spec in args.grouped for p in grouped_fp8_search.moe_problems(
        *grouped_search.parse(spec), args.tokens, recipe=args.fp8)]
    results = grouped_fp8_search.tune(problems, strategy=args.strategy, force=args.force,
                                      progress=lambda message: print(message, file=sys.stderr))
    rows = [{"problem": r.problem.name, "winner": r.entry.get("winner"),
             "winner_ms": r.entry.get("winner_ms"), "torch_ms": r.entry.get("torch_ms"),
             "speedup": round(r.entry["torch_ms"] / r.entry["winner_ms"], 3)
             if r.entry.get("winner_ms") else None, "prefer": r.entry.get("prefer"),
             "failures": len(r.entry.get("failures", [])), "cached": r.cached} for r in results]
    _emit(args, {"results": rows},
          (["problem", "winner", "ms", "torch ms", "speedup", "uses", "failures", "cached"],
           [[r["problem"], r["winner"] or "-", _fmt(r["winner_ms"]), _fmt(r["torch_ms"]),
             r["speedup"] or "-", r["prefer"], r["failures"], r["cached"]] for r in rows]))
    return EXIT_OK


def cmd_bench(args) -> int:
    """Times tuned winners against torch.matmul now (fresh inputs)."""
    from cutlass_ops.gemms.gemm_entries import gemm_cache

    backend = make_backend(args)
    scope = backend.scope()
    entries = gemm_cache(scope).entries()
    wanted = {p.name for p in _problems(args)} if (args.shapes or args.file) else None
    rows = []
    for name, entry in sorted(entries.items()):
        if wanted is not None and name not in wanted or entry.winner is None:
            continue
        problem, choice = entry.problem, entry.winner
        session = backend.session(problem)
        try:
            error = session.verify(choice)
            if error:
                ours, ref = None, session.torch_ms(args.reps)
            else:  # beside torch, interleaved, as the tuner's final round
                final, ref = session.compare_ms([choice], args.reps)
                ours = final[choice]
        finally:
            session.close()
        rows.append({"shape": _shape_label(problem), "operands": problem.operands.name,
                     "winner": entry.winner_name, "backend": choice.backend,
                     "ours_ms": ours, "torch_ms": ref,
                     "ours_tflops": round(problem.flops / ours / 1e9, 1) if ours else None,
                     "torch_tflops": round(problem.flops / ref / 1e9, 1),
                     "ratio": round(ref / ours, 3) if ours else None, "error": error})
    _emit(args, {"gpu": scope.gpu, "rows": rows},
          (["shape", "ours TFLOP/s", "torch TFLOP/s", "ratio", "winner"],
           [[r["shape"], r["ours_tflops"] or r["error"], r["torch_tflops"], r["ratio"] or "-",
             r["winner"]] for r in rows]))
    return EXIT_OK if all(r["error"] is None for r in rows) else EXIT_FAILED


# ---- norms: the fused RMSNorm / LayerNorm kernels' launch configs ------------------------------

# The norms' element types: our names on the command line, torch's in the tuning keys.
_NORM_DTYPES = {e.name: e.torch_name for e in FLOATS}


def _norm_problems(args):
    from custom_kernels.norms import norm_config as nc

    dtype = _NORM_DTYPES[args.dtype]
    out = _NORM_DTYPES[args.out_dtype] if args.out_dtype else dtype
    weight = _NORM_DTYPES[args.weight_dtype] if args.weight_dtype else dtype
    vec = 16 // nc.DTYPE_SIZES[dtype]
    return [nc.NormProblem(kind, direction, hidden, dtype, out, weight,
                           aligned=hidden % vec == 0, residual=args.residual)
            for hidden in args.hidden for kind in args.kind for direction in args.direction]


def _require_cuda_gpu() -> None:
    import torch

    from custom_kernels.core.errors import UnsupportedInputError

    if not torch.cuda.is_available():
        raise UnsupportedInputError(f"tuning needs a CUDA GPU, and torch {torch.__version__} "
                                    "sees none")


def cmd_norms_tune(args) -> int:
    from tuning import norm_search

    problems = _norm_problems(args)
    _require_cuda_gpu()
    say = (lambda message: print(message, file=sys.stderr)) if args.json else print
    results = norm_search.tune(problems, strategy=args.strategy, force=args.force, rows=args.rows,
                             reps=args.reps, jobs=args.jobs or 8, progress=say)
    if args.json:
        _emit(args, [{"problem": p.name, **entry} for p, entry in results])
    return EXIT_OK


def cmd_doctor(args) -> int:
    from tuning.doctor import diagnose

    report = diagnose()
    rows = [[item["what"], "ok" if item["ok"] else "MISSING", item["detail"]]
            for item in report["checks"]]
    _emit(args, report, (["check", "status", "detail"], rows),
          "missing: " + ", ".join(report["missing"]) if report["missing"] else "all present")
    return EXIT_OK if not report["missing_required"] else EXIT_FAILED


def _spec_for_args(args):
    from custom_kernels.core import device

    if args.gpu:
        return device.named_spec(args.gpu)
    try:
        import torch

        if torch.cuda.is_available():
            return device.current_spec()
    except ImportError:
        pass
    print(f"no GPU found: ranking for H100; pass --gpu {'|'.join(device.KNOWN)} for another",
          file=sys.stderr)
    return device.named_spec("H100")


def cmd_compile(args) -> int:
    from cutlass_ops.gemms.loader import is_built

    spec = _spec_for_args(args)
    kernels = _kernels_to_compile(args, spec)
    rows = []
    for (operands, config), shapes in kernels.items():
        built = _quiet_bool(lambda: is_built(operands, config))
        rows.append({"operands": operands.name, "kernel": config.build_name, "built": built,
                     "for": shapes})
    if args.dry_run:
        _emit(args, {"gpu": spec.name, "arch": spec.arch, "kernels": rows},
              (["operands", "kernel", "built", "shapes"],
               [[r["operands"], r["kernel"], r["built"], ",".join(r["for"][:3])] for r in rows]),
              f"{len(rows)} kernels on {spec.name}; "
              f"{sum(not r['built'] for r in rows)} to build")
        return EXIT_OK
    return _build_kernels(args, list(kernels), to_build=sum(not r["built"] for r in rows))


def _kernels_to_compile(args, spec) -> dict[tuple, list[str]]:
    """(operands, config) -> the shapes it serves: the candidates of the shapes given, and with
    --tuned the cached winners for ``spec``'s GPU."""
    from tuning import candidates

    kernels: dict[tuple, list[str]] = {}
    if args.tuned:  # the winners in the cache (imported from another machine, say)
        for cache, entry in _gemm_entries(args):
            if entry.winner is not None and spec.name.lower() in cache.scope.gpu.lower() and \
                    entry.backend == "cutlass":  # DSL and skinny kernels build in process
                problem, choice = entry.problem, entry.winner
                key = (choice.operands_for(problem.operands), choice.config)
                kernels.setdefault(key, []).append(_shape_label(problem))
    problems = _problems(args)
    if not problems and not kernels:
        raise ValueError("no shapes: give MxNxK arguments, --file, --model or --tuned")
    for problem in problems:
        for choice in candidates.select(problem, spec, args.strategy,
                                        use_heuristics=not args.no_heuristics):
            key = (choice.operands_for(problem.operands), choice.config)
            kernels.setdefault(key, []).append(_shape_label(problem))
    return kernels


def _build_kernels(args, kernels: list[tuple], to_build: int) -> int:
    """Emits and builds ``kernels``; says first what the slow steps will be, counts in the
    progress bar and the summary only real builds (a kernel found in the cache takes no time)."""
    from cutlass_ops.gemms import emit, loader

    to_emit = sum(not _quiet_bool(lambda: emit.cached_source(*key) is not None)
                  for key in kernels)
    steps = [f"building {to_build} kernels with nvcc ({len(kernels) - to_build} already in the "
             "cache)"]
    if to_emit:
        steps.insert(0, f"emitting {to_emit} kernel sources with cutlass_cppgen (about a minute "
                        "on a cold cache)")
    print(", then ".join(steps) + "...", file=sys.stderr)
    progress = _progress(args) if to_build else None
    done = 0

    def on_done(build_spec, result):
        nonlocal done
        if getattr(result, "seconds", None) == 0.0:  # found in the cache: not a build
            return
        done += 1
        if progress:
            progress("build", done, to_build, build_spec.name)

    if progress:
        progress("build", 0, to_build, "")
    results = loader.prepare_many(kernels, jobs=args.jobs, on_done=on_done)
    if progress and done < to_build:  # some failed before nvcc, or another process built them
        progress("build", done, done, "")
    failed = {f"{o.name}-{c.build_name}": str(r)[:200] for (o, c), r in results.items()
              if isinstance(r, Exception)}
    cached = sum(not isinstance(r, Exception) and r.seconds == 0.0 for r in results.values())
    built = len(results) - len(failed) - cached
    _emit(args, {"built": built, "already_built": cached, "failed": failed},
          text=f"{built} built, {cached} already in the cache, {len(failed)} failed" +
               "".join(f"\n  {k}: {v}" for k, v in failed.items()))
    return EXIT_OK if not failed else EXIT_FAILED


def _quiet_bool(fn) -> bool:
    try:
        return bool(fn())
    except Exception:  # no nvcc here: nothing can be built, so nothing is
        return False


def cmd_report(args) -> int:
    from custom_kernels.core import cache_dir
    from custom_kernels.core import device
    from tuning.report import plot_report

    by_gpu: dict[str, list] = {}
    for cache, entry in _gemm_entries(args):
        by_gpu.setdefault(cache.scope.gpu, []).append(entry)
    if not by_gpu:
        print("nothing tuned yet", file=sys.stderr)
        return EXIT_FAILED
    paths = []
    for gpu, entries in by_gpu.items():
        spec = device.spec_for(gpu, 90, 132)
        rows = []
        for e in entries:
            p = e.problem
            ops = p.operands
            rows.append({"label": f"{_shape_label(p)} {ops.element_a.value}", "flops": p.flops,
                         "bytes": (p.m * p.k * ops.element_a.bytes + p.k * p.n * ops.element_b.bytes
                                   + p.m * p.n * ops.element_d.bytes) * p.batch,
                         "tuned_tflops": e.field("winner_tflops"),
                         "torch_tflops": e.field("torch_tflops")})
        rows.sort(key=lambda r: r["flops"])
        slug = "".join(c if c.isalnum() else "-" for c in gpu).strip("-").lower()
        path = Path(args.out) if args.out and len(by_gpu) == 1 else (
            Path(args.out).with_name(f"{Path(args.out).stem}-{slug}.png") if args.out
            else cache_dir.versioned_dir("reports") / f"report-{slug}.png")
        plot_report(rows, path, title=f"cutlass-ops tuned vs torch.matmul on {gpu}",
                    peak_tflops=spec.peak_tflops, bandwidth_gbs=spec.dram_gbs)
        paths.append(str(path))
    _emit(args, {"reports": paths}, text="\n".join(f"wrote {p}" for p in paths))
    return EXIT_OK


# ---- parser ----------------------------------------------------------------------------------

EXAMPLES = """\
examples:
  cutlass-tune tune 16x4096x4096 4096x14336x4096 --strategy quick
  cutlass-tune tune --model mypkg.models:build --tokens 4096 --backward
  cutlass-tune compile --dry-run 16x4096x4096 --gpu H200     (no GPU needed)
  cutlass-tune export tuned.json    (then `cutlass-tune import tuned.json` on another machine)

The cache lives in the user cache directory; set CUTLASS_OPS_CACHE_DIR to move it."""

# The plain GEMMs' element types; FP8 operands need scales (cutlass_ops.scaled_mm), whose tune
# is not in the CLI yet.
_DTYPES = [d.value for d in DType if not element(d).is_fp8]
_STRATEGY_HELP = ("how many configs to try: quick (a handful), default, exhaustive (every one "
                  "the rules allow); default: %(default)s")


def _add_problem_args(p: argparse.ArgumentParser, model: bool = True) -> None:
    p.add_argument("shapes", nargs="*", metavar="MxNxK[xL]", help="GEMM shapes (L: batch)")
    p.add_argument("--file", action="append", help="a file of shapes, one per line")
    if model:
        p.add_argument("--model", help="package.module:factory returning an nn.Module; its "
                       "Linear layers give the shapes (built on the meta device), and its "
                       "mixture-of-experts layers grouped GEMMs (tune only)")
        p.add_argument("--tokens", type=int, help="rows per call for --model (batch x seq)")
        p.add_argument("--backward", action="store_true",
                       help="with --model, add the two backward GEMMs of each Linear (dX = dY W "
                       "in layout tt, dW = dY^T X in nt, as cutlass_ops.nn.Linear runs them)")
    p.add_argument("--dtype", default="bf16", choices=_DTYPES,
                   help="A and B element type; default: %(default)s")
    p.add_argument("--out-dtype", choices=_DTYPES, help="D's element type; default: --dtype")
    p.add_argument("--layout", default="tn", help="A, B (and D) layouts: t row-major, "
                   "n column-major; default tn (y = x @ W.T)")
    p.add_argument("--epilogue", default="", help="a fused epilogue, D = act(AB + bias) + C: "
                   "a comma list of bias (per column, nn.Linear's), bias_m (per row), residual, "
                   "and one of relu, gelu, gelu_tanh, silu; e.g. bias,gelu_tanh")
    p.add_argument("--fp8", choices=["tensorwise", "rowwise", "blockwise"],
                   help="FP8 GEMMs of cutlass_ops.scaled_mm with this scaling recipe (e4m3 "
                   "operands, layout tn, bf16 or --out-dtype f32 output); with --model, the "
                   "GEMMs convert(model, fp8=RECIPE) runs, with the recipe's types")
    p.add_argument("--fast-accum", action="store_true",
                   help="with --fp8: torch._scaled_mm's use_fast_accum (tensorwise, rowwise)")


def _add_build_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--jobs", type=int, help="parallel nvcc processes (default: CPU count)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


def build_parser() -> argparse.ArgumentParser:
    from custom_kernels.core.version import __version__

    parser = argparse.ArgumentParser(
        prog="cutlass-tune", description=__doc__.splitlines()[0].replace("``", ""),
        epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    parser.add_argument("--debug", action="store_true",
                        help="show the full traceback of an error (default: one line)")
    sub = parser.add_subparsers(dest="command", required=True)

    def command(name, fn, help, json_flag=True, gpu_filter=False):
        p = sub.add_parser(name, help=help, description=help)
        p.set_defaults(fn=fn)
        if json_flag:
            p.add_argument("--json", action="store_true", help="machine-readable output")
        if gpu_filter:
            p.add_argument("--gpu", help="only this GPU's entries (substring of its name)")
        return p

    p = command("tune", cmd_tune, "search configs for shapes and cache the winners")
    _add_problem_args(p)
    p.add_argument("--strategy", default="default", choices=["quick", "default", "exhaustive"],
                   help=_STRATEGY_HELP)
    p.add_argument("--budget", type=float, help="time budget in seconds (keeps the best so far)")
    p.add_argument("--force", action="store_true", help="re-tune shapes already in the cache")
    p.add_argument("--no-heuristics", action="store_true",
                   help="rank with our model only, not nvidia-matmul-heuristics")
    p.add_argument("--gpus", help="all, or device indices like 0,1: one worker per GPU on a "
                   "balanced share of the shapes, the results in one cache (under torchrun "
                   "without --gpus, each rank tunes its share and rank 0 gathers them)")
    # One --gpus worker's problems, written by the parent (any operands; not for users).
    p.add_argument("--problems-file", help=argparse.SUPPRESS)
    p.add_argument("--grouped", action="append", metavar="E:N:K",
                   help="tune the grouped (mixture-of-experts) GEMM of E experts, K -> N each, "
                   "over --tokens routed rows (tokens x top-k); with --backward its dX and dW "
                   "too (cutlass_ops.grouped_mm runs the winners); with --fp8 blockwise or rowwise "
                   "the FP8 forward (cutlass_ops.scaled_grouped_mm runs the winners; rowwise ones "
                   "where they beat torch._scaled_grouped_mm)")
    _add_build_args(p)

    p = command("bench", cmd_bench, "time tuned winners against torch.matmul (a table)")
    _add_problem_args(p, model=False)
    p.add_argument("--reps", type=int, default=50,
                   help="timed repetitions per kernel; default: %(default)s")
    p.add_argument("--jobs", type=int, help="parallel nvcc processes (default: CPU count)")

    p = command("list", cache_commands.cmd_list, "the tuned entries as a table (every family, "
                "or --family's)", gpu_filter=True)
    cache_commands.add_family_argument(p)
    p = command("show", cache_commands.cmd_show, "one problem's entries: winner, runners-up, "
                "failures", gpu_filter=True)
    p.add_argument("shape", metavar="MxNxK[xL]|KEY",
                   help="a GEMM shape (L: batch), or any family's key as `list --json` prints it")
    cache_commands.add_family_argument(p)
    p.add_argument("--dtype", choices=_DTYPES, help="only entries of this A element type")

    p = command("export", cache_commands.cmd_export, "write the cache (every GPU) to a file",
                json_flag=False, gpu_filter=True)
    p.add_argument("file", help="the JSON file to write")
    cache_commands.add_family_argument(p)
    p = command("import", cache_commands.cmd_import, "merge exported files into the cache (each "
                "entry checked; files over 32 MiB refused)")
    p.add_argument("files", nargs="+", help="files written by export or merge")
    p = command("merge", cache_commands.cmd_merge, "merge exported files into one file (the "
                "cache untouched)")
    p.add_argument("files", nargs="+", help="files written by export or merge")
    p.add_argument("-o", "--output", required=True, help="the merged JSON file to write")
    p = command("clear", cache_commands.cmd_clear, "delete tuned entries (every family, or "
                "--family's)", json_flag=False, gpu_filter=True)
    p.add_argument("--yes", action="store_true", help="really delete")
    cache_commands.add_family_argument(p)
    command("doctor", cmd_doctor, "what is installed, found and missing")

    p = command("compile", cmd_compile, "build (or list with --dry-run) the kernels a tune "
                "would compile; needs nvcc, not a GPU")
    _add_problem_args(p)
    p.add_argument("--dry-run", action="store_true",
                   help="list the kernels and whether each is built; build nothing")
    p.add_argument("--tuned", action="store_true",
                   help="also the winners already in the tuning cache for this GPU")
    p.add_argument("--gpu", help="rank for this GPU (H100, H200, ...); default: this machine's")
    p.add_argument("--strategy", default="default", choices=["quick", "default", "exhaustive"],
                   help=_STRATEGY_HELP)
    p.add_argument("--no-heuristics", action="store_true",
                   help="rank with our model only, not nvidia-matmul-heuristics")
    _add_build_args(p)

    p = command("report", cmd_report, "PNG plot of tuned and cuBLAS TFLOP/s with the roofline",
                gpu_filter=True)
    p.add_argument("--out", help="PNG path (default: in the cache directory)")
    _add_norm_parsers(sub)
    return parser


def _add_norm_parsers(sub) -> None:
    norms = sub.add_parser("norms", help="tune / list / clear the fused norms' launch configs",
                           description="The RMSNorm / LayerNorm kernels' configs (threads, rows "
                           "per block, cluster, stages), searched on this GPU and cached.")
    norm_sub = norms.add_subparsers(dest="norm_command", required=True)
    p = norm_sub.add_parser("tune", help="search configs for hidden sizes and cache the winners")
    p.set_defaults(fn=cmd_norms_tune)
    p.add_argument("--hidden", type=int, nargs="+", required=True,
                   help="hidden sizes (the normalized dimension)")
    p.add_argument("--kind", nargs="+", default=["rms", "ln"], choices=["rms", "ln"],
                   help="RMSNorm, LayerNorm or both (default)")
    p.add_argument("--direction", nargs="+", default=["fwd", "bwd"], choices=["fwd", "bwd"],
                   help="forward, backward or both (default)")
    p.add_argument("--dtype", default="bf16", choices=list(_NORM_DTYPES),
                   help="x's element type; default: %(default)s")
    p.add_argument("--out-dtype", choices=list(_NORM_DTYPES), help="y (and dy); default --dtype")
    p.add_argument("--weight-dtype", choices=list(_NORM_DTYPES), help="default --dtype")
    p.add_argument("--residual", action="store_true", help="the fused residual-add variant")
    p.add_argument("--strategy", default="default", choices=["quick", "default", "exhaustive"],
                   help=_STRATEGY_HELP)
    p.add_argument("--rows", type=int, help="rows to time with (default: 32768, fewer when long)")
    p.add_argument("--reps", type=int, default=20,
                   help="timed repetitions per config; default: %(default)s")
    p.add_argument("--force", action="store_true", help="re-tune problems already cached")
    p.add_argument("--jobs", type=int, help="parallel NVRTC processes (default 8)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p = norm_sub.add_parser("list", help="the norm entries of the tuning cache as a table")
    p.set_defaults(fn=cache_commands.cmd_norms_list)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--gpu", help="only this GPU's entries (substring of its name)")
    p = norm_sub.add_parser("clear", help="delete the norm tuning entries")
    p.set_defaults(fn=cache_commands.cmd_norms_clear)
    p.add_argument("--gpu", help="only this GPU's entries (substring of its name)")
    p.add_argument("--yes", action="store_true", help="really delete")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from custom_kernels.core.errors import CutlassOpsError

    command = " ".join(filter(None, [args.command, getattr(args, "norm_command", None)]))
    try:
        return args.fn(args)
    except (ValueError, CutlassOpsError, ImportError, OSError) as exc:
        if args.debug:
            raise
        # One line: the errors we raise name the problem and the way out.
        print(f"cutlass-tune {command}: {exc}", file=sys.stderr)
        return EXIT_USAGE if isinstance(exc, ValueError) else EXIT_FAILED
    except KeyboardInterrupt:
        print("interrupted: finished shapes are in the cache", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
