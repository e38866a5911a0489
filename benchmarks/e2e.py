"""A Hugging Face decoder model end to end: eager, torch.compile, converted by
``cutlass_ops.convert`` ("ours"), and converted then compiled ("ours+compile").

The model is Llama-3-8B-shaped (hidden 4096, MLP 14336, 32 / 8 heads, vocabulary 128256) with
``--layers`` layers (8) and random bf16 weights, built from a config (no download). Rows
(BENCHMARKS.md schema; ``ratio`` = our tokens/s over the reference's):
- ``train``: forward and backward of the causal-LM loss on ``--tokens`` tokens (2 sequences);
- ``prefill``: the inference forward on the same tokens, under no_grad;
- ``decode batch 1`` / ``decode batch 16``: ``generate()`` of ``--new-tokens`` greedy tokens after a
  128-token prompt, with its KV cache (eager and ours; compiled decoding is not timed here); each
  repetition is a whole generate() of many steps, so half of ``--reps`` of them, eager's and
  ours interleaved (the host's speed drifts);
- ``train ours vs ours without fused loss``: the converted model against itself converted with
  ``fused_loss=False`` (the head and loss as Hugging Face computes them);
- ``peak memory train ours vs eager`` (and vs compile, vs ours without fused loss): unit 1/GB, so
  that ``ratio`` = the reference's GB over ours; each variant's peak without the other variants'
  weights (they share the GPU).
Times are CUDA-event medians after warm-up, the variants interleaved repetition by repetition
(the host's speed drifts over a run). Checks (``benchmarks/model_checks.py``, bounds from
``custom_kernels.core.tolerances``), each against eager on the same inputs: a ``train`` row is
correct when its variant's loss is within 1% of eager's and every parameter's gradient within
the ``model gradients`` bound (``detail`` names the worst parameter); a ``prefill`` row when its
logits are within 2e-2 of eager's (or no further than its reference's); a ``decode`` row when
teacher-forced decoding (eager's generated tokens fed to both models one at a time through
their KV caches) keeps every step's logits within the ``model logits`` bound (``detail`` has
the steps' top-1 agreement, and ``generated_tokens_equal``: the share of generated tokens, the
prompt excluded, on which the two ``generate()`` outputs agree); a ``peak memory`` row when the
train step it measured passed its check. The GEMMs run what dispatch has: ``--tune quick``
first tunes every GEMM the converted model runs (its Linears forward and backward, the decode
batches, the chunked loss head). "ours" is ``convert``'s model: fused norms, our Linear, and the
loss through the chunked head when labels are passed. Results are
written after each section, so an interrupted run keeps what it measured.
Writes benchmarks/results/e2e.json (e2e_quick.json with --quick: 2 layers, 1024 tokens); a full
run copies the rows of an e2e_quick.json written by the same code into its ``detail``
(``two_layers``), so run ``--quick`` first.

    python benchmarks/e2e.py [--quick] [--tune quick] [--layers 8] [--tokens 4096]
        [--sections train prefill decode]

A whole run with the compiled variants takes more than seven minutes (torch.compile's warm-ups
of two 8-layer models, for training and for inference); ``--sections`` splits it across runs of
the same code, each adding its rows to the file.
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from benchmarks import model_checks  # noqa: E402
from benchmarks.common import print_table, require_gpu, write_result  # noqa: E402
from custom_kernels.core.tolerances import relative_error  # noqa: E402
from tuning.timing import do_bench_interleaved  # noqa: E402

PROMPT = 128
SEQUENCES = 2
SECTIONS = ("train", "prefill", "decode")


def llama(layers: int, device: str = "cuda"):
    import transformers

    config = transformers.LlamaConfig(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=layers,
        num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
        max_position_embeddings=8192)
    torch.manual_seed(0)
    with torch.device(device):
        return transformers.LlamaForCausalLM(config).to(torch.bfloat16)


def train_step(model, ids):
    def step():
        model.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss
    return step


def parameter_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def measure_train(variants, ids, reps):
    """Check, time and peak memory of each variant's train step. The first step of each
    variant is its check (``model_checks.check_train_step``) against eager's, which runs
    first: eager's gradients are kept (the tensors themselves, no copy) until every variant is
    checked. The times are interleaved repetition
    by repetition (tuning.timing's do_bench_interleaved), as decoding's: at small sizes a step
    is partly host-bound and the host's speed drifts, and sequential timing credits whoever ran
    on a quiet stretch or a cool GPU. The variants share the GPU, so a variant's peak (one step
    of its own, before the timing) is the allocator's peak less what the other variants'
    weights and gradients (and eager's kept gradients) hold: the figure the model alone would
    show (its weights, gradients, activations and temporaries)."""
    if next(iter(variants)) != "eager":
        raise ValueError("eager must be the first variant: the others are checked against it")
    out, steps, reference = {}, {}, None
    tolerance = model_checks.gradient_tolerance(variants["eager"])
    for name, model in variants.items():
        model.train()
        step = steps[name] = train_step(model, ids)
        loss = step().detach().float().item()
        grads = model_checks.gradients(model)
        if reference is None:
            reference = (loss, grads)
        model.zero_grad(set_to_none=True)  # the gradients now belong to grads alone
        check = model_checks.check_train_step(loss, grads, *reference, tolerance) \
            if name != "eager" else None
        del grads
        torch.cuda.synchronize()
        others = torch.cuda.memory_allocated() - parameter_bytes(model)
        torch.cuda.reset_peak_memory_stats()
        step()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - others
        model.zero_grad(set_to_none=True)
        out[name] = {"loss": loss, "peak_gb": peak / 1e9, "check": check}
    del reference
    times = do_bench_interleaved(steps, warmup=1, reps=reps, flush_l2=False)
    for name, model in variants.items():
        out[name]["ms"] = times[name].median_ms
        model.zero_grad(set_to_none=True)
    return out


def train_rows(train: dict, tokens: int) -> list:
    """The train rows of the measured pairs, then the peak memory rows of ours against each
    reference: each correct only when ours' (the row's first variant's) step passed its
    check."""
    rows = []
    for a, b in pairs(train):
        check = train[a]["check"]
        rows.append(rate_row(f"train {a} vs {b}", tokens, train[a], train[b], b, check.ok,
                             loss_ours=train[a]["loss"], loss_reference=train[b]["loss"],
                             **check.detail()))
    for reference in ("eager", "compile", "ours without fused loss"):
        if reference in train:
            rows.append(memory_row(train["ours"], train[reference], reference,
                                   train["ours"]["check"].ok))
    return rows


def measure_prefill(variants, ids, reps):
    """Each variant's prefill time (none with ``reps`` 0), interleaved as the train steps'
    (a small model's forward is host-bound), and its last logits."""
    out, calls = {}, {}
    with torch.no_grad():
        for name, model in variants.items():
            model.eval()
            logits = model(input_ids=ids).logits
            out[name] = {"ms": None, "logits": logits[:, -16:].float()}
            calls[name] = lambda model=model: model(input_ids=ids)
        if reps:
            times = do_bench_interleaved(calls, warmup=2, reps=reps, flush_l2=False)
            for name in variants:
                out[name]["ms"] = times[name].median_ms
    return out


def section_of(case: str) -> str:
    """The section that measured a row: "peak memory train ..." rows are the train section's."""
    first = case.split()[0]
    return "train" if first == "peak" else first


def kept_rows(name: str, meta: dict, sections: set) -> list:
    """The rows of sections not measured now, from the result file, when it was written by the
    same code (project version) for the same model; none otherwise. Each row keeps the reference
    measured beside it in its own run."""
    from benchmarks.common import rows_of_same_run

    if sections >= set(SECTIONS):
        return []
    return [r for r in rows_of_same_run(name, meta) if section_of(r["case"]) not in sections]


def two_layer_run() -> dict | None:
    """The 2-layer run (``--quick``, e2e_quick.json) of the same code, for the full run's
    ``detail``: its model, sizes and rows (ratios with both figures), or None when there is
    none for this code."""
    import json

    from benchmarks.common import RESULTS, versions

    try:
        quick = json.loads((RESULTS / "e2e_quick.json").read_text())
    except (OSError, ValueError):
        return None
    if quick.get("versions", {}).get("project") != versions()["project"]:
        return None
    return {"layers": quick.get("layers"), "tokens": quick.get("tokens"),
            "new_tokens": quick.get("new_tokens"),
            "rows": [{k: r[k] for k in ("case", "ours", "reference", "ratio", "correct")}
                     for r in quick.get("rows", [])]}


def measure_decode(variants, batch, new_tokens, reps):
    """generate() of each variant, interleaved repetition by repetition (tuning.timing's
    do_bench_interleaved): decoding is host-bound, and the host's speed drifts over a run by more
    than the differences measured, so sequential timing would credit whoever ran on a quiet
    stretch."""
    prompt = torch.randint(0, 128256, (batch, PROMPT), device="cuda",
                           generator=torch.Generator("cuda").manual_seed(batch))
    out = {}
    with torch.no_grad():
        generators = {}
        for name, model in variants.items():
            model.eval()

            def generate(model=model):
                return model.generate(prompt, attention_mask=torch.ones_like(prompt),
                                      max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                      do_sample=False, pad_token_id=0)
            generators[name] = generate
            out[name] = {"tokens": generate()}
        times = do_bench_interleaved(generators, warmup=1, reps=reps, flush_l2=False)
    for name in variants:
        out[name]["ms"] = times[name].median_ms
    return out


def train_problems(model, tokens: int) -> list:
    """The GEMMs the converted model trains with on ``tokens`` tokens: every Linear forward and
    backward, and the chunked loss head's."""
    from cutlass_ops.cross_entropy import default_chunk_rows
    from tuning.shapes import model_problems

    chunk = default_chunk_rows(tokens, model.config.vocab_size, torch.device("cuda"),
                               torch.bfloat16)
    return model_problems(model, tokens, backward=True, loss_chunk_rows=chunk)


def tune(model, args) -> None:
    """Tunes what the converted model runs: ``train_problems`` on the train / prefill tokens,
    and the forward at each decode batch."""
    from cutlass_ops.gemms import dispatch
    from tuning.backend import GpuBackend
    from tuning.search import tune as run_tune
    from tuning.shapes import model_problems

    problems = train_problems(model, args.tokens)
    for batch in (1, 16):
        problems += model_problems(model, batch)
    report = run_tune(list(dict.fromkeys(problems)), backend=GpuBackend(), strategy=args.tune)
    print(f"tuned {len(problems)} GEMMs: compiled {report.built} kernels in "
          f"{report.build_seconds:.0f} s, measured in {report.measure_seconds:.0f} s", flush=True)
    dispatch.reset()


def rate_row(case, tokens, ours, ref, ref_name, correct, **detail):
    ours_tps, ref_tps = tokens / ours["ms"] * 1e3, tokens / ref["ms"] * 1e3
    return {"case": case, "unit": "tokens/s", "ours": round(ours_tps, 1),
            "reference": round(ref_tps, 1), "reference_name": ref_name,
            "ratio": round(round(ours_tps, 1) / round(ref_tps, 1), 4), "correct": correct,
            "detail": {"ours_ms": round(ours["ms"], 3), "reference_ms": round(ref["ms"], 3),
                       **detail}}


def memory_row(ours, ref, ref_name, correct: bool):
    """``correct``: whether the train step whose peak this is passed its check (a peak of a
    wrong step is no figure to keep)."""
    return {"case": f"peak memory train ours vs {ref_name}", "unit": "1/GB",
            "ours": round(1 / ours["peak_gb"], 5), "reference": round(1 / ref["peak_gb"], 5),
            "reference_name": ref_name, "ratio": round(ref["peak_gb"] / ours["peak_gb"], 4),
            "correct": correct, "detail": {"ours_gb": round(ours["peak_gb"], 2),
                                           "reference_gb": round(ref["peak_gb"], 2)}}


def pairs(have):
    """(ours variant, reference variant) pairs the issue names, among the variants measured."""
    wanted = [("ours", "eager"), ("ours", "compile"), ("ours+compile", "compile"),
              ("ours", "ours without fused loss")]
    return [(a, b) for a, b in wanted if a in have and b in have]


def prefill_rows(prefill: dict, tokens: int) -> list:
    errors = {k: relative_error(v["logits"], prefill["eager"]["logits"]) for k, v in
              prefill.items()}
    rows = []
    for a, b in pairs(prefill):
        # bf16 rounding over the layers moves the logits: a variant passes within 2e-2 of
        # eager's, or no further from them than its reference (torch.compile's own reordering).
        ok = errors[a] < 2e-2 or errors[a] <= 1.5 * errors[b]
        rows.append(rate_row(f"prefill {a} vs {b}", tokens, prefill[a], prefill[b], b, ok,
                             logits_error_vs_eager=round(errors[a], 5),
                             reference_logits_error_vs_eager=round(errors[b], 5)))
    return rows


def decode_row(decode: dict, models: dict, batch: int, new_tokens: int) -> dict:
    """The decode row of one batch: correct when teacher-forced decoding of eager's generated
    tokens keeps ours' logits within bound at every step. Random weights leave near-ties among
    the logits, so free-running greedy paths may part after one rounding difference: their
    agreement (generated tokens only) is reported, not checked."""
    check = model_checks.teacher_forced_decode(models["ours"], models["eager"],
                                               decode["eager"]["tokens"], PROMPT)
    same = model_checks.generated_agreement(decode["ours"]["tokens"],
                                            decode["eager"]["tokens"], PROMPT)
    return rate_row(f"decode batch {batch} ours vs eager", batch * new_tokens, decode["ours"],
                    decode["eager"], "eager", check.ok, generated_tokens_equal=round(same, 4),
                    **check.detail())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 layers, 1024 tokens, 32 new")
    parser.add_argument("--layers", type=int, default=8, help="decoder layers (default 8)")
    parser.add_argument("--tokens", type=int, default=4096, help="tokens a train / prefill step")
    parser.add_argument("--new-tokens", type=int, default=128, help="tokens generate() decodes")
    parser.add_argument("--reps", type=int, default=20,
                        help="timed repetitions per train / prefill figure (decode: a third, each\n                        a whole generate() of --new-tokens steps)")
    parser.add_argument("--no-compile", action="store_true", help="skip the compiled variants")
    parser.add_argument("--no-loss-baseline", action="store_true",
                        help="skip the converted model without the fused loss (train rows)")
    parser.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS),
                        help="what to measure (default all); the rows of the others are kept "
                             "from the result file when it holds the same code and model")
    parser.add_argument("--tune", choices=["quick", "default", "exhaustive"],
                        help="first tune the model's GEMMs (train, prefill and decode rows, and "
                             "the chunked loss head) with this strategy")
    args = parser.parse_args()
    require_gpu()
    if args.quick:
        args.layers, args.tokens, args.new_tokens = 2, 1024, 32
    import cutlass_ops

    eager = llama(args.layers)
    if args.tune:
        tune(eager, args)
    ours = copy.deepcopy(eager)
    report = cutlass_ops.convert(ours)
    variants = {"eager": eager, "ours": ours}
    if not args.no_loss_baseline:
        # The converted model without the chunked loss head: what the fused loss is measured
        # against (its time and its memory).
        unfused_loss = copy.deepcopy(eager)
        cutlass_ops.convert(unfused_loss, fused_loss=False)
        variants["ours without fused loss"] = unfused_loss
    if not args.no_compile:
        variants["compile"] = torch.compile(eager)
        variants["ours+compile"] = torch.compile(ours)
    ids = torch.randint(0, 128256, (SEQUENCES, args.tokens // SEQUENCES), device="cuda",
                        generator=torch.Generator("cuda").manual_seed(0))
    name = "e2e_quick" if args.quick else "e2e"
    meta = {"layers": args.layers, "tokens": args.tokens, "new_tokens": args.new_tokens,
            "converted": len(report.converted), "skipped": len(report.skipped),
            "conversion": str(report).splitlines()[0]}
    kept = kept_rows(name, meta, set(args.sections))
    rows = []

    # The full run carries the 2-layer run of the same code (run --quick first) in its detail.
    two_layers = None if args.quick else two_layer_run()

    def save():
        extra = {"detail": {"two_layers": two_layers}} if two_layers else {}
        write_result(name, kept + rows, model="Llama-3-8B-shaped", **meta, **extra)

    if "train" in args.sections:
        rows += train_rows(measure_train(variants, ids, args.reps), args.tokens)
        save()
    inference = {k: v for k, v in variants.items() if k != "ours without fused loss"}
    if "prefill" in args.sections:
        rows += prefill_rows(measure_prefill(inference, ids, args.reps), args.tokens)
        save()
    decode_variants = {k: v for k, v in variants.items() if k in ("eager", "ours")}
    for batch in (1, 16) if "decode" in args.sections else ():
        decode = measure_decode(decode_variants, batch, args.new_tokens, max(5, args.reps // 2))
        rows.append(decode_row(decode, decode_variants, batch, args.new_tokens))
        save()
    print_table(["case", "ours", "reference", "ratio", "correct"],
                [[r["case"], r["ours"], r["reference"], r["ratio"], r["correct"]] for r in rows])
    print(report.__str__().splitlines()[0])


if __name__ == "__main__":
    main()
