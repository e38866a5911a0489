"""Mixture-of-experts models end to end (issue 39): Hugging Face models built from configs with
the shapes of Qwen3-30B-A3B (4 layers) and Mixtral-8x7B (2 layers), random bf16 weights, 4096
tokens, ``cutlass_ops.convert`` (the MoE layers' attention half fused, the experts as grouped
GEMMs, the norms, the chunked loss head) against Hugging Face's default path eagerly and against
``torch.compile`` of it, timed interleaved in one process: a train step (forward + backward),
prefill, and ``generate()`` at batch 1 and 16; peak memory.

The checks are ``benchmarks.e2e``'s: the loss and every parameter's gradient against eager's,
prefill logits, teacher-forced decode logits. The gradients' bound is eager's float32 twin's
(``FloatTwin``): each parameter of ours (and of compile) may be at most twice as far from
eager's gradient as the same model in float32 is, and never need be closer than the bf16 model
bound, since the routers' gate gradients are too fragile in bf16 for one fixed bound
(``custom_kernels.core.tolerances``' ``TWIN_MODEL_MARGINS``). Each row's ``detail`` names
what convert did to each layer (its report) and, for the train rows, the bound's rule and the
twin's errors, and where ours' step spends its GPU time (the kernels with the most time,
torch.profiler).

    python benchmarks/moe_e2e.py [--models qwen3-moe mixtral] [--tokens 4096] [--reps 10]
        [--new-tokens 128] [--sections train prefill decode] [--no-compile] [--tune quick]
        [--quick]

Writes benchmarks/results/moe_e2e.json (moe_e2e_quick.json with --quick: one layer each, 1024
tokens, 16 new tokens).
"""

from __future__ import annotations

import argparse
import copy
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from benchmarks import e2e, model_checks  # noqa: E402
from benchmarks.common import (print_table, require_gpu, rows_of_same_run,  # noqa: E402
                               write_result)

# name: (config class, layers, the config's keywords): the published models' shapes.
MODELS = {
    "qwen3-moe": ("Qwen3MoeConfig", 4, dict(
        hidden_size=2048, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
        moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
        decoder_sparse_step=1, mlp_only_layers=[], vocab_size=151936,
        max_position_embeddings=8192)),
    "mixtral": ("MixtralConfig", 2, dict(
        hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
        num_local_experts=8, num_experts_per_tok=2, vocab_size=32000,
        max_position_embeddings=8192)),
}
SECTIONS = ("train", "prefill", "decode")
PROFILE_TOP = 12


def build(name: str, layers: int | None = None):
    """The model of ``MODELS[name]`` on the GPU in bf16, seeded (every run draws the same)."""
    import transformers

    config_class, default_layers, keywords = MODELS[name]
    config = getattr(transformers, config_class)(
        num_hidden_layers=layers or default_layers, **keywords)
    torch.manual_seed(0)
    with torch.device("cuda"):
        return transformers.AutoModelForCausalLM.from_config(config).to(torch.bfloat16)


def named(row: dict, family: str) -> dict:
    """``e2e``'s row with the family after its section: "train ours vs eager" becomes "train
    qwen3-moe ours vs eager", "decode batch 1 ours vs eager" "decode batch 1 qwen3-moe ours vs
    eager"."""
    head, tail = row["case"].split(" ours ", 1)
    return {**row, "case": f"{head} {family} ours {tail}"}


def layer_report(report) -> dict:
    """convert's decision for each decoder layer and experts module: name -> what it runs."""
    return {d.name: (d.reason if d.converted else f"unchanged: {d.reason}")
            for d in report.decisions
            if d.kind.endswith("DecoderLayer") or d.kind.endswith("Experts")}


def step_profile(step, top: int = PROFILE_TOP) -> dict:
    """GPU milliseconds of one call of ``step`` (after a warm one), in total and for its ``top``
    kernels."""
    from torch.profiler import ProfilerActivity, profile

    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    events = sorted(prof.key_averages(), key=lambda e: -e.device_time_total)
    total = sum(e.device_time_total for e in events) / 1e3
    return {"kernels_ms": round(total, 3),
            "top": [{"kernel": e.key[:120], "ms": round(e.device_time_total / 1e3, 3),
                     "calls": e.count} for e in events[:top] if e.device_time_total > 0]}


def tune(model, tokens: int, strategy: str) -> None:
    """Tunes what the converted model runs: its dense GEMMs (attention, the loss head; train
    and decode) and its experts' grouped GEMMs over the routed rows, forward and backward."""
    from cutlass_ops.gemms import dispatch
    from tuning import grouped_search
    from tuning.backend import GpuBackend
    from tuning.search import tune as run_tune
    from tuning.shapes import model_grouped_problems, model_problems

    problems = e2e.train_problems(model, tokens)
    for batch in (1, 16):
        problems += model_problems(model, batch)
    run_tune(list(dict.fromkeys(problems)), backend=GpuBackend(), strategy=strategy)
    grouped = model_grouped_problems(model, tokens, backward=True)
    for batch in (1, 16):
        grouped += model_grouped_problems(model, batch)
    grouped_search.tune(list(dict.fromkeys(grouped)), strategy=strategy)
    dispatch.reset()


class FloatTwin:
    """The eager model's float32 twin on the benchmark's tokens: one train step of a float32
    copy, its gradients' errors against eager's kept, the copy and its gradients freed before
    any other variant's step (``e2e.measure_train`` calls ``tolerances`` right after eager's).
    Its peak is a float32 model, its gradients and activations beside eager's bf16 weights and
    kept gradients."""

    def __init__(self, eager, ids):
        self.eager, self.ids = eager, ids
        self.grad_errors: dict[str, float] | None = None

    def gradient_errors(self, reference_grads: dict) -> dict[str, float]:
        """Each parameter's twin gradient's error against ``reference_grads`` (eager's);
        computed once, for every variant bounded by it."""
        if self.grad_errors is None:
            twin = copy.deepcopy(self.eager).float()
            twin.train()
            # true float32, not TF32: the twin stands for the exact result, so its own
            # rounding must be far below bf16's
            tf32 = torch.backends.cuda.matmul.allow_tf32
            torch.backends.cuda.matmul.allow_tf32 = False
            try:
                _, grads = e2e.first_step(twin, e2e.train_step(twin, self.ids))
            finally:
                torch.backends.cuda.matmul.allow_tf32 = tf32
            del twin
            names = model_checks.matched_names(grads, reference_grads)
            self.grad_errors = {n: model_checks.gradient_error(grads[n], reference_grads[n])
                                for n in names}
            del grads
            if torch.cuda.is_available():
                torch.cuda.empty_cache()  # the twin's float32 blocks, before the next peak
        return self.grad_errors

    def tolerances(self, loss: float, grads: dict) -> model_checks.Tolerances:
        """What ``e2e.measure_train`` calls with eager's (loss, gradients)."""
        return model_checks.twin_gradient_tolerances(self.gradient_errors(grads))

    def detail(self, row_detail: dict) -> dict:
        """The twin's figures for a train row: its error on the row's worst parameter (whose
        bound it set) and its worst error over all."""
        if not self.grad_errors or "grad_worst_parameter" not in row_detail:
            return {}
        errors = self.grad_errors
        worst = max(errors, key=lambda n: math.inf if math.isnan(errors[n]) else errors[n])
        return {"twin_grad_error_of_worst_parameter":
                round(errors.get(row_detail["grad_worst_parameter"], math.nan), 6),
                "twin_grad_worst_parameter": worst,
                "twin_grad_worst_relative_error": round(errors[worst], 6)}


TWIN_BOUNDED = ("ours", "compile")  # bf16 variants checked against eager's gradients


def measure_train(variants: dict, ids, reps: int) -> tuple[dict, FloatTwin]:
    """``e2e.measure_train`` with ours' and compile's gradients bounded by eager's float32 twin
    (built after eager's step, freed before theirs)."""
    twin = FloatTwin(variants["eager"], ids)
    tolerances = {name: twin.tolerances for name in TWIN_BOUNDED if name in variants}
    return e2e.measure_train(variants, ids, reps, tolerances), twin


def train_rows(train: dict, twin: FloatTwin, tokens: int) -> list[dict]:
    """``e2e.train_rows`` with the twin's figures in each train row's detail (the check's
    ``grad_bound`` names the rule)."""
    rows = e2e.train_rows(train, tokens)
    for row in rows:
        row["detail"].update(twin.detail(row["detail"]))
    return rows


def measure(family: str, args) -> list[dict]:
    """The rows of one model: its variants built, checked and timed, eager first."""
    import cutlass_ops

    eager = build(family, args.layers)
    if args.tune:
        tune(eager, args.tokens, args.tune)
    ours = copy.deepcopy(eager)
    report = cutlass_ops.convert(ours)
    variants = {"eager": eager, "ours": ours}
    if not args.no_compile:
        variants["compile"] = torch.compile(eager)
    vocab = eager.config.vocab_size
    ids = e2e.token_ids(args.tokens, vocab)
    layers = layer_report(report)
    rows = []
    if "train" in args.sections:
        train, twin = measure_train(variants, ids, args.reps)
        profile = step_profile(e2e.train_step(ours, ids))
        ours.zero_grad(set_to_none=True)
        for row in train_rows(train, twin, args.tokens):
            row["detail"].update(layers=layers, ours_profile=profile)
            rows.append(named(row, family))
    if "prefill" in args.sections:
        prefill = e2e.measure_prefill(variants, ids, args.reps)
        rows += [named(row, family) for row in e2e.prefill_rows(prefill, args.tokens)]
    decode_variants = {"eager": eager, "ours": ours}
    decoded = {}
    for batch in (1, 16) if "decode" in args.sections else ():
        decoded[batch] = e2e.measure_decode(decode_variants, batch, args.new_tokens,
                                            max(3, args.reps // 2), vocab)
    if decoded:
        twin = copy.deepcopy(eager).float().eval()
        for batch, decode in decoded.items():
            rows.append(named(decode_row(decode, decode_variants, twin, batch,
                                         args.new_tokens), family))
        del twin
        torch.cuda.empty_cache()
    return rows


def decode_row(decode: dict, models: dict, twin, batch: int, new_tokens: int) -> dict:
    """``e2e.decode_row`` judged by the float32 ``twin`` (``model_checks.twin_decode_check``):
    the twin decodes eager's tokens teacher-forced against eager as ours does (true float32,
    not TF32: it stands for the exact result), and ours may be twice as far from eager."""
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        twin_check = model_checks.teacher_forced_decode(twin, models["eager"],
                                                        decode["eager"]["tokens"], e2e.PROMPT)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    return e2e.decode_row(decode, models, batch, new_tokens,
                          judge=lambda check: model_checks.twin_decode_check(check, twin_check))


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    parser.add_argument("--quick", action="store_true",
                        help="one layer each, 1024 tokens, 16 new tokens")
    parser.add_argument("--layers", type=int, help="decoder layers (default: the model's)")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS))
    parser.add_argument("--no-compile", action="store_true", help="skip torch.compile")
    parser.add_argument("--tune", choices=["quick", "default", "exhaustive"],
                        help="first tune the converted model's GEMMs and grouped GEMMs")
    args = parser.parse_args(argv)
    if args.quick:
        args.layers, args.tokens, args.new_tokens = 1, 1024, 16
        args.reps = min(args.reps, 5)
    return args


def family_of(row: dict) -> str | None:
    """The model a row measured ("train qwen3-moe ours vs eager" -> "qwen3-moe")."""
    return next((f for f in MODELS if f" {f} ours " in row["case"]), None)


def main() -> None:
    args = parse_args()
    require_gpu()
    name = "moe_e2e_quick" if args.quick else "moe_e2e"
    # Each model may be measured in its own run (one device call each): a run keeps the other
    # models' rows of a run of the same code, GPU and settings, and replaces its own.
    meta = dict(gpu=torch.cuda.get_device_name(), tokens=args.tokens,
                new_tokens=args.new_tokens, tune=args.tune,
                layers={f: args.layers or MODELS[f][1] for f in MODELS})
    kept = [r for r in rows_of_same_run(name, meta) if family_of(r) not in args.models]
    rows = []
    for family in args.models:
        rows += measure(family, args)
        write_result(name, kept + rows, **{k: v for k, v in meta.items() if k != "gpu"})
        torch.cuda.empty_cache()
    rows = kept + rows
    print_table(["case", "ours", "reference", "ratio", "correct"],
                [[r["case"], r["ours"], r["reference"], r["ratio"], r["correct"]] for r in rows])


if __name__ == "__main__":
    main()
