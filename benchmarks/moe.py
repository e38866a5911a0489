"""Mixture-of-experts: grouped GEMMs (``cutlass_ops.grouped_mm``) against ``torch._grouped_mm``,
and a converted Hugging Face MoE block against Hugging Face's own ``grouped_mm`` experts.

Grouped rows: the expert GEMMs of Mixtral-8x7B (8 experts, 4096 -> 14336 -> 4096, top-2),
Qwen3-30B-A3B (128 experts, 2048 -> 768 -> 2048, top-8) and DeepSeek-V3 (256 experts,
7168 -> 2048 -> 7168, top-8), up (tokens x H -> I) and down (I -> H), at 4096 and 16384 tokens,
routed uniformly or skewed (expert e takes a share proportional to 1 / (e + 1), Zipf with
exponent 1, experts in a fixed random order): 24 rows, ``case`` ``grouped <model> <up|down>
<N>x<K> <tokens> tokens <routing>``, bf16, y = x W^T per expert (W as Hugging Face stores it).
Times are CUDA-graph replays after an L2 flush, ours and torch's interleaved; ``detail`` has a
per-expert loop of torch.matmul and one dense torch.matmul of the same FLOPs. Each row is
checked against the float32 per-expert reference (``detail``: ``max_relative_error`` on up to
8 experts, and ``error_bound``, ``GROUPED_BOUND``). Each grouped row also gets a ceiling
(``benchmarks/roofline.py``): its least bytes over the run's highest measured bandwidth, or its
FLOPs over the run's highest measured compute rate, whichever is longer; ``ceiling_geomean`` is
what a kernel at the ceiling on every row would score against ``torch._grouped_mm``.

Block rows: Hugging Face's Mixtral and Qwen3-MoE sparse blocks (their real sizes, 4096 tokens,
random bf16 weights), forward + backward, converted (``cutlass_ops.convert``'s experts: grouped
GEMMs) against Hugging Face's own ``grouped_mm`` experts (``experts_implementation=
"grouped_mm"``, transformers' default: the strongest experts a Hugging Face user gets without
extra kernels), ``case`` ``block <model> forward+backward <tokens> tokens ours vs hf grouped_mm``.
The per-expert Python loop (``experts_implementation="eager"``) is a weaker reference: its
tokens/s and time are in ``detail`` only. The three are timed interleaved. The check: ours'
output and input gradient within ``BLOCK_BOUND`` (relative) of the per-expert loop's, the
exact-routing reference; ``detail`` has the bound, ours' error and Hugging Face's grouped_mm
experts' own error against the same reference. Were HF's grouped_mm experts to fail to run, the
row's reference would be the loop and its case would say so (``... ours vs hf eager
experts``), the failure in ``detail``. Writes ``benchmarks/results/moe.json``
(``moe_quick.json`` with ``--quick``: Qwen3 only, 4096 tokens).

    python benchmarks/moe.py [--quick] [--reps 30] [--tune default]

With ``--tune``, the rows' grouped problems are tuned first (C++ and, with ``cutlass-ops[dsl]``,
DSL candidates: ``cutlass-tune tune --grouped``); ``detail`` names the path that won and the
other path's best. ``--no-dynamic-twins`` tunes without the DSL kernels' dynamic-scheduler twins
and writes ``moe_dynamic_twins_off.json``: the tune as it was before them, for comparison. Give
each of the two runs an empty cache, since problems already tuned are kept:

    CUTLASS_OPS_CACHE_DIR=$(mktemp -d) python benchmarks/moe.py --tune default
    CUTLASS_OPS_CACHE_DIR=$(mktemp -d) python benchmarks/moe.py --tune default --no-dynamic-twins
"""

from __future__ import annotations

import argparse
import collections
import copy
import math
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from benchmarks import roofline  # noqa: E402
from benchmarks.common import (copy_bandwidth_gbs, print_table, read_bandwidth_gbs,  # noqa: E402
                               require_gpu, write_result)
from custom_kernels.core.tolerances import relative_error  # noqa: E402

MODELS = {  # experts, hidden, intermediate, top-k
    "Mixtral-8x7B": (8, 4096, 14336, 2),
    "Qwen3-30B-A3B": (128, 2048, 768, 8),
    "DeepSeek-V3": (256, 7168, 2048, 8),
}
TOKENS = (4096, 16384)
ROUTINGS = ("uniform", "zipf")
GROUPED_BOUND = 2e-2  # a grouped row's relative error against float32, on its checked experts
BLOCK_BOUND = 2e-2  # a block's output and input gradient against the per-expert loop's
HF_GROUPED, HF_EAGER = "hf grouped_mm", "hf eager experts"  # the block rows' HF experts


def rate_fields(unit: str, ours: float, reference: float, reference_name: str) -> dict:
    """A row's figures (higher is better) rounded to 0.1, and ``ratio`` = the rounded ours over
    the rounded reference (BENCHMARKS.md: the ratio is that division)."""
    ours, reference = round(ours, 1), round(reference, 1)
    return {"unit": unit, "ours": ours, "reference": reference, "reference_name": reference_name,
            "ratio": round(ours / reference, 4)}


def expert_counts(rows: int, experts: int, routing: str, seed: int = 0) -> list[int]:
    """Rows per expert, summing to ``rows``: equal shares, or Zipf shares (1 / rank) with the
    ranks in a fixed random order."""
    if routing == "uniform":
        shares = [1.0] * experts
    else:
        ranks = torch.randperm(experts, generator=torch.Generator().manual_seed(seed)).tolist()
        shares = [1.0 / (rank + 1) for rank in ranks]
    total = sum(shares)
    counts = [int(rows * s / total) for s in shares]
    for i in range(rows - sum(counts)):  # the remainder, one row each
        counts[i % experts] += 1
    return counts


def expert_operands(model, direction, tokens, routing):
    """One case's forward expert GEMM on the GPU: (rows per expert, offsets, x [rows, K],
    the experts' weights as [E, K, N] views of Hugging Face's [E, N, K])."""
    experts, hidden, inter, top_k = MODELS[model]
    k, n = (hidden, inter) if direction == "up" else (inter, hidden)
    rows = tokens * top_k
    counts = expert_counts(rows, experts, routing)
    offs = torch.tensor(counts, device="cuda").cumsum(0).to(torch.int32)
    x = (torch.randn(rows, k, device="cuda") / math.sqrt(k)).bfloat16()
    wt = torch.randn(experts, n, k, device="cuda").bfloat16().transpose(1, 2)
    return counts, offs, x, wt


def grouped_row(model, direction, tokens, routing, reps) -> dict:
    import cutlass_ops
    from tuning.timing import do_bench, do_bench_interleaved

    counts, offs, x, wt = expert_operands(model, direction, tokens, routing)
    experts, rows, (k, n) = len(counts), x.shape[0], wt.shape[1:]
    ours = cutlass_ops.grouped_mm(x, wt, offs)
    starts = [0] + torch.tensor(counts).cumsum(0).tolist()[:-1]
    # Checked on up to 8 experts (the largest and a spread), against float32.
    picked = sorted(range(experts), key=lambda e: -counts[e])[:4] + list(range(0, experts,
                                                                             max(1, experts // 4)))
    errors = []
    for e in dict.fromkeys(picked):
        s, c = starts[e], counts[e]
        if c:
            errors.append(relative_error(ours[s:s + c], x[s:s + c].float() @ wt[e].float()))
    entry = tuned_entry(x, wt, offs)
    timings = do_bench_interleaved({"ours": lambda: cutlass_ops.grouped_mm(x, wt, offs),
                                    "torch": lambda: torch._grouped_mm(x, wt, offs)},
                                   reps=reps, graph=True)
    ours_ms, torch_ms = timings["ours"].median_ms, timings["torch"].median_ms
    bounds = [(s, c) for s, c in zip(starts, counts) if c]

    def loop():
        for e, (s, c) in enumerate(bounds):
            torch.matmul(x[s:s + c], wt[e])

    loop_ms = do_bench(loop, reps=max(5, reps // 3)).median_ms
    dense_ms = do_bench(lambda: torch.matmul(x, wt[0]), reps=reps, graph=True).median_ms
    flops = 2 * rows * n * k
    return {
        "case": f"grouped {model} {direction} {n}x{k} {tokens} tokens {routing}",
        **rate_fields("TFLOP/s", flops / ours_ms / 1e9, flops / torch_ms / 1e9,
                      "torch._grouped_mm"),
        "correct": max(errors, default=0.0) < GROUPED_BOUND,
        "detail": {"ours_ms": ours_ms, "reference_ms": torch_ms,
                   "per_expert_loop_ms": loop_ms, "dense_same_flops_ms": dense_ms,
                   "flops": flops, "min_bytes": roofline.grouped_gemm_bytes(counts, n, k),
                   "max_relative_error": max(errors, default=0.0),
                   "error_bound": GROUPED_BOUND,
                   "largest_expert_rows": max(counts), "empty_experts": counts.count(0),
                   "path": (entry.field("backend") or "cutlass") if entry and
                   entry.uses_kernel else "torch._grouped_mm (nothing tuned beat it)",
                   "winner": entry.winner_name if entry else None,
                   "other_path_best": entry.field("other_backend_best") if entry else None},
    }


def tuned_entry(x, wt, offs):
    """The tuning entry ``cutlass_ops.grouped_mm`` dispatches on for this call (a
    ``grouped_entries.GroupedEntry``), or None."""
    from cutlass_ops.gemms.grouped import grouped_build, grouped_entries
    from cutlass_ops.gemms.grouped.grouped_runtime import layout

    problem = grouped_build.GroupedProblem.of("2d3d", x, wt, offs, "bf16", layout(x), layout(wt))
    return grouped_entries.grouped_cache().get(problem)


def problems(models, tokens) -> list:
    """The grouped problems the rows run: each expert GEMM's forward, and for the blocks
    (Mixtral, Qwen3 at the first token count) the gate+up and down GEMMs' forward, dX and dW."""
    from tuning.grouped_search import moe_problems

    out = []
    for model in models:
        experts, hidden, inter, top_k = MODELS[model]
        for count in tokens:
            out += moe_problems(experts, inter, hidden, count * top_k)
            out += moe_problems(experts, hidden, inter, count * top_k)
    out += block_problems(models[:2], tokens[0])
    return list(dict.fromkeys(out))


def block_problems(models, tokens: int) -> list:
    """The blocks' grouped problems: the gate+up and down GEMMs' forward, dX and dW."""
    from tuning.grouped_search import moe_problems

    out = []
    for model in models:
        experts, hidden, inter, top_k = MODELS[model]
        out += moe_problems(experts, 2 * inter, hidden, tokens * top_k, backward=True)
        out += moe_problems(experts, hidden, inter, tokens * top_k, backward=True)
    return out


def hf_block(model: str, device="cuda"):
    """Hugging Face's sparse MoE block of ``model`` in bf16, its experts the per-expert loop
    (``experts_implementation="eager"``), and its config."""
    import transformers

    experts, hidden, inter, top_k = MODELS[model]
    if model.startswith("Mixtral"):
        config = transformers.MixtralConfig(hidden_size=hidden, intermediate_size=inter,
                                            num_local_experts=experts,
                                            num_experts_per_tok=top_k, num_hidden_layers=1)
        cls = transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock
    else:
        config = transformers.Qwen3MoeConfig(hidden_size=hidden, moe_intermediate_size=inter,
                                             num_experts=experts, num_experts_per_tok=top_k,
                                             norm_topk_prob=True, num_hidden_layers=1)
        cls = transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock
    return eager_block(cls, config, device), config


def eager_block(cls, config, device="cuda"):
    """A block of ``cls`` with the per-expert loop, random bf16 weights (seeded)."""
    config._experts_implementation = "eager"
    torch.manual_seed(0)
    with torch.device(device):
        block = cls(config)
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.02)
    return block.bfloat16()


def hf_grouped_copy(block, config):
    """A copy of ``block`` (same weights) whose experts run Hugging Face's ``grouped_mm``
    implementation: the experts read ``config._experts_implementation`` at each call."""
    grouped = copy.deepcopy(block)
    grouped.experts.config = copy.copy(config)
    grouped.experts.config._experts_implementation = "grouped_mm"
    return grouped


def block_step(block, x, grad):
    """One forward + backward of ``block`` on ``x``: returns (output, input gradient)."""
    def run():
        block.zero_grad(set_to_none=True)
        inp = x.detach().requires_grad_()
        out = block(inp)
        out.backward(grad)
        return out, inp.grad
    return run


def block_row(model, tokens, reps) -> dict:
    import cutlass_ops
    from tuning.timing import do_bench_interleaved

    eager, config = hf_block(model)
    ours = copy.deepcopy(eager)
    report = cutlass_ops.convert(ours)
    converted = [d.name for d in report.decisions if d.converted]
    x = torch.randn(1, tokens, MODELS[model][1], device="cuda").bfloat16()
    grad = torch.randn_like(x)
    steps = {"ours": block_step(ours, x, grad), HF_EAGER: block_step(eager, x, grad)}
    y_eager, dx_eager = steps[HF_EAGER]()
    y_ours, dx_ours = steps["ours"]()
    errors = {"ours": max(relative_error(y_ours, y_eager), relative_error(dx_ours, dx_eager))}
    hf_failure = None
    try:
        grouped_step = block_step(hf_grouped_copy(eager, config), x, grad)
        y_grouped, dx_grouped = grouped_step()
    except Exception as exc:  # noqa: BLE001 - reported in the row, which falls back to the loop
        hf_failure = f"{type(exc).__name__}: {exc}"[:300]
    else:
        errors[HF_GROUPED] = max(relative_error(y_grouped, y_eager),
                                 relative_error(dx_grouped, dx_eager))
        steps[HF_GROUPED] = grouped_step
    timings = do_bench_interleaved(steps, warmup=2, reps=reps, flush_l2=False)
    return block_result(model, tokens, {k: t.median_ms for k, t in timings.items()}, errors,
                        converted, hf_failure)


def block_result(model, tokens, ms: dict, errors: dict, converted: list,
                 hf_failure: str | None = None) -> dict:
    """The block row from its medians (ms by "ours", ``HF_GROUPED``, ``HF_EAGER``) and errors
    against the per-expert loop: against HF's grouped_mm experts when they ran, the loop's
    figure in ``detail``; against the loop, the case saying so, when they did not."""
    reference = HF_GROUPED if HF_GROUPED in ms else HF_EAGER
    rates = {name: tokens / t * 1e3 for name, t in ms.items()}  # tokens/s
    detail = {"ours_ms": ms["ours"], "reference_ms": ms[reference],
              "relative_error": errors["ours"], "error_bound": BLOCK_BOUND,
              "error_against": "the per-expert loop (hf eager experts), output and input "
                               "gradient, the larger",
              "converted": converted}
    if reference == HF_GROUPED:
        detail.update({HF_EAGER: round(rates[HF_EAGER], 1), "hf_eager_experts_ms": ms[HF_EAGER],
                       "hf_grouped_mm_relative_error": errors[HF_GROUPED]})
    else:
        detail["hf_grouped_mm_failed"] = hf_failure
    return {"case": f"block {model} forward+backward {tokens} tokens ours vs {reference}",
            **rate_fields("tokens/s", rates["ours"], rates[reference], reference),
            "correct": errors["ours"] < BLOCK_BOUND and bool(converted), "detail": detail}


def kept_grouped(name: str) -> tuple[list, dict]:
    """The result file's grouped rows, each with the run it came from in ``detail["run"]``
    (GPU, versions), and its summary figures of them: what a ``--blocks-only`` run keeps."""
    import json

    from benchmarks.common import RESULTS

    try:
        old = json.loads((RESULTS / f"{name}.json").read_text())
    except (OSError, ValueError):
        return [], {}
    run = {"gpu": old.get("gpu"), "versions": old.get("versions")}
    rows = [{**r, "detail": {"run": run, **r.get("detail", {})}}
            for r in old.get("rows", []) if r["case"].startswith("grouped ")]
    summary = {k: v for k, v in old.items() if k not in ("benchmark", "gpu", "versions", "rows")}
    return rows, summary


def blocks_only(args) -> int:
    """The block rows alone, their grouped problems tuned first with ``--tune``; the file's
    grouped rows and summary kept (``kept_grouped``)."""
    require_gpu()
    models = ["Qwen3-30B-A3B"] if args.quick else list(MODELS)[:2]
    name = "moe_quick" if args.quick else "moe"
    grouped, summary = kept_grouped(name)
    if args.tune:
        from tuning import grouped_search

        grouped_search.tune(list(dict.fromkeys(block_problems(models, TOKENS[0]))),
                            strategy=args.tune)
        summary["blocks_tune_strategy"] = args.tune
    rows = []
    for model in models:
        rows.append(block_row(model, 4096, max(5, args.reps // 3)))
        print(rows[-1]["case"], rows[-1]["ratio"], rows[-1]["correct"], flush=True)
        write_result(name, grouped + rows, **summary)
    return 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="Qwen3-30B-A3B, 4096 tokens")
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--tune", choices=("quick", "default", "exhaustive"),
                        help="first tune the rows' grouped problems with this strategy (those "
                        "already in the tuning cache are kept); the time goes in the JSON")
    parser.add_argument("--no-dynamic-twins", action="store_true",
                        help="tune without the DSL kernels' dynamic-scheduler twins and write "
                        "moe_dynamic_twins_off.json (give it an empty CUTLASS_OPS_CACHE_DIR)")
    parser.add_argument("--blocks-only", action="store_true",
                        help="only the block rows (their problems tuned with --tune); the "
                        "file's grouped rows and figures stay, each row labelled with its run")
    args = parser.parse_args()
    if args.blocks_only:
        raise SystemExit(blocks_only(args))
    if args.no_dynamic_twins and not args.tune:
        parser.error("--no-dynamic-twins changes the tune: give --tune too")
    require_gpu()
    models = ["Qwen3-30B-A3B"] if args.quick else list(MODELS)
    tokens = TOKENS[:1] if args.quick else TOKENS
    tune = {}
    if args.tune:
        import time

        from tuning import grouped_search

        start = time.perf_counter()
        results = grouped_search.tune(problems(models, tokens), strategy=args.tune,
                                      dynamic_twins=not args.no_dynamic_twins)
        tune = {"tune_strategy": args.tune, "tune_seconds": round(time.perf_counter() - start, 1),
                "tuned_problems": len(results), "cached": sum(r.cached for r in results),
                # cutlass, dsl, or cutlass+dsl (a skew dispatch of one kernel of each)
                "winners_by_path": dict(collections.Counter(
                    r.entry.get("backend") for r in results
                    if r.entry.get("prefer") == "cutlass"))}
        print(tune, flush=True)
    probes = {"copy_bandwidth_gbs": round(copy_bandwidth_gbs(), 1),
              "read_bandwidth_gbs": round(read_bandwidth_gbs(), 1)}
    print(probes, flush=True)
    rows = []
    name = ("moe_quick" if args.quick else "moe") + \
        ("_dynamic_twins_off" if args.no_dynamic_twins else "")
    for model in models:
        for direction in ("up", "down"):
            for count in tokens:
                for routing in ROUTINGS:
                    rows.append(grouped_row(model, direction, count, routing, args.reps))
                    print(rows[-1]["case"], rows[-1]["ratio"], flush=True)
        write_result(name, rows, **probes, **tune)
    grouped_rows = [r for r in rows if "grouped" in r["case"]]
    rates = roofline.run_rates(grouped_rows, list(probes.values()))
    ceiling = roofline.annotate(grouped_rows, rates)
    for model in models[:2]:
        rows.append(block_row(model, 4096, max(5, args.reps // 3)))
        print(rows[-1]["case"], rows[-1]["ratio"], flush=True)
        write_result(name, rows, **probes, **ceiling, **tune)
    grouped = [r["ratio"] for r in grouped_rows]
    geomean = statistics.geometric_mean(grouped)
    print_table(["case", "ours", "reference", "ratio", "of ceiling", "correct"],
                [[r["case"], r["ours"], r["reference"], r["ratio"],
                  r["detail"].get("ours_of_ceiling", ""), r["correct"]] for r in rows])
    print(f"grouped geomean {geomean:.4f}, min {min(grouped):.4f}; a kernel at the ceiling on "
          f"every row: {ceiling['ceiling_geomean']:.4f}; ours at "
          f"{ceiling['ours_of_ceiling_geomean']:.4f} of the ceiling ({rates})")
    write_result(name, rows, grouped_geomean=round(geomean, 4), grouped_min=min(grouped),
                 **probes, **ceiling, **tune)


if __name__ == "__main__":
    main()
