"""``cutlass-tune`` over the tuned-results store: ``list``, ``show``, ``export``, ``import``,
``merge`` and ``clear``, for every kernel family or the one ``--family`` names (``norms list`` and
``norms clear`` are ``--family norms``).

Everything read comes through the families' schemas (``tuning.tuned_families``): a malformed
entry is one log line and a count, never a traceback, and is neither listed, exported nor
imported. ``import`` refuses files over ``tuned_store.MAX_FILE_BYTES`` before reading them.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from custom_kernels.core.tuned_store import (CacheScope, ImportReport, Rejection, bundle,
                                             import_documents, merge_documents,
                                             parse_documents, read_document_file)
from tuning import tuned_families
from tuning.cli_output import EXIT_FAILED, EXIT_OK, emit, fmt_ms, print_table, ratio
from tuning.shapes import format_shape, parse_shape


# ---- one row per entry, by family ------------------------------------------------------------

def _gemm_row(scope: CacheScope, entry) -> dict[str, Any]:
    p = entry.problem
    return {"family": "gemm", "gpu": scope.gpu, "key": entry.key,
            "shape": format_shape(p.m, p.n, p.k, p.batch), "operands": p.operands.name,
            "winner": entry.winner_name, "winner_ms": entry.winner_ms, "torch_ms": entry.torch_ms,
            "backend": entry.backend, "other_backend_best": entry.field("other_backend_best"),
            "winner_tflops": entry.field("winner_tflops"),
            "torch_tflops": entry.field("torch_tflops"), "speedup": ratio(entry.speedup),
            "prefer": entry.prefer, "complete": entry.complete,
            "strategy": entry.field("strategy")}


def _grouped_row(scope: CacheScope, entry) -> dict[str, Any]:
    p = entry.problem
    return {"family": "grouped", "gpu": scope.gpu, "key": entry.key, "shape": entry.key,
            "operands": f"{p.element}_{p.layout_a}{p.layout_b}", "winner": entry.winner_name,
            "winner_ms": entry.winner_ms, "torch_ms": entry.torch_ms,
            "backend": entry.field("backend"), "speedup": ratio(entry.speedup),
            "prefer": entry.prefer, "complete": entry.complete}


def _grouped_fp8_row(scope: CacheScope, entry) -> dict[str, Any]:
    # torch_ms: blockwise, torch._grouped_mm in bf16 on the same values (the winner always runs);
    # rowwise, torch._scaled_grouped_mm (the winner runs where it beat it: prefer).
    return {"family": "grouped_fp8", "gpu": scope.gpu, "key": entry.key, "shape": entry.key,
            "operands": f"e4m3_{entry.problem.recipe}", "winner": entry.winner_name,
            "winner_ms": entry.winner_ms, "torch_ms": entry.torch_ms, "backend": "cutlass",
            "speedup": ratio(entry.speedup), "prefer": entry.prefer if entry.winner else "-",
            "complete": entry.complete}


def _norm_row(scope: CacheScope, entry) -> dict[str, Any]:
    p = entry.problem
    return {"family": "norms", "gpu": scope.gpu, "key": entry.key, "problem": entry.key,
            "shape": entry.key, "operands": f"{p.dtype}_{p.out_dtype}_{p.weight_dtype}",
            "winner": entry.winner_name, "winner_ms": entry.winner_ms, "torch_ms": entry.torch_ms,
            "gbps": entry.field("gbps"), "backend": "nvrtc",
            "vs_heuristic": ratio(entry.heuristic_ms / entry.winner_ms
                                  if entry.heuristic_ms else None),
            "vs_torch": ratio(entry.speedup), "speedup": ratio(entry.speedup),
            "prefer": "kernel", "failures": len(entry.failures)}


_ROWS = {"gemm": _gemm_row, "grouped": _grouped_row, "grouped_fp8": _grouped_fp8_row,
         "norms": _norm_row}


def _entries(args) -> tuple[list[tuple[Any, Any]], int]:
    """((cache, entry) of every valid entry selected, how many were rejected)."""
    found, rejected = [], 0
    for cache in tuned_families.caches(getattr(args, "family", "all"), args.gpu):
        found += [(cache, entry) for _, entry in sorted(cache.entries().items())]
        rejected += len(cache.rejections())
    return found, rejected


def _say_rejected(rejected: int) -> None:
    if rejected:
        print(f"{rejected} stored entries were rejected and skipped (each named in a log line "
              "above; `cutlass-tune doctor` counts them)", file=sys.stderr)


# ---- commands ------------------------------------------------------------------------------------

def cmd_list(args) -> int:
    found, rejected = _entries(args)
    rows = [_ROWS[cache.family](cache.scope, entry) for cache, entry in found]
    emit(args, rows, (["family", "gpu", "problem", "operands", "speedup", "uses", "winner",
                       "path"],
                      [[r["family"], r["gpu"], r["shape"], r["operands"], r["speedup"] or "-",
                        r["prefer"], r["winner"] or "-", r["backend"] or "-"] for r in rows]))
    _say_rejected(rejected)
    return EXIT_OK


def _matches(spec: str, entry, dtype: str | None) -> bool:
    """Whether ``spec`` (an ``MxNxK[xL]`` GEMM shape, or any family's key) names ``entry``."""
    if entry.key == spec:
        return True
    try:
        shape = parse_shape(spec)
    except ValueError:
        return False
    p = getattr(entry, "problem", None)
    return hasattr(p, "operands") and (p.m, p.n, p.k, p.batch) == shape and (
        not dtype or p.operands.element_a.value == dtype)


def cmd_show(args) -> int:
    found, rejected = _entries(args)
    matches = [(cache, entry) for cache, entry in found if _matches(args.shape, entry, args.dtype)]
    _say_rejected(rejected)
    if not matches:
        print(f"no tuned entry for {args.shape}", file=sys.stderr)
        return EXIT_FAILED
    if args.json:
        emit(args, [{"family": c.family, "gpu": c.scope.gpu, "scope": c.scope.to_dict(),
                     "key": e.key, **e.to_dict()} for c, e in matches])
        return EXIT_OK
    for cache, e in matches:
        row = _ROWS[cache.family](cache.scope, e)
        print(f"{e.key} on {cache.scope.gpu}: winner {row['winner'] or '-'} "
              f"({row['backend'] or '-'} path) {fmt_ms(e.winner_ms)} ms, reference "
              f"{fmt_ms(e.torch_ms)} ms, uses {row['prefer']} ({e.field('strategy')}, "
              f"{e.field('tuned_at')})")
        whole = getattr(e, "whole_call_ms", None)
        if whole is not None:
            where = "inside CUDA graphs only" if e.eager_prefers_torch else \
                "eagerly only (torch.matmul inside CUDA graphs)" if e.eager_prefers_kernel else \
                "eagerly too" if e.uses_kernel else "nowhere (torch.matmul everywhere)"
            print(f"  whole eager call: {whole * 1e3:.1f} us, torch.matmul's "
                  f"{e.torch_whole_call_ms * 1e3:.1f} us: the winner runs {where}")
        other = e.field("other_backend_best")
        if other:
            print(f"  best of the {other['backend']} path: "
                  f"{other.get('choice') or other.get('config')} {fmt_ms(other['ms'])} ms")
        runners = getattr(e, "runners_up", ())
        print_table(["runner-up", "ms"], [[name, fmt_ms(ms)] for name, ms in runners])
        failures = e.failures.items() if isinstance(e.failures, dict) else \
            [(name, f"{stage}: {error}") for name, stage, error in e.failures]
        if failures:
            print_table(["failed", "error"], [[name, error[:80]] for name, error in failures])
    return EXIT_OK


def cmd_export(args) -> int:
    from custom_kernels.core.cache_dir import atomic_write_json

    caches = tuned_families.caches(args.family, args.gpu)
    docs = [cache.export() for cache in caches]
    atomic_write_json(Path(args.file), bundle(docs))
    counts: dict[str, int] = {}
    for doc in docs:
        counts[doc["family"]] = counts.get(doc["family"], 0) + len(doc["entries"])
    by_family = ", ".join(f"{family} {n}" for family, n in sorted(counts.items())) or "none"
    scopes = {tuple(sorted(c.scope.to_dict().items())) for c in caches}
    print(f"exported {sum(counts.values())} entries ({by_family}) of {len(scopes)} GPU/software "
          f"scopes to {args.file}")
    _say_rejected(sum(len(c.rejections()) for c in caches))
    return EXIT_OK


def _read(path: str) -> tuple[list, list[Rejection]]:
    return parse_documents(read_document_file(Path(path)), tuned_families.SCHEMAS, path)


def cmd_import(args) -> int:
    from cutlass_ops.gemms import dispatch

    report = ImportReport()
    for path in args.files:
        documents, rejections = _read(path)
        imported = import_documents(documents)
        report = report.add(ImportReport(imported.valid, imported.changed, rejections))
    dispatch.reset()
    emit(args, {"changed": report.changed, "valid": report.valid,
                "rejected": [str(r) for r in report.rejections]},
         text=f"imported: {report.changed} entries added or improved ({report.valid} valid, "
              f"{len(report.rejections)} rejected)")
    return EXIT_FAILED if report.rejections else EXIT_OK


def cmd_merge(args) -> int:
    from custom_kernels.core.cache_dir import atomic_write_json

    documents, rejections = [], []
    for path in args.files:
        found, rejected = _read(path)
        documents += found
        rejections += rejected
    merged = merge_documents(documents)
    atomic_write_json(Path(args.output), bundle([doc.to_dict() for doc in merged]))
    entries = sum(len(doc.entries) for doc in merged)
    emit(args, {"scopes": len(merged), "entries": entries,
                "rejected": [str(r) for r in rejections]},
         text=f"merged {len(args.files)} files into {args.output}: {len(merged)} scopes, "
              f"{entries} entries, {len(rejections)} rejected")
    return EXIT_FAILED if rejections else EXIT_OK


def cmd_clear(args) -> int:
    """Deletes the cache files of the selected families and GPUs when ``--yes`` is given;
    otherwise says what would go."""
    caches = tuned_families.caches(args.family, args.gpu)
    what = "tuning cache" if args.family == tuned_families.ALL else f"{args.family} tuning"
    if not args.yes:
        print(f"would delete {len(caches)} {what} files; run again with --yes", file=sys.stderr)
        return EXIT_FAILED
    for cache in caches:
        cache.clear()
    from cutlass_ops.gemms import dispatch

    dispatch.reset()
    print(f"deleted {len(caches)} {what} files")
    return EXIT_OK


def cmd_norms_list(args) -> int:
    args.family = "norms"
    return cmd_list(args)


def cmd_norms_clear(args) -> int:
    args.family = "norms"
    return cmd_clear(args)


def add_family_argument(parser) -> None:
    parser.add_argument("--family", default=tuned_families.ALL,
                        choices=list(tuned_families.CHOICES),
                        help="which kernel family's entries: gemm, grouped (MoE), norms, or "
                        "all (default)")


__all__ = ["add_family_argument", "cmd_clear", "cmd_export", "cmd_import", "cmd_list",
           "cmd_merge", "cmd_norms_clear", "cmd_norms_list", "cmd_show"]
