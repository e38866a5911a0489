"""The FP8 part of ``benchmarks/e2e.py`` (issue 38): our FP8 variants, the peers measured in
processes of their own, and the rows that compare them.

- **Ours**: ``cutlass_ops.convert(model, fp8=recipe)`` for each recipe (``--recipes``), with
  convert's other options as the bf16 "ours" (the LM head stays bf16), measured in the main
  process beside eager and ours bf16, interleaved. A recipe convert refuses, or one that makes
  no layer FP8, or whose first step raises, is a result (its reason), not a crash.
- **Peers**, each in its own process (``e2e.py --only-variant NAME --json OUT``): torchao 0.18
  float8 training (``Float8LinearConfig.from_recipe_name`` tensorwise or rowwise,
  ``convert_to_float8_training`` with the LM head left out, then ``torch.compile``), and
  Liger-Kernel 0.8.5 (``apply_liger_kernel_to_llama(model=...)``: RoPE, RMSNorm, SwiGLU, fused
  linear cross-entropy). Each builds the same model (same seed) on the same tokens, takes eager's
  reference and times first (Liger's RoPE patch reaches every Llama of its process), then its own
  train step and prefill with e2e.py's functions. torchao float8 patches inductor and Liger
  transformers' modules: neither may touch the main process. Neither package is a dependency of
  cutlass-ops: a peer that cannot be imported is a row saying so.
- **Checks**: an FP8 model cannot match eager within the bf16 bounds, and no fixed bound works
  at this depth (``custom_kernels.core.tolerances``): each parameter's gradient, and the prefill
  logits, may be at most the FP8 margin times as far from eager's as the recipe's float32
  emulation (``benchmarks.fp8_emulation``, torch operations on the same model and tokens); the
  loss keeps the 1% bound; a parameter that lost its gradient fails. torchao's recipes are
  checked the same way (its tensorwise and rowwise are ours), Liger by the bf16 bounds.

Rows (``ours fp8`` is the fastest correct recipe of the row, else the fastest measured, named
in ``detail.recipe`` with every recipe's figures in ``detail.recipes`` and the peers' in
``detail.peers``): ``train ours fp8 vs ours bf16``, ``peak memory train ours fp8 vs ours bf16``
(the train row's recipe; each recipe's peak broken down in ``detail.recipes``, as
``e2e.peak_memory`` says), ``train ours fp8 vs torchao float8`` (the reference: the faster torchao
recipe), ``prefill ours fp8 vs ours bf16``. A row without its figures has ``ours`` or
``reference`` null, ``ratio`` null, ``correct`` false and ``detail.missing`` saying why.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import torch

from benchmarks import e2e, fp8_emulation, model_checks
from custom_kernels.core.tolerances import (MODEL_LOGITS, fp8_model_tolerance, relative_error,
                                            relative_tolerance)

RECIPES = fp8_emulation.RECIPES
TORCHAO = ("torchao-tensorwise", "torchao-rowwise")
PEERS = (*TORCHAO, "liger")
PEER_PACKAGES = {"torchao-tensorwise": "torchao", "torchao-rowwise": "torchao",
                 "liger": "liger_kernel"}
PEER_PINS = {"torchao": "torchao==0.18.0", "liger_kernel": "liger-kernel==0.8.5"}
TRAIN_FP8, MEMORY_FP8 = "train ours fp8 vs ours bf16", "peak memory train ours fp8 vs ours bf16"
TRAIN_TORCHAO, PREFILL_FP8 = "train ours fp8 vs torchao float8", "prefill ours fp8 vs ours bf16"
CASES = (TRAIN_FP8, MEMORY_FP8, TRAIN_TORCHAO, PREFILL_FP8)


def fp8_name(recipe: str) -> str:
    return f"ours fp8 {recipe}"


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
        try:
            report = cutlass_ops.convert(model, fp8=recipe)
        except Exception as error:  # noqa: BLE001 (until convert takes fp8=: TypeError)
            missing[name] = f"convert(model, fp8={recipe!r}) raised {failure(error)}"
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
    the benchmark's tokens, each built once, its copy freed after: their gradient errors against
    eager's and their prefill logits (last 16 positions, as ``e2e.measure_prefill`` keeps)."""

    def __init__(self, eager, ids):
        self.eager, self.ids = eager, ids
        self.grad_errors, self.logits = {}, {}

    def _model(self, recipe):
        return fp8_emulation.emulate_fp8(copy.deepcopy(self.eager), recipe)

    def _prefill(self, model) -> torch.Tensor:
        model.eval()
        with torch.no_grad():
            return model(input_ids=self.ids).logits[:, -16:].float()

    def gradient_errors(self, recipe: str, reference_grads: dict) -> dict:
        if recipe not in self.grad_errors:
            model = self._model(recipe)
            model.train()
            _, grads = e2e.first_step(model, e2e.train_step(model, self.ids))
            self.grad_errors[recipe] = {n: model_checks.gradient_error(grads[n], g)
                                        for n, g in reference_grads.items()}
            del grads
            self.logits.setdefault(recipe, self._prefill(model))
        return self.grad_errors[recipe]

    def tolerances(self, recipe: str):
        """What ``e2e.measure_train`` calls with eager's (loss, gradients)."""
        return lambda loss, grads: model_checks.fp8_gradient_tolerances(
            self.gradient_errors(recipe, grads))

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


# --- choosing and summarizing ------------------------------------------------------------------

def best(entries: dict, correct, key: str = "ms") -> str | None:
    """The name of the entry with the least ``key`` among those ``correct`` says pass, else among
    all measured ones (the row then says it is not correct); None when none was measured."""
    measured = {n: e for n, e in entries.items() if e.get(key) is not None}
    passing = {n: e for n, e in measured.items() if correct(e)}
    pool = passing or measured
    return min(pool, key=lambda n: pool[n][key]) if pool else None


def _train_summary(entry: dict) -> dict:
    if "ms" not in entry:
        return {"error": entry.get("error", "not measured")}
    check = entry["check"]
    summary = {"ms": round(entry["ms"], 3), "peak_gb": round(entry["peak_gb"], 2),
               "loss": entry["loss"], "correct": check.ok,
               "grad_worst_parameter": check.gradients.worst_parameter,
               "grad_worst_relative_error": round(check.gradients.worst_error, 6),
               "grad_tolerance": round(check.gradients.tolerance, 6)}
    memory = e2e.memory_breakdown(entry)
    if memory:
        summary["memory"] = memory
    return summary


def peer_summaries(peers: dict, section: str) -> dict:
    """Each peer's figures of one section ("train" or "prefill") for a row's detail: its time,
    check, eager's time in its process (to compare processes by), or why it has none."""
    out = {}
    for name, peer in peers.items():
        part = (peer or {}).get(section)
        if not part:
            out[name] = {"error": (peer or {}).get("error") or f"no {section} figures"}
            continue
        eager_ms = (peer.get("eager") or {}).get(f"{section}_ms")
        out[name] = {**part, "eager_ms_in_its_process": eager_ms,
                     "versions": peer.get("versions", {})}
    return out


def missing_row(case: str, unit: str, ours, reference, reference_name: str, reason: str,
                **detail) -> dict:
    """A row one of whose figures could not be measured: not correct, no ratio, and why."""
    return {"case": case, "unit": unit, "ours": ours, "reference": reference,
            "reference_name": reference_name, "ratio": None, "correct": False,
            "detail": {"missing": reason, **detail}}


def _tokens_per_s(tokens: int, ms: float) -> float:
    return round(tokens / ms * 1e3, 1)


def _reasons(entries: dict) -> str:
    return "; ".join(f"{n}: {e.get('error', 'not measured')}" for n, e in entries.items())


# --- rows --------------------------------------------------------------------------------------

def train_rows(train: dict, peers: dict, tokens: int, recipes) -> list:
    """The FP8 train and peak memory rows from ``e2e.measure_train``'s results (our FP8
    variants by ``fp8_name``, those that failed as {"error": why}) and the peers' results."""
    ours = {r: train.get(fp8_name(r), {"error": "not measured"}) for r in recipes}
    recipe = best(ours, lambda e: e["check"].ok)
    common = {"recipes": {r: _train_summary(e) for r, e in ours.items()},
              "peers": peer_summaries(peers, "train"),
              "eager_ms": round(train["eager"]["ms"], 3)}
    bf16 = train["ours"]
    if recipe is None:
        why = f"no FP8 recipe ran: {_reasons(ours)}"
        return [missing_row(TRAIN_FP8, "tokens/s", None, _tokens_per_s(tokens, bf16["ms"]),
                            "ours bf16", why, **common),
                missing_row(MEMORY_FP8, "1/GB", None, round(1 / bf16["peak_gb"], 5),
                            "ours bf16", why, **common),
                _torchao_row(None, peers, tokens, why, common)]
    chosen, check = ours[recipe], ours[recipe]["check"]
    detail = {"recipe": recipe, "loss_ours": chosen["loss"], **check.detail(), **common}
    rows = [e2e.rate_row(TRAIN_FP8, tokens, chosen, bf16, "ours bf16", check.ok,
                         loss_reference=bf16["loss"], **detail)]
    memory = e2e.memory_row(chosen, bf16, "ours bf16", check.ok, case=MEMORY_FP8)
    memory["detail"].update(recipe=recipe, chosen_as="the train row's recipe",
                            recipes_gb={r: s.get("peak_gb") for r, s in
                                        common["recipes"].items()})
    rows.append(memory)
    rows.append(_torchao_row(chosen, peers, tokens, None, detail))
    return rows


def _torchao_row(chosen, peers: dict, tokens: int, ours_missing, detail) -> dict:
    """``train ours fp8 vs torchao float8``: the reference is the faster torchao recipe whose
    process measured a train step (its own check in detail, not the row's)."""
    torchao = {n: (peers.get(n) or {}).get("train") or {} for n in TORCHAO}
    faster = best(torchao, lambda e: True)
    ours = None if chosen is None else _tokens_per_s(tokens, chosen["ms"])
    if faster is None:
        why = "; ".join(f"{n}: {(peers.get(n) or {}).get('error', 'not run')}" for n in TORCHAO)
        why = f"torchao float8 has no train figure ({why})"
        if ours_missing:
            why = f"{ours_missing}; {why}"
        return missing_row(TRAIN_TORCHAO, "tokens/s", ours, None, "torchao float8", why,
                           **detail)
    reference = torchao[faster]
    name = f"torchao float8 {faster.split('-', 1)[1]} + compile"
    if chosen is None:
        return missing_row(TRAIN_TORCHAO, "tokens/s", None, _tokens_per_s(tokens, reference["ms"]),
                           name, ours_missing, torchao_variant=faster, **detail)
    return e2e.rate_row(TRAIN_TORCHAO, tokens, chosen, reference, name,
                        chosen["check"].ok, torchao_variant=faster,
                        reference_correct=reference.get("correct"), **detail)


def prefill_rows(prefill: dict, tokens: int, recipes, emulations: Emulations,
                 peers: dict) -> list:
    """``prefill ours fp8 vs ours bf16`` from ``e2e.measure_prefill``'s results: each recipe's
    logits checked against eager's with the emulation's bound."""
    eager_logits = prefill["eager"]["logits"]
    ours = {}
    for recipe in recipes:
        entry = prefill.get(fp8_name(recipe), {"error": "not measured"})
        if "logits" not in entry:
            ours[recipe] = {"error": entry.get("error", "not measured")}
            continue
        check = emulations.logits_check(recipe, entry["logits"], eager_logits)
        ours[recipe] = {"ms": entry["ms"], **check}
    recipe = best(ours, lambda e: e["correct"])
    detail = {"recipes": {r: {k: (round(v, 3) if k == "ms" else v) for k, v in e.items()}
                          for r, e in ours.items()},
              "peers": peer_summaries(peers, "prefill"),
              "eager_ms": round(prefill["eager"]["ms"], 3)}
    bf16 = prefill["ours"]
    if recipe is None:
        return [missing_row(PREFILL_FP8, "tokens/s", None, _tokens_per_s(tokens, bf16["ms"]),
                            "ours bf16", f"no FP8 recipe ran: {_reasons(ours)}", **detail)]
    chosen = ours[recipe]
    return [e2e.rate_row(PREFILL_FP8, tokens, chosen, bf16, "ours bf16", chosen["correct"],
                         recipe=recipe, **{k: v for k, v in chosen.items()
                                           if k not in ("ms", "correct")}, **detail)]


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

def build_peer(variant: str, model):
    """``model`` made the peer, in place (the result may wrap it)."""
    if variant in TORCHAO:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        config = Float8LinearConfig.from_recipe_name(variant.split("-", 1)[1])
        convert_to_float8_training(model, config=config,
                                   module_filter_fn=lambda module, fqn: fqn != "lm_head")
        return torch.compile(model)
    if variant == "liger":
        from liger_kernel.transformers import apply_liger_kernel_to_llama

        apply_liger_kernel_to_llama(model=model)  # 0.8.5's defaults: RoPE, RMSNorm, SwiGLU, FLCE
        return model
    raise ValueError(f"unknown peer {variant!r}; known: {PEERS}")


def _versions(variant: str) -> dict:
    import importlib.metadata

    package = PEER_PINS[PEER_PACKAGES[variant]].split("==")[0]
    return {package: importlib.metadata.version(package)}


def _time(fn, reps: int) -> float:
    from tuning.timing import do_bench_interleaved

    return do_bench_interleaved({"fn": fn}, warmup=1, reps=reps, flush_l2=False)["fn"].median_ms


def measure_peer(variant: str, args) -> dict:
    """What ``run_peer`` reads: eager's reference and times, then the peer's train step
    (check, peak, time) and prefill (logits check, time), on e2e's model and tokens."""
    result = {"meta": peer_meta(variant, args), "variant": variant, "error": None}
    eager, ids = e2e.llama(args.layers), e2e.token_ids(args.tokens)
    recipe = variant.split("-", 1)[1] if variant in TORCHAO else None
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
    model = build_peer(variant, eager)
    model.train()
    step = e2e.train_step(model, ids)
    ours_loss, ours_grads = e2e.first_step(model, step)
    check = model_checks.check_train_step(ours_loss, ours_grads, loss, grads, tolerance)
    del ours_grads, grads
    memory = e2e.peak_memory(model, step)
    result["train"] = {"ms": round(_time(step, args.reps), 3),
                       "peak_gb": round(memory["peak_gb"], 2),
                       "memory": e2e.memory_breakdown({"memory": memory}),
                       "loss": ours_loss, "correct": check.ok, **check.detail()}
    model.zero_grad(set_to_none=True)
    logits = e2e.prefill_logits(model, ids)
    if emulations:
        prefill = emulations.logits_check(recipe, logits, eager_logits)
    else:
        error = relative_error(logits, eager_logits)
        bound = relative_tolerance(torch.bfloat16, MODEL_LOGITS)
        prefill = {"correct": error <= bound, "logits_error_vs_eager": round(error, 5),
                   "logits_tolerance": bound}
    with torch.no_grad():
        result["prefill"] = {"ms": round(_time(lambda: model(input_ids=ids), args.reps), 3),
                             **prefill}
    return result


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
