"""Checks that a model computes what a reference model computes (the e2e benchmark's converted
model against eager), shared by ``benchmarks/e2e.py`` and its CPU tests. Pure torch: any device.

Why not the loss alone: a random-weight model's loss sits near ln(vocabulary) whatever its
layers do (a small Llama with every decoder layer skipped stays within 0.43% of it, with every
MLP zeroed within 0.26%), so a 1% loss check passes a broken model. Its gradients and its
per-step logits do not: a skipped layer's parameters get no gradient, a zeroed MLP's gate and up
projections get zeros, and the logits after a skipped layer are off by order 1.

- ``compare_gradients``: every parameter's gradient against the reference's, matched by name
  (``canonical_parameters``), within the tolerance table's ``MODEL_GRADIENTS`` bound.
- ``teacher_forced_decode``: the same tokens fed to both models one at a time through their KV
  caches after a prompt; each step's logits within the ``MODEL_LOGITS`` bound, with the top-1
  agreement reported beside it.
- ``generated_agreement``: the share of generated tokens two ``generate()`` outputs agree on,
  the prompt excluded.
- FP8 models: ``fp8_gradient_bound`` compares each parameter's gradient with the recipe's float32
  emulation's directly (``EmulationBound``): its distance within the emulation's own FP8 noise
  (``fp8_gradient_tolerances``; ``custom_kernels.core.tolerances`` says why no fixed bound works)
  and its norm within ``FP8_NORM_RATIO`` of the emulation's, which a gradient at half its value
  fails however noisy the parameter; a parameter that lost its gradient fails whatever the bound.
- Gradients a fixed bound misjudges (a MoE router's, fragile in bf16): ``twin_gradient_tolerances``
  bounds each parameter by the error the reference's float32 twin has against the reference.
"""

from __future__ import annotations

import dataclasses
import inspect
import math

import torch

from custom_kernels.core.tolerances import (FP8_MODEL_MARGINS, MODEL_GRADIENTS, MODEL_LOGITS,
                                            TWIN_MODEL_MARGINS, fp8_model_tolerance,
                                            relative_error, relative_tolerance,
                                            twin_model_tolerance)

# Wrappers that prefix their module's parameter names: torch.compile's OptimizedModule
# ("_orig_mod.") and DistributedDataParallel ("module."). convert() itself keeps every name
# (cutlass_ops.nn.Linear is an nn.Linear, fused decoder layers keep their submodules, the fused
# norms and experts keep their state_dict keys), so stripping these is the whole mapping.
WRAPPER_PREFIXES = ("_orig_mod.", "module.")


class ParameterMismatch(ValueError):
    """Two models whose parameters cannot be matched one to one by name."""


def canonical_name(name: str) -> str:
    """``name`` without the wrappers' prefixes, wherever they nest."""
    changed = True
    while changed:
        changed = False
        for prefix in WRAPPER_PREFIXES:
            if name.startswith(prefix):
                name, changed = name[len(prefix):], True
    return name


def canonical_parameters(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """The model's parameters by canonical name; ParameterMismatch when two share one."""
    out = {}
    for name, parameter in model.named_parameters():
        key = canonical_name(name)
        if key in out:
            raise ParameterMismatch(f"parameters {name!r} and another both map to {key!r}")
        out[key] = parameter
    return out


def gradients(model: torch.nn.Module) -> dict[str, torch.Tensor | None]:
    """Each parameter's gradient (None where it got none) by canonical name. The tensors are the
    model's own: take them before ``zero_grad(set_to_none=True)``, which then leaves them to
    the caller without a copy."""
    return {name: None if p.grad is None else p.grad.detach()
            for name, p in canonical_parameters(model).items()}


def matched_names(got: dict, expected: dict) -> list[str]:
    """The names of ``expected`` in order, once every name of either side has its match; a
    ParameterMismatch naming the unmatched ones otherwise (a check that skipped them would pass
    a model missing a layer)."""
    missing, extra = sorted(expected.keys() - got.keys()), sorted(got.keys() - expected.keys())
    if missing or extra:
        raise ParameterMismatch(f"parameters without a match: {len(missing)} only in the "
                                f"reference {missing[:5]}, {len(extra)} only in the model "
                                f"checked {extra[:5]}")
    return list(expected)


def gradient_error(got: torch.Tensor | None, expected: torch.Tensor | None) -> float:
    """The relative error of one gradient. A missing gradient counts as zeros (a parameter the
    model no longer uses: error 1 against a real one); a gradient where the reference has none
    or only zeros is infinitely wrong, unless it is zero too, and NaN where it holds NaN (which
    no bound passes, an infinite one included: a twin's, where the reference has none)."""
    if got is None and expected is None:
        return 0.0
    if expected is None or not bool(expected.any()):
        if got is not None and bool(got.isnan().any()):
            return math.nan
        nonzero = got is not None and bool(got.any())
        return math.inf if nonzero else 0.0
    if got is None:
        got = torch.zeros_like(expected)
    if got.shape != expected.shape:
        raise ParameterMismatch(f"gradient of shape {tuple(got.shape)} against "
                                f"{tuple(expected.shape)}")
    return relative_error(got, expected)


def _sort_key(error: float) -> float:
    return math.inf if math.isnan(error) else error  # NaN is the worst, never hidden


def _closeness(error: float, bound: float) -> float:
    """How close ``error`` is to ``bound`` (over 1: past it). An infinite bound (a twin's, where
    the reference has no gradient) passes anything but NaN and says nothing: 0, so that a
    parameter off by inf under it is never named the worst."""
    if math.isinf(bound) and error <= bound:
        return 0.0
    return _sort_key(error / bound)


@dataclasses.dataclass(frozen=True)
class GradientCheck:
    worst_parameter: str  # the closest to its bound (the largest error under one bound)
    worst_error: float
    tolerance: float  # the worst parameter's bound
    failing: int  # parameters over their bound (NaN included), or without a gradient
    parameters: int
    bound: str = ""  # how the bound was set, where it is not one figure for all
    extra: tuple = ()  # further (key, value) pairs for detail(): the norm ratios' (EmulationBound)

    @property
    def ok(self) -> bool:
        return self.failing == 0

    def detail(self) -> dict:
        out = {"grad_worst_parameter": self.worst_parameter,
               "grad_worst_relative_error": round(self.worst_error, 6),
               "grad_tolerance": round(self.tolerance, 6),
               "grad_failing_parameters": self.failing, "grad_parameters": self.parameters,
               **dict(self.extra)}
        return {**out, "grad_bound": self.bound} if self.bound else out


def _lost(got: torch.Tensor | None, expected: torch.Tensor | None) -> bool:
    """A gradient the model no longer computes (none, or zeros) where the reference has one:
    wrong under any bound, however wide (an FP8 bound may pass an error of 1)."""
    return expected is not None and bool(expected.any()) and (got is None or not bool(got.any()))


def compare_gradients(got: dict, expected: dict, tolerance) -> GradientCheck:
    """Every gradient of ``got`` against ``expected`` (both from ``gradients``), within
    ``tolerance``: one figure, or one per parameter name (``fp8_gradient_tolerances``)."""
    names = matched_names(got, expected)
    if not names:
        raise ParameterMismatch("no parameters to compare")
    bounds = tolerance if isinstance(tolerance, dict) else dict.fromkeys(names, tolerance)
    missing = [name for name in names if name not in bounds]
    if missing:
        raise ParameterMismatch(f"no tolerance for {len(missing)} parameters {missing[:5]}")
    errors = {name: gradient_error(got[name], expected[name]) for name in names}
    worst = max(names, key=lambda name: _closeness(errors[name], bounds[name]))
    failing = sum(1 for name in names if not errors[name] <= bounds[name]  # NaN fails
                  or _lost(got[name], expected[name]))
    bound = "" if not isinstance(tolerance, dict) else getattr(tolerance, "rule", "")
    return GradientCheck(worst, errors[worst], bounds[worst], failing, len(names), bound)


def gradient_tolerance(model: torch.nn.Module) -> float:
    """The tolerance table's bound for a whole model's gradients in its parameters' dtype."""
    return relative_tolerance(next(model.parameters()).dtype, MODEL_GRADIENTS)


class Tolerances(dict):
    """Per-parameter bounds (name -> bound) that say how they were set (``rule``)."""

    rule = ""


# An FP8 model's gradient against its recipe's float32 emulation (``EmulationBound``): the window
# its norm must fall in, as a ratio to the emulation's. FP8 noise is tens of percent of a deep
# random model's gradient (``custom_kernels.core.tolerances``), so two correct implementations of
# a recipe are far apart (their noises are largely independent: convert(model, fp8=...) off a GPU
# is 0.67-0.96 x the emulation's own error against eager from the emulation, tiny Llamas of 2 and
# 6 layers, every recipe), and a distance bound alone passes a gradient at half its value where
# that error is above a third. Noise adds to a norm in quadrature, alike for both: the same
# models' norms stay within 0.984-1.033 x the emulation's on every parameter, while a gradient
# at half or twice its value is at 0.5 or 2.0 whatever the noise.
FP8_NORM_RATIO = (0.8, 1.25)


def fp8_gradient_tolerances(emulated: dict[str, float], dtype=torch.bfloat16) -> Tolerances:
    """Each parameter's bound on an FP8 model's gradient's distance from the recipe's float32
    emulation's (``benchmarks.fp8_emulation``): the tolerance table's FP8 margin times
    ``emulated``, the emulation's own error against eager (the FP8 noise one implementation
    carries), or the ``dtype`` model bound where wider."""
    return _per_parameter(emulated, dtype, fp8_model_tolerance,
                          f"distance from the float32 emulation of the recipe within "
                          f"{FP8_MODEL_MARGINS[MODEL_GRADIENTS]} x the emulation's own error "
                          f"against eager")


def norm_ratio(got: torch.Tensor | None, expected: torch.Tensor | None) -> float:
    """||got|| / ||expected|| in float32: 0 for a missing gradient, 1 where neither has one (or
    only zeros), inf where only ``got`` has one, NaN where either holds NaN."""
    expected_norm = 0.0 if expected is None else float(expected.float().norm())
    got_norm = 0.0 if got is None else float(got.float().norm())
    if expected_norm == 0.0:
        return 1.0 if got_norm == 0.0 else got_norm * math.inf
    return got_norm / expected_norm


def _log_distance(ratio: float) -> float:
    """How far a norm ratio is from 1, either way: |log ratio|; inf for 0, inf and NaN."""
    return abs(math.log(ratio)) if 0 < ratio < math.inf else math.inf


def _alike(tensor, like):
    """``tensor`` on ``like``'s device (the emulation's gradients wait in host memory)."""
    return tensor if tensor is None or like is None else tensor.to(like.device)


@dataclasses.dataclass(frozen=True)
class EmulationBound:
    """An FP8 model's gradient check: each gradient compared directly with the recipe's float32
    emulation's (``reference``, by name, kept on any device), its distance within its
    parameter's bound (``tolerances``, ``fp8_gradient_tolerances``) and its norm within
    ``norm_ratio`` x the emulation's; a lost gradient always fails."""
    reference: dict
    tolerances: Tolerances
    norm_ratio: tuple[float, float] = FP8_NORM_RATIO

    @property
    def rule(self) -> str:
        low, high = self.norm_ratio
        return f"{self.tolerances.rule}; each norm within {low}-{high} x the emulation's"

    def check(self, got: dict) -> GradientCheck:
        names = matched_names(got, self.reference)
        missing = [name for name in names if name not in self.tolerances]
        if not names or missing:
            raise ParameterMismatch(f"no tolerance for {len(missing)} parameters {missing[:5]}"
                                    if missing else "no parameters to compare")
        low, high = self.norm_ratio
        errors, ratios, failing = {}, {}, 0
        for name in names:
            expected = _alike(self.reference[name], got[name])
            errors[name] = gradient_error(got[name], expected)
            ratios[name] = norm_ratio(got[name], expected)
            failing += (not errors[name] <= self.tolerances[name]  # NaN fails
                        or not low <= ratios[name] <= high or _lost(got[name], expected))
        worst = max(names, key=lambda name: _closeness(errors[name], self.tolerances[name]))
        furthest = max(names, key=lambda name: _log_distance(ratios[name]))
        extra = (("grad_reference", "the recipe's float32 emulation"),
                 ("grad_norm_ratio_furthest_parameter", furthest),
                 ("grad_norm_ratio", round(ratios[furthest], 6)),
                 ("grad_norm_ratio_window", [low, high]))
        return GradientCheck(worst, errors[worst], self.tolerances[worst], failing, len(names),
                             self.rule, extra)


def fp8_gradient_bound(emulated: dict, reference: dict, dtype=torch.bfloat16,
                       store: str | torch.device = "cpu") -> EmulationBound:
    """The ``EmulationBound`` of a recipe whose float32 emulation's gradients are ``emulated``
    and eager's ``reference`` (both from ``gradients``, the same inputs): the bounds from the
    emulation's error against eager, the emulation's gradients kept in ``store``."""
    names = matched_names(emulated, reference)
    errors = {name: gradient_error(emulated[name], reference[name]) for name in names}
    kept = {name: None if emulated[name] is None else emulated[name].detach().to(store)
            for name in names}
    return EmulationBound(kept, fp8_gradient_tolerances(errors, dtype))


def twin_gradient_tolerances(twin_errors: dict[str, float], dtype=torch.bfloat16) -> Tolerances:
    """Each parameter's bound for a ``dtype`` model's gradients, from the errors the reference's
    float32 twin (the same model and inputs in float32) has against the reference: the
    tolerance table's twin margin times that error, or the ``dtype`` model bound where wider.
    A parameter the twin gives a gradient where the reference has none (an expert the twin's
    routing reached and the reference's did not) has an infinite twin error: the reference is
    no measure there, so its bound is too."""
    return _per_parameter(twin_errors, dtype, twin_model_tolerance,
                          f"{TWIN_MODEL_MARGINS[MODEL_GRADIENTS]} x the float32 twin's error "
                          f"against eager")


def _per_parameter(errors: dict[str, float], dtype, bound, margin_rule: str) -> Tolerances:
    out = Tolerances({name: bound(error, dtype, MODEL_GRADIENTS)
                      for name, error in errors.items()})
    out.rule = (f"per parameter max({relative_tolerance(dtype, MODEL_GRADIENTS)}, "
                f"{margin_rule}); a lost gradient always fails")
    return out


def logits_tolerance(model: torch.nn.Module) -> float:
    return relative_tolerance(next(model.parameters()).dtype, MODEL_LOGITS)


def loss_within(loss: float, reference: float, relative: float = 1e-2) -> bool:
    """The loss check the train rows had alone, kept beside the gradients: necessary, far from
    sufficient (see the module docstring)."""
    return abs(loss - reference) <= relative * abs(reference)


# --- decoding ----------------------------------------------------------------------------------

def _cache_keyword(model: torch.nn.Module) -> str:
    """How this transformers version names the KV cache argument ("cache" from 5.2x on,
    "past_key_values" before; the old name is deprecated)."""
    forward = getattr(type(model), "forward", model.forward)
    parameters = inspect.signature(forward).parameters
    return "cache" if "cache" in parameters else "past_key_values"


class _Stepper:
    """A causal LM fed a prompt, then one token at a time through its own KV cache."""

    def __init__(self, model: torch.nn.Module):
        self.model, self.cache, self.keyword = model, None, _cache_keyword(model)

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        """The last position's logits, float32, [batch, vocab]."""
        kwargs = {} if self.cache is None else {self.keyword: self.cache}
        out = self.model(input_ids=ids, use_cache=True, **kwargs)
        cache = getattr(out, "cache", None)  # transformers 5.2x; "past_key_values" before
        self.cache = cache if cache is not None else getattr(out, "past_key_values", None)
        if self.cache is None:
            raise RuntimeError(f"{type(self.model).__name__} returned no KV cache")
        return out.logits[:, -1].float()


@dataclasses.dataclass(frozen=True)
class DecodeCheck:
    step_errors: tuple[float, ...]  # step 0: after the prompt; step i: after i fed tokens
    top1_agreement: float  # the share of (step, sequence) pairs whose argmax agrees
    tolerance: float

    @property
    def worst_step(self) -> int:
        return max(range(len(self.step_errors)), key=lambda i: _sort_key(self.step_errors[i]))

    @property
    def worst_error(self) -> float:
        return self.step_errors[self.worst_step]

    @property
    def ok(self) -> bool:
        return all(e <= self.tolerance for e in self.step_errors)  # NaN fails

    def detail(self) -> dict:
        return {"teacher_forced_steps": len(self.step_errors),
                "teacher_forced_worst_step": self.worst_step,
                "teacher_forced_worst_logits_error": round(self.worst_error, 6),
                "teacher_forced_median_logits_error": round(
                    sorted(self.step_errors)[len(self.step_errors) // 2], 6),
                "teacher_forced_top1_agreement": round(self.top1_agreement, 4),
                "logits_tolerance": self.tolerance}


class _GraphedStepper:
    """``model`` through ``cutlass_ops.graphed_decode``: the prompt into its static cache, then
    one token at a time through the decode step's CUDA graph (the path its ``generate`` takes)."""

    def __init__(self, model: torch.nn.Module, length: int):
        from cutlass_ops.graphed_decode import graphed_decoder

        self.decoder, self.length, self.started = graphed_decoder(model), length, False

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        if not self.started:
            self.started = True
            return self.decoder.start(ids, max_len=self.length)
        return self.decoder.feed(ids[:, 0])


@torch.no_grad()
def teacher_forced_decode(model: torch.nn.Module, reference: torch.nn.Module,
                          tokens: torch.Tensor, prompt: int,
                          tolerance: float | None = None, graphed: bool = False) -> DecodeCheck:
    """``tokens`` [batch, prompt + n] fed to both models, in lockstep: the prompt at once, then
    tokens ``prompt .. prompt + n - 2`` one at a time through each model's KV cache, so both
    predict every step from the same history (``generate()`` alone would let one rounding
    difference send the two down different paths). Each step's logits are compared as they
    come, so nothing of size steps x vocabulary is kept. ``graphed``: ``model`` steps through
    ``cutlass_ops.graphed_decode`` (static cache, each step one CUDA graph) instead."""
    if not 0 < prompt < tokens.shape[1]:
        raise ValueError(f"prompt {prompt} must leave tokens to feed ({tokens.shape[1]} given)")
    tolerance = logits_tolerance(reference) if tolerance is None else tolerance
    ours = _GraphedStepper(model, tokens.shape[1]) if graphed else _Stepper(model)
    theirs = _Stepper(reference)
    errors, agree = [], 0
    for step in range(tokens.shape[1] - prompt):
        ids = tokens[:, :prompt] if step == 0 else tokens[:, prompt + step - 1:prompt + step]
        got, expected = ours(ids), theirs(ids)
        errors.append(relative_error(got, expected))
        agree += int((got.argmax(-1) == expected.argmax(-1)).sum())
    return DecodeCheck(tuple(errors), agree / (len(errors) * tokens.shape[0]), tolerance)


def twin_decode_check(ours: DecodeCheck, twin: DecodeCheck, dtype=torch.bfloat16) -> dict:
    """Teacher-forced decoding judged by the float32 twin's own (``twin``: the same model in
    float32 against the same eager reference). A mixture-of-experts model's router makes a step
    function of its input: where two experts' scores nearly tie, one rounding difference sends
    a token to other experts and that step's logits apart, for any two implementations, exact
    arithmetic included, so no fixed bound on the worst step fits. Ours passes when its worst
    step and its median step are each within ``twin_model_tolerance`` of the twin's (the
    dtype's logits bound, or twice the twin's error); a systematic error moves the median,
    which no near-tie does. Returns the row's ``correct`` and its detail."""
    def median(check: DecodeCheck) -> float:
        return sorted(check.step_errors)[len(check.step_errors) // 2]

    worst_bound = twin_model_tolerance(twin.worst_error, dtype, MODEL_LOGITS)
    median_bound = twin_model_tolerance(median(twin), dtype, MODEL_LOGITS)
    correct = ours.worst_error <= worst_bound and median(ours) <= median_bound  # NaN fails
    return {"correct": correct,
            "logits_bound": (f"worst and median step each within max("
                             f"{relative_tolerance(dtype, MODEL_LOGITS)}, "
                             f"{TWIN_MODEL_MARGINS[MODEL_LOGITS]} x the float32 twin's)"),
            "worst_step_bound": round(worst_bound, 6), "median_step_bound": round(median_bound, 6),
            "twin_worst_logits_error": round(twin.worst_error, 6),
            "twin_median_logits_error": round(median(twin), 6),
            "twin_top1_agreement": round(twin.top1_agreement, 4)}


def generated_agreement(got: torch.Tensor, expected: torch.Tensor, prompt: int) -> float:
    """The share of generated tokens (positions from ``prompt`` on) where two greedy outputs
    agree; the prompt, identical by construction, is not counted."""
    if got.shape != expected.shape or got.shape[1] <= prompt:
        raise ValueError(f"outputs {tuple(got.shape)} and {tuple(expected.shape)} hold no "
                         f"generated tokens after a prompt of {prompt}")
    return (got[:, prompt:] == expected[:, prompt:]).float().mean().item()


# --- a train step ------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class TrainCheck:
    loss: float
    reference_loss: float
    gradients: GradientCheck

    @property
    def loss_ok(self) -> bool:
        return loss_within(self.loss, self.reference_loss)

    @property
    def ok(self) -> bool:
        return self.loss_ok and self.gradients.ok

    def detail(self) -> dict:
        return {"loss_eager": self.reference_loss, **self.gradients.detail()}


def check_train_step(loss: float, grads: dict, reference_loss: float, reference_grads: dict,
                     tolerance) -> TrainCheck:
    """One train step (its loss and ``gradients``) against the reference model's on the same
    inputs: the loss within 1% and every gradient within ``tolerance`` (a figure, per-parameter
    ``Tolerances``, or an FP8 model's ``EmulationBound``, whose gradients are compared with the
    recipe's emulation's instead of the reference's)."""
    if isinstance(tolerance, EmulationBound):  # an FP8 model: the emulation is the reference
        matched_names(grads, reference_grads)
        return TrainCheck(loss, reference_loss, tolerance.check(grads))
    return TrainCheck(loss, reference_loss,
                      compare_gradients(grads, reference_grads, tolerance))
