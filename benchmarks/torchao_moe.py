"""torchao's MoE FP8 training as a peer of ours (issue 53): ``torchao.prototype.moe_training``
with ``Float8TrainingOpConfig`` (its one FP8 recipe, rowwise: activations per row, weights per
expert column, quantized inside each grouped GEMM, forward and backward) on the experts of a copy
of the unconverted Hugging Face model, then ``torch.compile`` of the whole model, as torchtitan
trains MoE models with it.

torchao swaps each expert weight for a tensor subclass whose ``__torch_function__`` catches
``torch._grouped_mm`` by name. transformers 5.x calls ``torch.nn.functional.grouped_mm`` where
torch has it (2.10 and later), which the subclass lets through to the bf16 kernel: the model
would train in bf16 and look like torchao's. ``build`` therefore routes Hugging Face's grouped
GEMM to ``torch._grouped_mm`` when the weight is torchao's (``_route_to_torchao``, what
torchtitan's experts call), then checks in one eager forward that torchao's FP8 grouped GEMM
really ran; where it did not, or torchao is missing or raises, the peer is missing with why.
"""

from __future__ import annotations

import copy
import importlib

import torch
from torch import nn

NAME = "torchao moe fp8"
SETTINGS = {"config": "torchao.prototype.moe_training.config.Float8TrainingOpConfig() "
                      "(rowwise FP8 grouped GEMMs, forward and backward)",
            "converted": "quantize_(model, config, filter_fn=the experts modules): their 3-D "
                         "weights; attention, router and LM head bf16",
            "compile": "torch.compile(model)",
            "experts": "Hugging Face's grouped_mm experts, their grouped GEMM routed to "
                       "torch._grouped_mm for torchao's weights (which it intercepts by name)"}
PROBE_TOKENS = 64


def is_experts(module: nn.Module, fqn: str = "") -> bool:
    """A Hugging Face experts module: its expert weights are 3-D parameters of its own."""
    return fqn.endswith("experts") and any(
        p.dim() == 3 for p in module.parameters(recurse=False))


# torchao's configurations tried in turn: its default (FP8_ROWWISE), then with each expert's
# token group padded to a multiple of 16 (what its grouped GEMM may ask of the offsets).
CONFIGS = ({}, {"pad_token_groups_for_grouped_mm": True})


def build(eager: nn.Module, ids: torch.Tensor) -> tuple[nn.Module | None, str | None, dict]:
    """(torchao's peer of ``eager``, compiled, None, its settings) or (None, why there is none,
    the settings tried). The first of ``CONFIGS`` whose probe forward runs torchao's FP8 grouped
    GEMM is the peer (its settings' "options")."""
    try:
        config_module = importlib.import_module("torchao.prototype.moe_training.config")
        tensor_module = importlib.import_module("torchao.prototype.moe_training.tensor")
        from torchao.quantization import quantize_
    except ImportError as error:
        return None, f"torchao's moe_training is not importable: {error}", SETTINGS
    if not any(is_experts(m, name) for name, m in eager.named_modules()):
        return None, "the model has no experts module with 3-D weights for torchao to convert", \
            SETTINGS
    failures = []
    for options in CONFIGS:
        model = copy.deepcopy(eager)
        try:
            _route_to_torchao()
            quantize_(model, config_module.Float8TrainingOpConfig(**options),
                      filter_fn=is_experts)
            calls = _fp8_calls_of_one_forward(model, ids[:, :PROBE_TOKENS], tensor_module)
        except Exception as error:  # noqa: BLE001 (a prototype: its failure is a result)
            failures.append(f"{options or 'default'}: conversion or first forward raised "
                            f"{type(error).__name__}: {error}"[:300])
            continue
        if calls == 0:
            failures.append(f"{options or 'default'}: torchao's FP8 grouped GEMM was never "
                            "called in a forward (the experts ran bf16)")
            continue
        return torch.compile(model), None, {**SETTINGS, "options": options or "default"}
    return None, "; ".join(failures), SETTINGS


def _fp8_calls_of_one_forward(model: nn.Module, ids: torch.Tensor, tensor_module) -> int:
    """How many times torchao's FP8 grouped GEMM ran in one eager forward of ``model``."""
    real, calls = tensor_module._quantize_then_scaled_grouped_mm, []

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    tensor_module._quantize_then_scaled_grouped_mm = counted
    try:
        with torch.no_grad():
            model(input_ids=ids)
    finally:
        tensor_module._quantize_then_scaled_grouped_mm = real
    return len(calls)


def _route_to_torchao() -> None:
    """Hugging Face's grouped GEMM as ``torch._grouped_mm`` for torchao's expert weights (once;
    other weights keep Hugging Face's own dispatch)."""
    moe = importlib.import_module("transformers.integrations.moe")
    original = moe._grouped_mm
    if getattr(original, "routes_torchao", False):
        return
    from torchao.prototype.moe_training.tensor import TrainingWeightWrapperBaseTensor

    def grouped_mm(input, weight, offs):
        if isinstance(weight, TrainingWeightWrapperBaseTensor):
            return torch._grouped_mm(input.to(weight.dtype), weight, offs=offs)
        return original(input, weight, offs)

    grouped_mm.routes_torchao = True
    moe._grouped_mm = grouped_mm
