"""torchao's MoE FP8 training as a peer of ours (issue 53): ``torchao.prototype.moe_training``
with ``Float8TrainingOpConfig`` (its one FP8 recipe, rowwise: activations per row, weights per
expert column, quantized inside each grouped GEMM, forward and backward) on the experts of a copy
of the unconverted Hugging Face model, then ``torch.compile`` of the whole model, as torchtitan
trains MoE models with it.

Two things stand between torchao 0.18 and a Hugging Face model, and ``build`` does what torchtitan
does about each:
- torchao swaps each expert weight for a tensor subclass whose ``__torch_function__`` catches
  ``torch._grouped_mm`` by name. transformers 5.x calls ``torch.nn.functional.grouped_mm`` where
  torch has it (2.10 and later), which the subclass lets through to the bf16 kernel: the model
  would train in bf16 and look like torchao's. Hugging Face's grouped GEMM is routed to
  ``torch._grouped_mm`` when the weight is torchao's (``_route_to_torchao``).
- torch's FP8 grouped GEMM asks each expert's token group of the weight gradient (the 2d-2d
  form, grouped along the tokens) to be a multiple of 16 rows, and checks it with a device-side
  assert, which ends the process (seen on an H200). torchao's own padding option raises "not yet
  supported" in 0.18; torchtitan pads each group to 16 with zero rows in its token permutation.
  The routed GEMM here does the same (``padded_grouped_mm``): Hugging Face sorts the rows by
  expert, this spreads them into groups padded to 16 and gathers the outputs back.

One eager train step (forward and backward, synchronized) on a short prefix checks that
torchao's FP8 grouped GEMM really ran and that the step survives; where it did not, or torchao
is missing or raises, the peer is missing with why.
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
                       "torch._grouped_mm for torchao's weights (which it intercepts by name), "
                       "each expert's token group padded with zero rows to a multiple of 16 "
                       "(what torch's FP8 grouped GEMM needs; torchtitan pads the same)"}
PROBE_TOKENS = 64


def is_experts(module: nn.Module, fqn: str = "") -> bool:
    """A Hugging Face experts module: its expert weights are 3-D parameters of its own."""
    return fqn.endswith("experts") and any(
        p.dim() == 3 for p in module.parameters(recurse=False))


# torch's FP8 grouped GEMM: each expert's token group a multiple of this many rows (fp8 rows of
# 16 bytes along the grouped dimension), as torchtitan's TOKEN_GROUP_ALIGN_SIZE_M for FP8.
GROUP_ALIGN = 16


def build(eager: nn.Module, ids: torch.Tensor) -> tuple[nn.Module | None, str | None, dict]:
    """(torchao's peer of ``eager``, compiled, None, its settings) or (None, why there is none,
    the settings)."""
    try:
        config_module = importlib.import_module("torchao.prototype.moe_training.config")
        tensor_module = importlib.import_module("torchao.prototype.moe_training.tensor")
        from torchao.quantization import quantize_
    except ImportError as error:
        return None, f"torchao's moe_training is not importable: {error}", SETTINGS
    if not any(is_experts(m, name) for name, m in eager.named_modules()):
        return None, "the model has no experts module with 3-D weights for torchao to convert", \
            SETTINGS
    model = copy.deepcopy(eager)
    try:
        _route_to_torchao()
        quantize_(model, config_module.Float8TrainingOpConfig(), filter_fn=is_experts)
        calls = _fp8_calls_of_one_step(model, ids[:, :PROBE_TOKENS], tensor_module)
    except Exception as error:  # noqa: BLE001 (a prototype: its failure is a result)
        return None, (f"conversion or its first train step raised {type(error).__name__}: "
                      f"{error}")[:400], SETTINGS
    if calls == 0:
        return None, "torchao's FP8 grouped GEMM was never called in a train step (the experts " \
            "ran bf16)", SETTINGS
    return torch.compile(model), None, SETTINGS


def _fp8_calls_of_one_step(model: nn.Module, ids: torch.Tensor, tensor_module) -> int:
    """How many times torchao's FP8 grouped GEMM ran in one eager train step of ``model``
    (forward and backward, then synchronized, so that a failing kernel shows here); the
    gradients are dropped."""
    real, calls = tensor_module._quantize_then_scaled_grouped_mm, []

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    tensor_module._quantize_then_scaled_grouped_mm = counted
    try:
        model(input_ids=ids, labels=ids).loss.backward()
        if ids.is_cuda:
            torch.cuda.synchronize(ids.device)
    finally:
        tensor_module._quantize_then_scaled_grouped_mm = real
        model.zero_grad(set_to_none=True)
    return len(calls)


def _route_to_torchao() -> None:
    """Hugging Face's grouped GEMM as ``padded_grouped_mm`` for torchao's expert weights (once;
    other weights keep Hugging Face's own dispatch)."""
    moe = importlib.import_module("transformers.integrations.moe")
    original = moe._grouped_mm
    if getattr(original, "routes_torchao", False):
        return
    from torchao.prototype.moe_training.tensor import TrainingWeightWrapperBaseTensor

    def grouped_mm(input, weight, offs):
        if isinstance(weight, TrainingWeightWrapperBaseTensor):
            return padded_grouped_mm(input.to(weight.dtype), weight, offs)
        return original(input, weight, offs)

    grouped_mm.routes_torchao = True
    moe._grouped_mm = grouped_mm


def padded_groups(offs: torch.Tensor, rows: int, align: int = GROUP_ALIGN):
    """For rows sorted by expert with group ends ``offs`` [E]: (each row's place once every
    group is padded to a multiple of ``align`` rows, the padded groups' ends as int32, the
    padded buffer's rows). Device ops only (no host sync: torch.compile and graphs keep it); the
    buffer's size is fixed by ``rows`` and E, its rows past the last end belong to no group."""
    ends = offs.to(torch.int64)
    sizes = torch.diff(ends, prepend=ends.new_zeros(1))
    padded_sizes = (sizes + align - 1) // align * align
    padded_ends = torch.cumsum(padded_sizes, 0)
    shift = (padded_ends - padded_sizes) - (ends - sizes)  # a group's start, padded minus not
    index = torch.arange(rows, device=offs.device)
    group = torch.searchsorted(ends, index, right=True).clamp_(max=ends.numel() - 1)
    return index + shift[group], padded_ends.to(torch.int32), rows + ends.numel() * (align - 1)


def padded_grouped_mm(input: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor,
                      align: int = GROUP_ALIGN) -> torch.Tensor:
    """``torch._grouped_mm(input, weight, offs=offs)`` with each expert's group of rows padded
    with zero rows to a multiple of ``align`` (what torch's FP8 grouped GEMM needs of the
    weight gradient's groups); the same result and gradients."""
    place, padded_ends, capacity = padded_groups(offs, input.shape[0], align)
    padded = input.new_zeros(capacity, input.shape[1]).index_copy(0, place, input)
    return torch._grouped_mm(padded, weight, offs=padded_ends).index_select(0, place)
