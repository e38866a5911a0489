"""FP8 grouped GEMMs (issue 53): ``cutlass_ops.scaled_grouped_mm`` on the expert GEMMs of
Mixtral-8x7B, Qwen3-30B-A3B and DeepSeek-V3 (``benchmarks/moe.py``'s shapes and routings: up and
down, uniform and Zipf-skewed, 4096 and 16384 tokens).

Two kinds of rows, each on the same operands for ours and its reference, timed interleaved as
CUDA-graph replays after an L2 flush (``tuning.timing``):

- ``scaled_grouped_mm rowwise <model> <up|down> <N>x<K> <tokens> tokens <routing>``: torch's
  rowwise scales ([M] and [E, N]) against ``torch._scaled_grouped_mm`` on the same e4m3 operands
  (the strongest peer: the kernel torchao's ``moe_training`` FP8 rowwise recipe calls).
- ``scaled_grouped_mm blockwise <model> ...``: 1x128 / 128x128 scales against our bf16
  ``cutlass_ops.grouped_mm`` on the bf16 operands they were quantized from (torch has no
  blockwise grouped GEMM: FP8 is the user's alternative to bf16). ``detail`` adds
  ``torch._grouped_mm`` on the bf16 operands, and torchao's blockwise grouped GEMM
  (``moe_training.blockwise_fp8``, which quantizes inside the call; its backend named) where it
  runs, its failure where not.

Operands are quantized as a training step would: per-row (rowwise) or per-128-block (blockwise)
amax over 448. Each row is checked against ``scaled_grouped_mm_op.reference`` (the float32 product
of the dequantized operands, every expert), relative error under ``BOUND``; ``detail`` has the
error, the quantization error against the bf16 product, and where the blockwise call ran
(``path``: the CUTLASS kernel, or the documented dequantized fallback).

    python benchmarks/moe_fp8.py [--quick] [--reps 30] [--recipes rowwise blockwise]
                                 [--tune quick|default|exhaustive]

With ``--tune``, the rows' problems of each recipe measured are tuned first (``cutlass-tune
tune --grouped E:N:K --tokens ROWS --fp8 RECIPE``; problems already in the tuning cache are
kept) and each row's ``detail`` names the kernel that ran: for rowwise, our CUTLASS kernel where
the tune stored one as faster than ``torch._scaled_grouped_mm``, torch's otherwise.

Writes ``benchmarks/results/moe_fp8.json`` (``moe_fp8_quick.json`` with ``--quick``: Qwen3 only,
4096 tokens).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from benchmarks.common import (labelled_rows, print_table, require_gpu,  # noqa: E402
                               write_result)
from benchmarks.moe import MODELS, ROUTINGS, TOKENS, expert_operands, rate_fields  # noqa: E402
from custom_kernels.core.tolerances import relative_error  # noqa: E402

FP8 = torch.float8_e4m3fn
E4M3_MAX = 448.0
BLOCK = 128
BOUND = 1e-2  # ours against the float32 product of the same dequantized operands


def _scaled(t: torch.Tensor, amax: torch.Tensor, expand) -> tuple[torch.Tensor, torch.Tensor]:
    scale = amax.float().clamp_min(1e-12) / E4M3_MAX
    return (t.float() / expand(scale)).to(FP8), scale


def quantize_rowwise(x: torch.Tensor, w: torch.Tensor):
    """x [M, K] one scale a row; w [E, N, K] one scale an output column of each expert:
    (a [M, K], b [E, K, N] K-contiguous, scale_a [M], scale_b [E, N])."""
    a, sa = _scaled(x, x.abs().amax(1), lambda s: s[:, None])
    bq, sb = _scaled(w, w.abs().amax(2), lambda s: s[..., None])
    return a, bq.transpose(1, 2), sa, sb


def quantize_blockwise(x: torch.Tensor, w: torch.Tensor):
    """x [M, K] one scale a row and 128 columns; w [E, N, K] one a 128x128 block:
    (a, b [E, K, N], scale_a [M, K/128], scale_b [E, K/128, N/128])."""
    m, k = x.shape
    e, n, _ = w.shape
    a, sa = _scaled(x, x.view(m, k // BLOCK, BLOCK).abs().amax(2),
                    lambda s: s.repeat_interleave(BLOCK, 1))
    blocks = w.view(e, n // BLOCK, BLOCK, k // BLOCK, BLOCK).abs().amax((2, 4))  # [E, N/128, K/128]
    bq, sb = _scaled(w, blocks, lambda s: s.repeat_interleave(BLOCK, 1).repeat_interleave(BLOCK, 2))
    return a, bq.transpose(1, 2), sa, sb.transpose(1, 2)


def kernel_name(a, b, recipe: str) -> str:
    """The kernel ``scaled_grouped_mm`` runs for these operands: a tuned one, else blockwise's
    default or rowwise's torch._scaled_grouped_mm."""
    from cutlass_ops.gemms.grouped import grouped_build, grouped_fp8_entries

    problem = grouped_build.GroupedFp8Problem.of(a, b.transpose(1, 2), recipe)
    tuned = grouped_fp8_entries.tuned_config(problem)
    if tuned is not None:
        return f"{tuned.name} (tuned)"
    return (f"{grouped_build.GroupedFp8Config().name} (default, untuned)" if recipe ==
            "blockwise" else "torch._scaled_grouped_mm (nothing tuned beat it)")


def _torchao_blockwise(x, wt, offs):
    """torchao's blockwise FP8 grouped GEMM on the bf16 operands (it quantizes inside the call),
    or the reason it does not run here."""
    try:
        from torchao.prototype.moe_training.blockwise_fp8 import grouped_mm as tao

        call = lambda: tao._to_fp8_blockwise_then_scaled_grouped_mm(x, wt, offs)  # noqa: E731
        call()
        return call, None
    except Exception as exc:  # noqa: BLE001 -- any failure is a documented "does not run"
        return None, f"{type(exc).__name__}: {str(exc)[:200]}"


def fp8_row(recipe, model, direction, tokens, routing, reps) -> dict:
    import cutlass_ops
    from cutlass_ops.fp8 import scaled_grouped_mm_op as sgm
    from tuning.timing import do_bench, do_bench_interleaved

    counts, offs, x, wt = expert_operands(model, direction, tokens, routing)
    w = wt.transpose(1, 2).contiguous()  # [E, N, K], as Hugging Face stores it
    quantize = quantize_rowwise if recipe == "rowwise" else quantize_blockwise
    a, b, sa, sb = quantize(x, w)
    ours_fn = lambda: cutlass_ops.scaled_grouped_mm(a, b, sa, sb, offs)  # noqa: E731
    ours = ours_fn()
    expected = sgm.reference(a, b, sa, sb, offs)
    error = relative_error(ours, expected)
    bf16_product = cutlass_ops.grouped_mm(x, wt, offs)
    fns = {"ours": ours_fn}
    if recipe == "rowwise":
        fns["reference"] = lambda: torch._scaled_grouped_mm(a, b, sa, sb, offs=offs,
                                                            out_dtype=torch.bfloat16)
        reference_name = "torch._scaled_grouped_mm"
        detail_kernel = kernel_name(a, b, "rowwise")
    else:
        fns["reference"] = lambda: cutlass_ops.grouped_mm(x, wt, offs)
        fns["torch_grouped_mm_bf16"] = lambda: torch._grouped_mm(x, wt, offs)
        reference_name = "cutlass_ops.grouped_mm bf16"
        detail_kernel = kernel_name(a, b, "blockwise")
    timings = do_bench_interleaved(fns, reps=reps, graph=True)
    ms = {key: t.median_ms for key, t in timings.items()}
    detail: dict = {"kernel": detail_kernel}
    if recipe == "blockwise":
        detail["path"] = ("CUTLASS FP8 blockwise grouped kernel" if sgm.BLOCKWISE_KERNEL else
                          "dequantized through grouped_mm (BLOCKWISE_KERNEL off)")
        tao, why = _torchao_blockwise(x, wt, offs)
        if tao is None:
            detail["torchao_blockwise"] = f"does not run: {why}"
        else:  # eager, not a graph replay: its call reads the offsets on the host
            # (emulated where DeepGEMM is missing: tens of ms a call, so few repetitions)
            ms["torchao_blockwise"] = do_bench(tao, warmup=1, reps=5).median_ms
            detail["torchao_blockwise_note"] = ("eager, median of 5 (BENCHMARKS.md's 20 are "
                                                "left to the main figures); bf16 operands, "
                                                "quantized inside the call; DeepGEMM backend "
                                                "where installed, else emulated")
    return fp8_result(recipe, f"{model} {direction}", tokens, routing, counts, tuple(wt.shape[1:]),
                      ms, reference_name, error, relative_error(ours, bf16_product), detail)


def fp8_result(recipe, name, tokens, routing, counts, kn, ms: dict, reference_name, error,
               quantization_error, detail: dict) -> dict:
    """A row from its timings (``ms``: ours, reference and extra peers by key) and its check."""
    k, n = kn
    flops = 2 * sum(counts) * n * k
    extra = {f"{key}_ms": value for key, value in ms.items() if key not in ("ours", "reference")}
    return {
        "case": f"scaled_grouped_mm {recipe} {name} {n}x{k} {tokens} tokens {routing}",
        **rate_fields("TFLOP/s", flops / ms["ours"] / 1e9, flops / ms["reference"] / 1e9,
                      reference_name),
        "correct": error < BOUND,
        "detail": {"ours_ms": ms["ours"], "reference_ms": ms["reference"], **extra,
                   "flops": flops, "relative_error": error, "error_bound": BOUND,
                   "quantization_error_vs_bf16": quantization_error,
                   "largest_expert_rows": max(counts), "empty_experts": counts.count(0),
                   **detail},
    }


def fp8_problems(models, tokens, recipes=("blockwise",)) -> list:
    from tuning.grouped_fp8_search import moe_problems

    problems = []
    for recipe in recipes:
        for model in models:
            experts, hidden, inter, top_k = MODELS[model]
            for n, k in ((inter, hidden), (hidden, inter)):
                for count in tokens:
                    problems += moe_problems(experts, n, k, count * top_k, recipe)
    return list(dict.fromkeys(problems))


def tune_recipes(models, tokens, recipes, strategy: str) -> dict:
    import time

    from tuning import grouped_fp8_search

    start = time.perf_counter()
    results = grouped_fp8_search.tune(fp8_problems(models, tokens, recipes), strategy=strategy)
    return {"tune_strategy": strategy, "tune_seconds": round(time.perf_counter() - start, 1),
            "tuned": {r.problem.name: r.entry.get("winner") for r in results}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="Qwen3-30B-A3B, 4096 tokens")
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--recipes", nargs="+", choices=("rowwise", "blockwise"),
                        default=["rowwise", "blockwise"])
    parser.add_argument("--tune", choices=("quick", "default", "exhaustive"),
                        help="first tune the rows' problems with this strategy")
    args = parser.parse_args()
    require_gpu()
    models = ["Qwen3-30B-A3B"] if args.quick else list(MODELS)
    tokens = TOKENS[:1] if args.quick else TOKENS
    name = "moe_fp8_quick" if args.quick else "moe_fp8"
    # A recipe left out of this run keeps its rows from the file, each labelled with its run.
    kept = [r for r in labelled_rows(name, {})
            if r["case"].split()[1] in {"rowwise", "blockwise"} - set(args.recipes)]
    rows, summary = [], {"recipes_measured_here": args.recipes}
    if args.tune:
        summary.update(tune_recipes(models, tokens, args.recipes, args.tune))
        print(summary, flush=True)
    for recipe in args.recipes:
        for model in models:
            for direction in ("up", "down"):
                for count in tokens:
                    for routing in ROUTINGS:
                        rows.append(fp8_row(recipe, model, direction, count, routing, args.reps))
                        print(rows[-1]["case"], rows[-1]["ratio"], rows[-1]["correct"],
                              flush=True)
                        # a cut-short run keeps its rows
                        write_result(name, rows + kept, **summary)
    rows += kept
    for recipe in ("rowwise", "blockwise"):
        ratios = [r["ratio"] for r in rows if f" {recipe} " in r["case"]]
        if ratios:
            summary[f"{recipe}_geomean"] = round(statistics.geometric_mean(ratios), 4)
            summary[f"{recipe}_min"] = min(ratios)
    write_result(name, rows, **summary)
    print_table(["case", "ours", "reference", "ratio", "correct"],
                [[r["case"], r["ours"], r["reference"], r["ratio"], r["correct"]] for r in rows])
    print(summary)


if __name__ == "__main__":
    main()
