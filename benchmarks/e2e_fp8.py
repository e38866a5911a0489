"""The FP8 part of ``benchmarks/e2e.py`` (issues 38 and 50): our FP8 variants, the peers measured
in processes of their own, and the rows that compare them.

- **Ours**: ``cutlass_ops.convert(model, fp8=recipe)`` for each recipe (``--recipes``), with
  convert's other options as the bf16 "ours" (the LM head stays bf16, the loss through the
  chunked head), measured in the main process beside eager and ours bf16, interleaved; a
  recipe named ``R+lm_head`` is R with ``fp8_lm_head=True`` (the chunked loss's head products
  FP8 too), checked against R's emulation with the head FP8 as well and compared with R's peer
  (torchao's recipes keep the head bf16: ``detail.lm_head`` says so). A recipe
  convert refuses, or one that makes no layer FP8, or whose first step raises, is a result (its
  reason), not a crash.
- **Peers**, each in its own process (``e2e.py --only-variant NAME --json OUT``): torchao 0.18
  float8 training (``Float8LinearConfig.from_recipe_name`` tensorwise or rowwise,
  ``convert_to_float8_training`` with the LM head left out), its loss Liger-Kernel 0.8.5's
  fused linear cross-entropy on the final hidden states and the LM head's weight (the strongest
  fused loss torchao's model can take), the decoder under ``torch.compile``
  (``torchao-tensorwise``, ``torchao-rowwise``); the same with HF's full-logits loss and the
  whole model compiled (``torchao-tensorwise-hf-loss``, ``torchao-rowwise-hf-loss``); and Liger-Kernel 0.8.5 on bf16 (``apply_liger_kernel_to_llama``:
  RoPE, RMSNorm, SwiGLU, fused linear cross-entropy). Each builds the same model (same seed) on
  the same tokens, takes eager's reference and times first (Liger's RoPE patch reaches every
  Llama of its process), then its own train step and prefill; its settings (recipe, compile,
  loss) and versions are in its result. torchao float8 patches inductor and Liger transformers'
  modules: neither may touch the main process. Neither package is a dependency of cutlass-ops:
  a peer that cannot be imported is a row saying so; torchao without Liger falls back to HF's
  loss and says so (``settings.loss_note``).
- **Checks**: an FP8 model cannot match eager within the bf16 bounds, and no fixed bound works
  at this depth (``custom_kernels.core.tolerances``). Each parameter's gradient is compared
  directly with the recipe's float32 emulation's (``benchmarks.fp8_emulation``, torch operations
  on the same model and tokens; ``model_checks.EmulationBound``): its distance from it within
  the FP8 margin times the emulation's own error against eager (the noise one implementation of
  the recipe carries), and its norm within ``model_checks.FP8_NORM_RATIO`` of the emulation's,
  which a gradient at half its value fails however noisy; a lost gradient (a skipped layer's)
  fails. The prefill logits may be at most the FP8 margin times as far from eager's as the
  emulation's; the loss keeps the 1% bound. torchao's recipes are checked the same way (its
  tensorwise and rowwise are ours), Liger by the bf16 bounds.

Rows, per recipe R of ``--recipes`` (no recipe stands for another): ``train ours fp8 R vs
torchao R``, ``peak memory train ours fp8 R vs torchao R`` and ``prefill ours fp8 R vs torchao
R`` for R tensorwise and rowwise, the reference the faster of torchao's two R + compile
configurations (with Liger's fused loss, or with HF's loss and the whole model compiled: Liger
0.8.5's loss is not the faster on an H200, so a user would pick the other); for
blockwise ``... vs ours bf16`` (``detail.no_torchao_peer`` says why). Each row's ``detail`` has
the check's bound and measured worst errors, the weaker references in tokens/s
(``weaker_references_tokens_per_s``: eager, ours bf16, torchao's slower configuration)
and the peers' figures, settings and versions (``peers``). A row without its figures has
``ours`` or ``reference`` null, ``ratio`` null, ``correct`` false and ``detail.missing`` saying
why (a peer that did not finish within ``--peer-timeout`` included).
"""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Callable

import torch

from benchmarks import e2e, fp8_emulation, model_checks
from custom_kernels.core.tolerances import (MODEL_LOGITS, fp8_model_tolerance, relative_error,
                                            relative_tolerance)

RECIPES = fp8_emulation.RECIPES
LM_HEAD = "+lm_head"  # a recipe's suffix: the LM head FP8 too (convert(fp8_lm_head=True))
VARIANTS = (*RECIPES, *(f"{recipe}{LM_HEAD}" for recipe in RECIPES))
# torchao's float8 recipes of our names (the main peers: Liger's fused linear cross-entropy as
# their loss), and the same with HF's full-logits loss (a weaker figure, run when named).
TORCHAO = ("torchao-tensorwise", "torchao-rowwise")
HF_LOSS = "-hf-loss"
TORCHAO_HF_LOSS = tuple(f"{variant}{HF_LOSS}" for variant in TORCHAO)
PEERS = (*TORCHAO, *TORCHAO_HF_LOSS, "liger")
DEFAULT_PEERS = (*TORCHAO, *TORCHAO_HF_LOSS, "liger")
PEER_PACKAGES = {**dict.fromkeys((*TORCHAO, *TORCHAO_HF_LOSS), "torchao"),
                 "liger": "liger_kernel"}
PEER_PINS = {"torchao": "torchao==0.18.0", "liger_kernel": "liger-kernel==0.8.5"}
NO_TORCHAO = ("torchao 0.18's Float8LinearConfig.from_recipe_name has no blockwise recipe "
              "(tensorwise, rowwise, rowwise_with_gw_hp); its blockwise training is a prototype "
              "(torchao.prototype.blockwise_fp8_training), not measured: the reference is ours "
              "bf16")


def fp8_name(recipe: str) -> str:
    return f"ours fp8 {recipe}"


def split_variant(variant: str) -> tuple[str, bool]:
    """(the recipe, whether the LM head is FP8 too) of a ``--recipes`` name."""
    head = variant.endswith(LM_HEAD)
    return (variant[:-len(LM_HEAD)] if head else variant), head


def failure(error: BaseException) -> str:
    return f"{type(error).__name__}: {str(error).strip().splitlines()[0] if str(error) else ''}"


# --- our FP8 variants (main process) -----------------------------------------------------------

def fp8_variants(eager, recipes) -> tuple[dict, dict, dict]:
    """``convert(copy of eager, fp8=recipe)`` per recipe: (models by variant name, reasons of
    those that are not FP8 models, each model's conversion in a line)."""
    import cutlass_ops

    models, missing, conversions = {}, {}, {}
    for recipe in recipes:
        name, model = fp8_name(recipe), copy.deepcopy(eager)
        base, head = split_variant(recipe)
        try:
            report = cutlass_ops.convert(model, fp8=base, fp8_lm_head=head)
        except Exception as error:  # noqa: BLE001 (until convert takes fp8=: TypeError)
            missing[name] = f"convert(model, fp8={base!r}, fp8_lm_head={head}) raised " \
                f"{failure(error)}"
            continue
        layers = len(getattr(report, "fp8", None) or {})
        line = f"{str(report).splitlines()[0]}; {layers} layers FP8 {recipe}"
        if not layers:
            missing[name] = f"convert(model, fp8={recipe!r}) made no layer FP8 ({line})"
            continue
        models[name], conversions[name] = model, line
    return models, missing, conversions


class Emulations:
    """The recipes' float32 emulations (``fp8_emulation.emulate_fp8``) of the eager model on
    the benchmark's tokens, each built once, its copy freed after: their gradient bounds
    (``model_checks.fp8_gradient_bound``: the emulation's gradients, kept in host memory, which
    an FP8 model's are compared with directly) and their prefill logits (last 16 positions, as
    ``e2e.measure_prefill`` keeps)."""

    def __init__(self, eager, ids):
        self.eager, self.ids = eager, ids
        self.bounds, self.logits = {}, {}

    def _model(self, recipe):
        base, head = split_variant(recipe)
        return fp8_emulation.emulate_fp8(copy.deepcopy(self.eager), base,
                                         skip=() if head else ("lm_head",))

    def _prefill(self, model) -> torch.Tensor:
        model.eval()
        with torch.no_grad():
            return model(input_ids=self.ids).logits[:, -16:].float()

    def gradient_bound(self, recipe: str, reference_grads: dict) -> model_checks.EmulationBound:
        """The recipe's ``EmulationBound``, its errors against ``reference_grads`` (eager's)."""
        if recipe not in self.bounds:
            model = self._model(recipe)
            model.train()
            _, grads = e2e.first_step(model, e2e.train_step(model, self.ids))
            self.bounds[recipe] = model_checks.fp8_gradient_bound(grads, reference_grads)
            del grads
            self.logits.setdefault(recipe, self._prefill(model))
        return self.bounds[recipe]

    def tolerances(self, recipe: str):
        """What ``e2e.measure_train`` calls with eager's (loss, gradients)."""
        return lambda loss, grads: self.gradient_bound(recipe, grads)

    def prefill_logits(self, recipe: str) -> torch.Tensor:
        if recipe not in self.logits:
            self.logits[recipe] = self._prefill(self._model(recipe))
        return self.logits[recipe]

    def logits_check(self, recipe: str, logits, eager_logits) -> dict:
        """A variant's prefill logits against eager's, bounded by the emulation's error."""
        emulated = relative_error(self.prefill_logits(recipe), eager_logits)
        error = relative_error(logits, eager_logits)
        bound = fp8_model_tolerance(emulated, torch.bfloat16, MODEL_LOGITS)
        return {"correct": error <= bound, "logits_error_vs_eager": round(error, 5),
                "logits_tolerance": round(bound, 5), "emulated_logits_error": round(emulated, 5)}


# --- summarizing ---------------------------------------------------------------------------------

def torchao_variant(recipe: str) -> str | None:
    """The torchao peer of one of our recipes (its own recipe of the same name), or None where
    torchao 0.18 has none (``NO_TORCHAO``)."""
    variant = f"torchao-{split_variant(recipe)[0]}"
    return variant if variant in TORCHAO else None


def _peer_of(recipe: str) -> str:
    return "torchao " + split_variant(recipe)[0] if torchao_variant(recipe) else "ours bf16"


def train_case(recipe: str) -> str:
    return f"train ours fp8 {recipe} vs {_peer_of(recipe)}"


def bf16_case(section: str, recipe: str) -> str:
    """The row of a recipe with a torchao peer against ours bf16 of the same process (the FP8
    speedup a user of ours gets, beside the row against the peer)."""
    return f"{section} ours fp8 {recipe} vs ours bf16"


def memory_case(recipe: str) -> str:
    return f"peak memory train ours fp8 {recipe} vs {_peer_of(recipe)}"


def prefill_case(recipe: str) -> str:
    return f"prefill ours fp8 {recipe} vs {_peer_of(recipe)}"


def peer_summaries(peers: dict, section: str) -> dict:
    """Each peer's figures of one section ("train" or "prefill") for a row's detail: its time,
    check, eager's time in its process (to compare processes by), its settings and versions, or
    why it has none."""
    out = {}
    for name, peer in peers.items():
        part = (peer or {}).get(section)
        if not part:
            out[name] = {"error": (peer or {}).get("error") or f"no {section} figures"}
            continue
        eager_ms = (peer.get("eager") or {}).get(f"{section}_ms")
        out[name] = {**part, "eager_ms_in_its_process": eager_ms,
                     "settings": peer.get("settings", {}), "versions": peer.get("versions", {})}
    return out


def missing_row(case: str, unit: str, ours, reference, reference_name: str, reason: str,
                **detail) -> dict:
    """A row one of whose figures could not be measured: not correct, no ratio, and why."""
    return {"case": case, "unit": unit, "ours": ours, "reference": reference,
            "reference_name": reference_name, "ratio": None, "correct": False,
            "detail": {"missing": reason, **detail}}


def _tokens_per_s(tokens: int, ms: float | None) -> float | None:
    return None if ms is None else round(tokens / ms * 1e3, 1)


def peer_name(variant: str) -> str:
    """A torchao peer as a row names it: its recipe, compile, and its loss."""
    recipe = variant.split("-")[1]
    loss = ", HF full-logits loss" if variant.endswith(HF_LOSS) else ""
    return f"torchao float8 {recipe} + compile{loss}"


def _peer_entry(peers: dict, variant: str | None, section: str) -> tuple[dict | None, str]:
    """A peer's figures of ``section`` (None without) and why it has none."""
    if variant is None:
        return None, "no torchao peer"
    peer = peers.get(variant) or {}
    part = peer.get(section)
    if part and part.get("ms") is not None:
        return part, ""
    return None, f"{variant} has no {section} figure ({peer.get('error') or 'not run'})"


def torchao_variants(recipe: str) -> tuple[str, ...]:
    """The torchao peers of a recipe: with Liger's fused loss, and with HF's full-logits loss
    (the whole model compiled); none where torchao has no such recipe."""
    variant = torchao_variant(recipe)
    return () if variant is None else (variant, f"{variant}{HF_LOSS}")


def fastest_torchao(recipe: str, peers: dict, section: str) -> str | None:
    """The torchao configuration of ``recipe`` a user would pick: the fastest of those measured
    for ``section`` (Liger's fused loss is not always the faster: Liger 0.8.5's chunked loss
    ran slower than HF's compiled one here); the Liger one when neither was measured."""
    timed = [(entry["ms"], v) for v in torchao_variants(recipe)
             for entry in [_peer_entry(peers, v, section)[0]] if entry]
    return min(timed)[1] if timed else torchao_variant(recipe)


def _reference(recipe: str, peers: dict, section: str, bf16: dict) -> tuple:
    """(the row's reference entry, its name, why it is missing) for one recipe's row: the
    fastest torchao configuration of the recipe of the same name + compile where torchao has
    one (``fastest_torchao``), else ours bf16."""
    variant = fastest_torchao(recipe, peers, section)
    if variant is None:
        return bf16, "ours bf16", ""
    entry, why = _peer_entry(peers, variant, section)
    return entry, peer_name(variant), why


def _weaker(recipe: str, peers: dict, section: str, bf16: dict, eager: dict,
            tokens: int) -> dict:
    """The weaker references of a row, by name, in tokens/s: eager and ours bf16 (this
    process), and the slower torchao configuration of the recipe (its own process) where
    measured."""
    out = {"eager": _tokens_per_s(tokens, eager["ms"])}
    if torchao_variant(recipe):
        out["ours bf16"] = _tokens_per_s(tokens, bf16["ms"])
        chosen = fastest_torchao(recipe, peers, section)
        for variant in torchao_variants(recipe):
            entry, _ = _peer_entry(peers, variant, section)
            if entry and variant != chosen:
                out[peer_name(variant)] = _tokens_per_s(tokens, entry["ms"])
    return out


def _detail(recipe: str, peers: dict, section: str, measured: dict, tokens: int) -> dict:
    """What every row of a recipe's ``section`` says: the recipe, why its reference is ours
    bf16 where it is, the weaker references, and the peers' figures (torchao's of the recipe,
    Liger's)."""
    detail = {"recipe": recipe}
    if split_variant(recipe)[1]:
        detail["lm_head"] = ("FP8 here (convert(fp8_lm_head=True)); bf16 in ours bf16 and in "
                             "torchao's recipes, which leave the head out")
    if not torchao_variant(recipe):
        detail["no_torchao_peer"] = NO_TORCHAO
    detail["weaker_references_tokens_per_s"] = _weaker(recipe, peers, section, measured["ours"],
                                                       measured["eager"], tokens)
    detail["peers"] = peer_summaries({v: peers.get(v) for v in peers
                                      if v.startswith(f"torchao-{split_variant(recipe)[0]}")
                                      or v == "liger"},
                                     section)
    return detail


def _missing(recipe: str, entry: dict, key: str, reference_why: str) -> str:
    """Why a recipe's row lacks a figure: ours' reason, the reference's, whichever apply."""
    reasons = [] if key in entry else [f"ours fp8 {recipe}: {entry.get('error', 'not measured')}"]
    return "; ".join(reasons + ([reference_why] if reference_why else []))


def _inverse(gb: float | None) -> float | None:
    return None if gb is None else round(1 / gb, 5)


def _reference_correct(reference: dict):
    """The reference's own check: a peer's "correct", ours bf16's train check."""
    check = reference.get("check")
    return reference.get("correct", None if check is None else check.ok)


# --- rows --------------------------------------------------------------------------------------

def train_rows(train: dict, peers: dict, tokens: int, recipes) -> list:
    """One train row and one peak memory row per recipe (``train_case``, ``memory_case``),
    from ``e2e.measure_train``'s results (our FP8 variants by ``fp8_name``, those that failed as
    {"error": why}) and the peers' results; no recipe stands for another."""
    rows = []
    for recipe in recipes:
        rows += _recipe_train_rows(recipe, train, peers, tokens)
    return rows


def _recipe_train_rows(recipe: str, train: dict, peers: dict, tokens: int) -> list:
    ours = train.get(fp8_name(recipe), {"error": "not measured"})
    reference, name, reference_why = _reference(recipe, peers, "train", train["ours"])
    detail = _detail(recipe, peers, "train", train, tokens)
    if "ms" in ours:
        detail.update(loss_ours=ours["loss"], **ours["check"].detail())
    if "ms" not in ours or reference is None:
        why, reference = _missing(recipe, ours, "ms", reference_why), reference or {}
        return [missing_row(train_case(recipe), "tokens/s", _tokens_per_s(tokens, ours.get("ms")),
                            _tokens_per_s(tokens, reference.get("ms")), name, why, **detail),
                missing_row(memory_case(recipe), "1/GB", _inverse(ours.get("peak_gb")),
                            _inverse(reference.get("peak_gb")), name, why, **detail),
                *_bf16_rows("train", recipe, tokens, ours, train,
                            "ms" in ours and ours["check"].ok, detail)]
    ok = ours["check"].ok
    row = e2e.rate_row(train_case(recipe), tokens, ours, reference, name, ok,
                       loss_reference=reference.get("loss"),
                       reference_correct=_reference_correct(reference), **detail)
    memory = e2e.memory_row(ours, reference, name, ok, case=memory_case(recipe))
    memory["detail"].update({k: v for k, v in detail.items()  # correct: the train check's
                             if k in ("recipe", "no_torchao_peer") or k.startswith("grad_")})
    return [row, memory, *_bf16_rows("train", recipe, tokens, ours, train, ok, detail)]


def _bf16_rows(section: str, recipe: str, tokens: int, ours: dict, measured: dict,
               correct: bool, detail: dict) -> list:
    """``bf16_case``'s row where the recipe's main row is against a torchao peer (none where it
    is already against ours bf16, or ours bf16 was not timed)."""
    bf16 = measured.get("ours", {})
    if not torchao_variant(recipe) or ours.get("ms") is None or bf16.get("ms") is None:
        return []
    kept = {k: v for k, v in detail.items() if k not in ("peers", "weaker_references_tokens_per_s")}
    return [e2e.rate_row(bf16_case(section, recipe), tokens, ours, bf16, "ours bf16", correct,
                         **kept)]


def prefill_rows(prefill: dict, tokens: int, recipes, emulations: Emulations,
                 peers: dict) -> list:
    """One prefill row per recipe (``prefill_case``) from ``e2e.measure_prefill``'s results:
    its logits checked against eager's with the recipe's emulation's bound."""
    return [row for recipe in recipes
            for row in _recipe_prefill_rows(recipe, prefill, tokens, emulations, peers)]


def _recipe_prefill_rows(recipe: str, prefill: dict, tokens: int, emulations: Emulations,
                         peers: dict) -> list:
    ours = prefill.get(fp8_name(recipe), {"error": "not measured"})
    reference, name, reference_why = _reference(recipe, peers, "prefill", prefill["ours"])
    detail = _detail(recipe, peers, "prefill", prefill, tokens)
    if "logits" in ours:
        detail.update(emulations.logits_check(recipe, ours["logits"],
                                              prefill["eager"]["logits"]))
    correct = detail.pop("correct", False)
    if "logits" not in ours or ours.get("ms") is None or reference is None:
        why = _missing(recipe, ours, "logits", reference_why) or "ours fp8 was not timed"
        return [missing_row(prefill_case(recipe), "tokens/s",
                            _tokens_per_s(tokens, ours.get("ms")),
                            _tokens_per_s(tokens, (reference or {}).get("ms")), name, why,
                            **detail),
                *_bf16_rows("prefill", recipe, tokens, ours, prefill, correct, detail)]
    row = e2e.rate_row(prefill_case(recipe), tokens, ours, reference, name, correct,
                       reference_correct=_reference_correct(reference), **detail)
    return [row, *_bf16_rows("prefill", recipe, tokens, ours, prefill, correct, detail)]


# --- peers, each in its own process ------------------------------------------------------------

def peer_meta(variant: str, args) -> dict:
    """What a peer's result must match to be merged: the model, the tokens, the repetitions and
    the code (``benchmarks.common.versions``' project)."""
    from benchmarks.common import versions

    return {"variant": variant, "layers": args.layers, "tokens": args.tokens,
            "reps": args.reps, "seed": 0, "project": versions()["project"]}


def installed(package: str) -> bool:
    """Whether ``package`` can be imported here (found, not imported)."""
    return importlib.util.find_spec(package) is not None


def peer_unavailable(variant: str) -> str | None:
    """Why ``variant``'s package cannot be imported here (without importing it), or None."""
    package = PEER_PACKAGES[variant]
    if not installed(package):
        return (f"{package} is not installed (an optional benchmark dependency: "
                f"pip install {PEER_PINS[package]})")
    return None


def peer_command(variant: str, args, out: Path) -> list[str]:
    command = [sys.executable, str(Path(e2e.__file__).resolve()), "--only-variant", variant,
               "--json", str(out), "--layers", str(args.layers), "--tokens", str(args.tokens),
               "--reps", str(args.reps)]
    return command


def load_peer(path: Path, meta: dict) -> dict | None:
    """The peer result at ``path`` when it was written for ``meta``; None otherwise."""
    try:
        result = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    return result if isinstance(result, dict) and result.get("meta") == meta else None


def _tail(path: Path, lines: int = 6) -> str:
    try:
        text = Path(path).read_text(errors="replace").strip().splitlines()
    except OSError:
        return ""
    return " | ".join(text[-lines:])[-800:]


def run_peer(variant: str, args, directory: Path, timeout: float, fresh: bool = False,
             command=peer_command) -> dict:
    """The result of ``variant``'s own process (``measure_peer``), its output in
    ``directory/<variant>.log``; a result already in ``directory/<variant>.json`` for the same
    meta is reused unless ``fresh``. Never raises: a peer that cannot run is {"error": why}."""
    meta = peer_meta(variant, args)
    out, log = Path(directory) / f"{variant}.json", Path(directory) / f"{variant}.log"
    if not fresh and (kept := load_peer(out, meta)) is not None:
        print(f"{variant}: reusing {out}", flush=True)
        return kept
    why = peer_unavailable(variant)
    if why is not None:
        return {"meta": meta, "error": why}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.unlink(missing_ok=True)
    with open(log, "w") as stream:
        process = subprocess.Popen(command(variant, args, out), stdout=stream,
                                   stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code = process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)  # the peer and its compile workers
            process.wait()
            return {"meta": meta, "error": f"did not finish within {timeout:.0f} s "
                                           f"(--peer-timeout); last output: {_tail(log)}"}
    result = load_peer(out, meta)
    if result is None:
        return {"meta": meta, "error": f"exit code {code} without a result for this run; "
                                       f"last output: {_tail(log)}"}
    return result


def run_peers(variants, args, directory: Path, timeout: float, fresh: bool = False,
              command=peer_command) -> dict:
    """``run_peer`` for each variant in turn (one process at a time: they share the GPU)."""
    out = {}
    for variant in variants:
        out[variant] = run_peer(variant, args, directory, timeout, fresh, command)
        state = out[variant].get("error") or "measured"
        print(f"peer {variant}: {state}", flush=True)
    return out


# --- a peer's own process ----------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Peer:
    """A peer made of e2e's model: its train step (returning the loss), its inference forward
    (returning the logits), the module whose peak ``e2e.peak_memory`` measures, and its settings
    as the result records them."""
    step: Callable[[], torch.Tensor]
    forward: Callable[[], torch.Tensor]
    module: torch.nn.Module
    settings: dict


def torchao_recipe(variant: str) -> str | None:
    """The float8 recipe of a torchao peer ("tensorwise", "rowwise"); None for another peer."""
    return variant.split("-")[1] if variant in (*TORCHAO, *TORCHAO_HF_LOSS) else None


def build_peer(variant: str, model, ids) -> Peer:
    """``model`` made the peer, in place, on the tokens ``ids``."""
    recipe = torchao_recipe(variant)
    if recipe:
        return _torchao_peer(recipe, model, ids, fused_loss=not variant.endswith(HF_LOSS))
    if variant == "liger":
        from liger_kernel.transformers import apply_liger_kernel_to_llama

        apply_liger_kernel_to_llama(model=model)  # 0.8.5's defaults: RoPE, RMSNorm, SwiGLU, FLCE
        return Peer(e2e.train_step(model, ids), lambda: model(input_ids=ids).logits, model,
                    {"patches": "apply_liger_kernel_to_llama(model=...), its defaults: RoPE, "
                                "RMSNorm, SwiGLU, fused linear cross-entropy", "compile": None})
    raise ValueError(f"unknown peer {variant!r}; known: {PEERS}")


def _torchao_peer(recipe: str, model, ids, fused_loss: bool) -> Peer:
    """torchao float8 ``recipe`` on every Linear but the LM head, compiled. Its loss: Liger's
    fused linear cross-entropy on the final hidden states and the LM head's weight (the
    strongest fused loss torchao's model can take; the decoder compiled, the loss Liger's
    kernels), or with ``fused_loss`` False (or Liger missing) HF's full-logits loss inside
    ``torch.compile(model)``."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name(recipe),
                               module_filter_fn=lambda module, fqn: fqn != "lm_head")
    settings = {"recipe": f"Float8LinearConfig.from_recipe_name({recipe!r})",
                "converted": "convert_to_float8_training, every Linear but lm_head (bf16)"}
    if fused_loss and not installed("liger_kernel"):
        settings["loss_note"] = (f"liger_kernel is not installed (pip install "
                                 f"{PEER_PINS['liger_kernel']}): HF's full-logits loss instead")
        fused_loss = False
    if not fused_loss:
        compiled = torch.compile(model)
        settings.update(compile="torch.compile(model)",
                        loss="hf full logits (float32 cross-entropy in the compiled model)")
        return Peer(e2e.train_step(compiled, ids), lambda: compiled(input_ids=ids).logits,
                    compiled, settings)
    from liger_kernel.transformers.fused_linear_cross_entropy import (
        LigerFusedLinearCrossEntropyLoss)

    base = torch.compile(model.model)
    settings.update(compile="torch.compile(model.model): the decoder (Liger's loss kernels run "
                            "outside it)",
                    loss=f"liger fused linear cross-entropy {_version('liger-kernel')} on the "
                         f"final hidden states and lm_head.weight, labels shifted as HF's")
    return Peer(_fused_loss_step(model, base, LigerFusedLinearCrossEntropyLoss(), ids),
                lambda: model.lm_head(base(input_ids=ids).last_hidden_state), model, settings)


def _fused_loss_step(model, base, loss_fn, ids):
    """A train step of HF's causal-LM loss (position t predicts token t + 1, the mean over
    every predicted token) through ``loss_fn(lm_head weight, hidden [tokens, hidden], labels)``."""
    labels = ids[:, 1:].reshape(-1)

    def step():
        model.zero_grad(set_to_none=True)
        hidden = base(input_ids=ids).last_hidden_state[:, :-1]
        out = loss_fn(model.lm_head.weight, hidden.reshape(-1, hidden.shape[-1]), labels)
        loss = out if isinstance(out, torch.Tensor) else getattr(out, "loss", None)
        loss = out[0] if loss is None else loss  # a (loss, z_loss) tuple
        loss.backward()
        return loss
    return step


def _version(package: str) -> str:
    import importlib.metadata

    return importlib.metadata.version(package)


def _versions(variant: str) -> dict:
    """The versions of the packages the peer runs (Liger's too for torchao's fused loss)."""
    packages = [PEER_PINS[PEER_PACKAGES[variant]].split("==")[0]]
    if torchao_recipe(variant) and not variant.endswith(HF_LOSS) and installed("liger_kernel"):
        packages.append("liger-kernel")
    return {package: _version(package) for package in packages}


def _time(fn, reps: int) -> float:
    from tuning.timing import do_bench_interleaved

    return do_bench_interleaved({"fn": fn}, warmup=1, reps=reps, flush_l2=False)["fn"].median_ms


def measure_peer(variant: str, args) -> dict:
    """What ``run_peer`` reads: eager's reference and times, then the peer's train step
    (check, peak, time) and prefill (logits check, time), on e2e's model and tokens. A torchao
    peer's gradients are checked as ours are: against its recipe's float32 emulation."""
    result = {"meta": peer_meta(variant, args), "variant": variant, "error": None}
    eager, ids = e2e.llama(args.layers), e2e.token_ids(args.tokens)
    recipe = torchao_recipe(variant)
    emulations = Emulations(eager, ids) if recipe else None
    step = e2e.train_step(eager, ids)
    loss, grads = e2e.first_step(eager, step)
    tolerance = (emulations.tolerances(recipe)(loss, grads) if recipe
                 else model_checks.gradient_tolerance(eager))
    eager_train_ms = _time(step, args.reps)
    eager.zero_grad(set_to_none=True)
    eager_logits = e2e.prefill_logits(eager, ids)
    with torch.no_grad():
        eager_prefill_ms = _time(lambda: eager(input_ids=ids), args.reps)
    if emulations:
        emulations.prefill_logits(recipe)
    result["eager"] = {"train_ms": round(eager_train_ms, 3), "prefill_ms": round(
        eager_prefill_ms, 3), "loss": loss}
    result["versions"] = _versions(variant)
    peer = build_peer(variant, eager, ids)
    result["settings"] = peer.settings
    eager.train()
    peer_loss, peer_grads = e2e.first_step(peer.module, peer.step)
    check = model_checks.check_train_step(peer_loss, peer_grads, loss, grads, tolerance)
    del peer_grads, grads
    memory = e2e.peak_memory(peer.module, peer.step)
    result["train"] = {"ms": round(_time(peer.step, args.reps), 3),
                       "peak_gb": round(memory["peak_gb"], 2),
                       "memory": e2e.memory_breakdown({"memory": memory}),
                       "loss": peer_loss, "correct": check.ok, **check.detail()}
    result["prefill"] = _peer_prefill(peer, eager, args.reps, eager_logits, emulations, recipe)
    return result


def _peer_prefill(peer: Peer, model, reps: int, eager_logits, emulations, recipe) -> dict:
    """The peer's inference forward: its last 16 positions' logits checked against eager's
    (an FP8 recipe's by its emulation's bound, Liger's by the bf16 one), and its time."""
    model.zero_grad(set_to_none=True)
    model.eval()
    with torch.no_grad():
        logits = peer.forward()[:, -16:].float()
    if emulations:
        check = emulations.logits_check(recipe, logits, eager_logits)
    else:
        error = relative_error(logits, eager_logits)
        bound = relative_tolerance(torch.bfloat16, MODEL_LOGITS)
        check = {"correct": error <= bound, "logits_error_vs_eager": round(error, 5),
                 "logits_tolerance": bound}
    with torch.no_grad():
        return {"ms": round(_time(peer.forward, reps), 3), **check}


def peer_main(args) -> int:
    """``e2e.py --only-variant NAME --json OUT``: measure one peer, write its result (or why it
    could not run) to OUT atomically; exit code 0 when measured."""
    out = Path(args.json)
    try:
        why = peer_unavailable(args.only_variant)
        result = {"meta": peer_meta(args.only_variant, args), "error": why} if why else \
            measure_peer(args.only_variant, args)
    except Exception as error:  # noqa: BLE001 (the parent reads why from the file)
        import traceback

        traceback.print_exc()
        result = {"meta": peer_meta(args.only_variant, args), "error": failure(error)}
    out.parent.mkdir(parents=True, exist_ok=True)
    temporary = out.with_name(out.name + ".tmp")
    temporary.write_text(json.dumps(result, indent=1) + "\n")
    os.replace(temporary, out)
    print(json.dumps({k: result.get(k) for k in ("variant", "error", "eager", "train",
                                                 "prefill")}), flush=True)
    return 0 if not result.get("error") else 1
