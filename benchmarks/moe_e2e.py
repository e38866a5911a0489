"""Mixture-of-experts models end to end (issue 39): Hugging Face models built from configs with
the shapes of Qwen3-30B-A3B (4 layers) and Mixtral-8x7B (2 layers), random bf16 weights, 4096
tokens, ``cutlass_ops.convert`` (the MoE layers' attention half fused, the experts as grouped
GEMMs, the norms, the chunked loss head) against Hugging Face's default path eagerly and against
``torch.compile`` of it, timed interleaved in one process: a train step (forward + backward),
prefill, and ``generate()`` at batch 1 and 16; peak memory. ``train <family> ours graphed vs
compile`` (and ``vs ours``, prefill alike): the converted model's step through
``cutlass_ops.graphed_train_step`` (``graphed_forward``), as in ``e2e.py`` (``--no-graphs``: not).
``train <family> ours fp8 blockwise vs ours bf16`` (and prefill): ``convert(model,
fp8="blockwise")``, the experts' grouped GEMMs FP8 (``cutlass_ops.fp8.fp8_experts``) and the
attention's projections, checked against the recipe's float32 emulation with the experts' GEMMs
emulated too (``e2e_fp8.Emulations``; ``--no-fp8``: not). ``train <family> ours fp8 blockwise vs
torchao moe fp8``: against torchao's MoE FP8 training (``benchmarks.torchao_moe``: rowwise FP8
experts, the rest bf16, compiled), in the same interleaved timing; its gradients held to the
blockwise recipe's emulation bound (the same e4m3 rounding of the experts' operands), and the
row missing, with why, where torchao does not run the model (``--no-torchao``: not measured).

Hugging Face's experts are pinned to ``experts_implementation="grouped_mm"`` (``HF_EXPERTS``,
transformers' default, passed to ``from_config`` and checked on the built model) on the eager
and the compiled side alike (``torch.compile`` wraps the same model); the file records it
(``hf_experts_implementation``). transformers' ``generate()`` itself switches ``grouped_mm``
experts to ``batched_mm`` while it decodes on a GPU (``_optimize_model_for_decode``, in 5.17 as
in 5.24): each decode row's ``detail.hf_experts_in_generate`` says what one short generate()
of the eager model ran (observed with a hook, not assumed).

Decode rows, at batch 1 and 16 (``--new-tokens`` greedy tokens after a 128-token prompt; ours
is the converted model decoded by ``cutlass_ops.generate``: static cache, each step one CUDA
graph, checked stepping through the same graphs): ``decode batch <b> <family> ours vs hf static
compile`` against Hugging Face's ``generate(cache_implementation="static")`` of the unconverted model,
which compiles its decoding forward itself (``e2e.HF_STATIC``: transformers 5.17 compiles
whenever the cache is a compileable one on a GPU, and both models' classes declare
``_can_compile_fullgraph``; ``detail.reference_settings`` records the compile settings and
that it compiled), the strongest decode a Hugging Face user gets; and ``decode batch <b>
<family> ours vs eager``, the dynamic-cache eager ``generate()``. Should the static-cache
compiled path fail for a model, the row is against the static cache without compile (``...
ours vs hf static no compile``), or, should that fail too, there is only the eager row;
``detail.hf_static_failures`` says why. ``--no-compile`` leaves the static-cache peer out. All
three are timed interleaved.

The checks are ``benchmarks.e2e``'s: the loss and every parameter's gradient against eager's,
prefill logits, teacher-forced decode logits (always against eager's model: caches and graphs
change no arithmetic). The gradients' bound is eager's float32 twin's
(``FloatTwin``): each parameter of ours (and of compile) may be at most twice as far from
eager's gradient as the same model in float32 is, and never need be closer than the bf16 model
bound, since the routers' gate gradients are too fragile in bf16 for one fixed bound
(``custom_kernels.core.tolerances``' ``TWIN_MODEL_MARGINS``); the decode check is bounded by the
float32 twin's teacher-forced errors the same way (``model_checks.twin_decode_check``). Each
row whose ``correct`` comes from a bound has the bound and the measured error in ``detail``
(train: ``grad_bound``, ``grad_tolerance``, ``grad_worst_relative_error``, ``loss_bound``,
``loss_relative_error``; prefill: ``logits_bound``, ``logits_error_vs_eager``; decode:
``logits_bound``, ``worst_step_bound``, ``median_step_bound`` and ours' teacher-forced
errors). The train rows' ``detail`` also names what convert did to each layer (its report),
the twin's errors, and where ours' step spends its GPU time (the kernels with the most time,
torch.profiler).

    python benchmarks/moe_e2e.py [--models qwen3-moe mixtral] [--tokens 4096] [--reps 10]
        [--new-tokens 128] [--sections train prefill decode] [--no-compile] [--tune quick]
        [--quick]

Writes benchmarks/results/moe_e2e.json (moe_e2e_quick.json with --quick: one layer each, 1024
tokens, 16 new tokens). A run of some models and sections keeps the file's rows of the others
when they were written on the same GPU with the same settings (a row of other code labelled
with its run, ``detail["run"]``), so each (model, sections) pair may be its own device call.
"""

from __future__ import annotations

import argparse
import copy
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from benchmarks import e2e, e2e_fp8, model_checks, torchao_moe  # noqa: E402
from benchmarks.common import (labelled_rows, print_table, require_gpu,  # noqa: E402
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
HF_EXPERTS = "grouped_mm"  # Hugging Face's experts on the eager and compiled sides
HF_STATIC_NO_COMPILE = "hf static no compile"
# The static-cache peers, best first: the first whose generate() runs is the decode reference.
STATIC_PEERS = ((e2e.HF_STATIC, {"cache_implementation": "static"}),
                (HF_STATIC_NO_COMPILE, {"cache_implementation": "static",
                                        "disable_compile": True}))
# torch.compile's variants (train, prefill) and generate()'s compiled decoding (each batch, the
# experts switched) recompile the same nn.Module call: room for them all, so that none falls
# back to eager silently at the default limit of 8.
RECOMPILE_LIMIT = 64


def build(name: str, layers: int | None = None, device: str = "cuda"):
    """The model of ``MODELS[name]`` in bf16, seeded (every run draws the same), its experts
    pinned to ``HF_EXPERTS``."""
    import transformers

    config_class, default_layers, keywords = MODELS[name]
    config = getattr(transformers, config_class)(
        num_hidden_layers=layers or default_layers, **keywords)
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(
            config, experts_implementation=HF_EXPERTS).to(torch.bfloat16)
    if model.config._experts_implementation != HF_EXPERTS:
        raise RuntimeError(f"{name}: transformers gave experts_implementation="
                           f"{model.config._experts_implementation!r}, not {HF_EXPERTS!r}")
    return model


def experts_in_generate(model) -> list[str]:
    """The experts implementations Hugging Face's ``generate()`` runs ``model``'s first experts
    module with, in order (prefill, then decoding), from one short greedy generate() of the
    dynamic cache watched by a hook (removed before decoding is timed or compiled)."""
    experts = next(m for n, m in model.named_modules() if n.endswith("mlp.experts"))
    seen = []

    def note(module, args):
        implementation = module.config._experts_implementation
        if not seen or seen[-1] != implementation:
            seen.append(implementation)

    handle = experts.register_forward_pre_hook(note)
    prompt = torch.zeros(1, 8, dtype=torch.long, device=next(model.parameters()).device)
    try:
        with torch.no_grad():
            model.eval().generate(prompt, attention_mask=torch.ones_like(prompt),
                                  max_new_tokens=3, min_new_tokens=3, do_sample=False,
                                  pad_token_id=0)
    finally:
        handle.remove()
    return seen


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


TWIN_BOUNDED = ("ours", e2e.GRAPHED, "compile")  # bf16 variants checked against eager's gradients


# FP8 recipes measured (``convert(model, fp8=...)``): the experts take blockwise only
# (cutlass_ops.fp8.fp8_experts); under the others an MoE model's experts stay bf16.
FP8_RECIPES = ("blockwise",)


def measure_train(variants: dict, ids, reps: int,
                  emulations: e2e_fp8.Emulations | None = None) -> tuple[dict, FloatTwin]:
    """``e2e.measure_train`` with ours' and compile's gradients bounded by eager's float32 twin
    (built after eager's step, freed before theirs), the FP8 variants' by their recipe's float32
    emulation (``emulations``; the experts' GEMMs emulated too, as ``fp8_emulation`` says)."""
    twin = FloatTwin(variants["eager"], ids)
    tolerances = {name: twin.tolerances for name in TWIN_BOUNDED if name in variants}
    for recipe in FP8_RECIPES:
        if emulations is not None and e2e_fp8.fp8_name(recipe) in variants:
            tolerances[e2e_fp8.fp8_name(recipe)] = emulations.tolerances(recipe)
    if emulations is not None and torchao_moe.NAME in variants:
        tolerances[torchao_moe.NAME] = emulations.tolerances(TORCHAO_BOUND_RECIPE)
    return e2e.measure_train(variants, ids, reps, tolerances,
                             fragile=(torchao_moe.NAME,)), twin


# torchao's rowwise FP8 experts are held to the blockwise recipe's emulation: the same e4m3
# rounding of the experts' operands (our emulation quantizes the experts under blockwise only).
TORCHAO_BOUND_RECIPE = "blockwise"


def torchao_row(train: dict, why: str | None, settings: dict, tokens: int) -> dict:
    """``train ours fp8 blockwise vs torchao moe fp8``: correct when both steps are within their
    bounds; missing (not correct, no ratio, why) where either did not run."""
    import importlib.metadata

    ours = train.get(e2e_fp8.fp8_name("blockwise"), {"error": "ours fp8 was not measured"})
    peer = train.get(torchao_moe.NAME, {"error": why or "torchao's peer was not measured"})
    case, name = "train ours fp8 blockwise vs torchao moe fp8", f"{torchao_moe.NAME} + compile"
    detail = {"peer_settings": settings, "peer_recipe": "rowwise",
              "ours_recipe": "blockwise", "peer_bound": f"the {TORCHAO_BOUND_RECIPE} recipe's "
              "float32 emulation (experts quantized too)"}
    try:
        detail["torchao"] = importlib.metadata.version("torchao")
    except importlib.metadata.PackageNotFoundError:
        detail["torchao"] = None
    if "ms" not in ours or "ms" not in peer:
        reasons = [e["error"] for e in (ours, peer) if "error" in e]
        return e2e_fp8.missing_row(case, "tokens/s", _rate(tokens, ours), _rate(tokens, peer),
                                   name, "; ".join(reasons) or "not timed", **detail)
    detail.update(ours_check=ours["check"].detail(), peer_check=peer["check"].detail(),
                  peer_loss=peer["loss"], peer_peak_gb=round(peer["peak_gb"], 2))
    return e2e.rate_row(case, tokens, ours, peer, name,
                        bool(ours["check"].ok and peer["check"].ok), **detail)


def _rate(tokens: int, entry: dict) -> float | None:
    return round(tokens / entry["ms"] * 1e3, 1) if entry.get("ms") else None


LOSS_BOUND = 1e-2  # model_checks.loss_within's: ours' loss within 1% of eager's


def train_rows(train: dict, twin: FloatTwin, tokens: int) -> list[dict]:
    """``e2e.train_rows`` with the twin's figures in each train row's detail (the check's
    ``grad_bound`` names the rule) and the loss check's bound and error."""
    rows = e2e.train_rows(train, tokens)
    for row in rows:
        detail = row["detail"]
        detail.update(twin.detail(detail))
        if "loss_ours" in detail and "loss_eager" in detail:
            detail.setdefault("loss_bound", LOSS_BOUND)
            detail.setdefault("loss_relative_error", round(
                abs(detail["loss_ours"] - detail["loss_eager"]) / abs(detail["loss_eager"]), 6))
    return rows


def prefill_rows(prefill: dict, tokens: int) -> list[dict]:
    """``e2e.prefill_rows`` with the rule its check applies named in each row's detail."""
    rows = e2e.prefill_rows(prefill, tokens)
    for row in rows:
        row["detail"].setdefault(
            "logits_bound", "logits_error_vs_eager < 0.02, or at most 1.5 x "
                            "reference_logits_error_vs_eager")
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
    if not args.no_graphs:
        variants[e2e.GRAPHED] = ours  # the same model, its steps through cutlass_ops.graphed_steps
    recipes = () if args.no_fp8 else FP8_RECIPES
    fp8_models, missing, conversions = e2e_fp8.fp8_variants(eager, recipes)
    variants.update(fp8_models)
    if not args.no_compile:
        variants["compile"] = torch.compile(eager)
    vocab = eager.config.vocab_size
    ids = e2e.token_ids(args.tokens, vocab)
    torchao_why, torchao_settings = None, torchao_moe.SETTINGS
    if recipes and not args.no_torchao and "train" in args.sections:
        peer, torchao_why, torchao_settings = torchao_moe.build(eager, ids)
        if peer is not None:
            variants[torchao_moe.NAME] = peer
    emulations = e2e_fp8.Emulations(eager, ids) if recipes else None
    layers = layer_report(report)
    rows = []
    if "train" in args.sections:
        train, twin = measure_train(variants, ids, args.reps, emulations)
        profile = step_profile(e2e.train_step(ours, ids))
        ours.zero_grad(set_to_none=True)
        for row in train_rows(train, twin, args.tokens):
            row["detail"].update(layers=layers, ours_profile=profile)
            rows.append(named(row, family))
        for row in e2e_fp8.train_rows(train, {}, args.tokens, recipes):
            rows.append(named(fp8_detail(row, missing, conversions), family))
        if recipes and not args.no_torchao:
            row = torchao_row(train, torchao_why, torchao_settings, args.tokens)
            rows.append(named(row, family))
    variants.pop(torchao_moe.NAME, None)  # a train peer
    if "prefill" in args.sections:
        prefill = e2e.measure_prefill(variants, ids, args.reps)
        rows += [named(row, family) for row in prefill_rows(prefill, args.tokens)]
        for row in e2e_fp8.prefill_rows(prefill, args.tokens, recipes, emulations, {}):
            rows.append(named(fp8_detail(row, missing, conversions), family))
    if "decode" in args.sections:
        rows += [named(row, family) for row in decode_section(eager, ours, args)]
    return rows


def fp8_detail(row: dict, missing: dict, conversions: dict) -> dict:
    """An FP8 row with what ``convert(model, fp8=...)`` did (or why there is no FP8 model)."""
    variant = e2e_fp8.fp8_name(row["case"].split(" fp8 ", 1)[1].split()[0])
    row["detail"]["fp8_conversion"] = conversions.get(variant) or missing.get(variant)
    return row


def decode_section(eager, ours, args) -> list[dict]:
    """The decode rows of both batches: ours against the static-cache peer (``STATIC_PEERS``,
    none with ``--no-compile``) and against eager, each judged by eager's float32 twin."""
    models = {"eager": eager, "ours": ours}
    seen = experts_in_generate(eager)
    peers = () if args.no_compile else STATIC_PEERS
    decoded = {batch: measure_decode(models, batch, args.new_tokens, max(3, args.reps // 2),
                                     eager.config.vocab_size, peers) for batch in (1, 16)}
    twin = copy.deepcopy(eager).float().eval()
    rows = []
    for batch, (decode, peer, failures) in decoded.items():
        twin_check = twin_decode(twin, eager, decode)
        ours_check = e2e.decode_check(decode, models, graphed=GRAPHED_DECODE)  # once a batch
        for reference in ([peer] if peer else []) + ["eager"]:
            row = e2e.decode_row(decode, models, batch, args.new_tokens, reference=reference,
                                 judge=lambda check: model_checks.twin_decode_check(
                                     check, twin_check), graphed=GRAPHED_DECODE, check=ours_check)
            row["detail"]["hf_experts_in_generate"] = seen
            if reference == HF_STATIC_NO_COMPILE:
                row["detail"]["reference_settings"] = {"cache_implementation": "static",
                                                       "disable_compile": True}
            if failures:
                row["detail"]["hf_static_failures"] = failures
            rows.append(row)
    del twin
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return rows


# Ours decodes through cutlass_ops.generate (static cache, each step one CUDA graph), as in e2e,
# and is checked stepping through the same graphs (the CPU tests turn the graphs off).
OURS_DECODE = {"ours": e2e.graphed_generate}
GRAPHED_DECODE = True


def measure_decode(models: dict, batch: int, new_tokens: int, reps: int, vocab: int,
                   peers=STATIC_PEERS) -> tuple[dict, str | None, dict]:
    """``e2e.measure_decode`` of eager, ours and the first of ``peers`` (name, generate()
    keywords; a peer runs eager's model) whose generate() runs: (the measurements, that peer's
    name or None, why each earlier peer failed)."""
    failures = {}
    for peer, options in peers:
        try:
            return (e2e.measure_decode({**models, peer: models["eager"]}, batch, new_tokens,
                                       reps, vocab, options={peer: options}, calls=OURS_DECODE),
                    peer, failures)
        except Exception as error:  # noqa: BLE001 - the row says why, against the next peer
            failures[peer] = f"{type(error).__name__}: {error}"[:500]
            torch._dynamo.reset()  # nothing half-compiled left for the next peer
    return (e2e.measure_decode(models, batch, new_tokens, reps, vocab, options={},
                               calls=OURS_DECODE), None, failures)


def twin_decode(twin, eager, decode: dict):
    """The float32 ``twin``'s teacher-forced decoding of eager's generated tokens against eager
    (true float32, not TF32: it stands for the exact result): what
    ``model_checks.twin_decode_check`` judges ours by."""
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        return model_checks.teacher_forced_decode(twin, eager, decode["eager"]["tokens"],
                                                  e2e.PROMPT)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32


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
    parser.add_argument("--no-fp8", action="store_true",
                        help="skip ours converted with fp8='blockwise' (experts and attention)")
    parser.add_argument("--no-torchao", action="store_true",
                        help="skip torchao's MoE FP8 training peer of the FP8 train row")
    parser.add_argument("--no-graphs", action="store_true",
                        help="skip ours through cutlass_ops.graphed_train_step / graphed_forward")
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


def kept_rows(rows: list[dict], models, sections) -> list[dict]:
    """The rows a run of ``models`` and ``sections`` does not measure again: another model's,
    or another section's ("peak memory" rows are the train section's)."""
    return [r for r in rows
            if family_of(r) not in models or e2e.section_of(r["case"]) not in sections]


def run_meta(args, gpu: str) -> dict:
    """What a result file's rows were measured with: a later run keeps them only when equal."""
    return dict(gpu=gpu, tokens=args.tokens, new_tokens=args.new_tokens, tune=args.tune,
                layers={f: args.layers or MODELS[f][1] for f in MODELS},
                hf_experts_implementation=HF_EXPERTS)


def main() -> None:
    args = parse_args()
    require_gpu()
    name = "moe_e2e_quick" if args.quick else "moe_e2e"
    # Each model and section may be measured in its own run (one device call each): a run keeps
    # the other models' and sections' rows of a run of the same GPU and settings (those of
    # other code labelled with their run), and replaces its own.
    meta = run_meta(args, torch.cuda.get_device_name())
    kept = kept_rows(labelled_rows(name, meta), args.models, args.sections)
    limit = torch._dynamo.config.recompile_limit
    torch._dynamo.config.recompile_limit = max(limit, RECOMPILE_LIMIT)
    rows = []
    for family in args.models:
        rows += measure(family, args)
        write_result(name, kept + rows, **{k: v for k, v in meta.items() if k != "gpu"},
                     recompile_limit=torch._dynamo.config.recompile_limit)
        torch._dynamo.reset()  # this model's compiled graphs, before the next model's
        torch.cuda.empty_cache()
    rows = kept + rows
    print_table(["case", "ours", "reference", "ratio", "correct"],
                [[r["case"], r["ours"], r["reference"], r["ratio"], r["correct"]] for r in rows])


if __name__ == "__main__":
    main()
