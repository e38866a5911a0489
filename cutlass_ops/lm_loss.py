"""A causal language model's loss through ``linear_cross_entropy``: when a Hugging Face causal LM
(``...ForCausalLM``: a decoder ``model``, an ``lm_head`` Linear, a ``forward`` taking ``labels``)
is called with labels, its logits are never materialized. The backbone runs as it would, then
the head and the loss run a chunk of rows at a time (``cutlass_ops.fused_cross_entropy``), with the
loss Hugging Face computes: labels shifted by one, ``ignore_index`` -100, the mean over the
non-ignored labels or the sum over ``num_items_in_batch`` when the trainer passes it, and the
config's ``final_logit_softcapping`` (Gemma 2). The output's ``logits`` is then None, as Hugging
Face's own fused losses do; without labels (inference, ``generate()``) nothing changes.

The swap is checked like a norm's: on a few random tokens, the model's own loss and ours must
agree within bf16 tolerance, else the model keeps its forward and the report says why.
"""

from __future__ import annotations

import inspect
import types
from typing import Callable, NamedTuple

import torch
from torch import nn

from cutlass_ops import module_state
from custom_kernels.core.errors import UnsupportedInputError

IGNORE_INDEX = -100
PROBE_TOKENS = 16
PROBE_TOLERANCE = 2e-2  # relative, on the loss: bf16 logits rounded differently


def structure_refusal(model: nn.Module) -> str | None:
    """Why ``model`` is not a causal LM whose loss we can route, or None."""
    head = getattr(model, "lm_head", None)
    if not isinstance(head, nn.Linear):
        return "no lm_head Linear"
    if not isinstance(getattr(model, "model", None), nn.Module):
        return "no decoder backbone at .model"
    if getattr(getattr(model, "config", None), "vocab_size", None) != head.out_features:
        return "config.vocab_size is not the lm_head's output size"
    if "labels" not in inspect.signature(type(model).forward).parameters:
        return "its forward takes no labels"
    if getattr(model.forward, "__self__", None) is model and \
            getattr(model.forward, "__func__", None) is _forward:
        return "its loss is routed already"
    return None


def loss_from_hidden(model: nn.Module, hidden: torch.Tensor, labels: torch.Tensor,
                     num_items_in_batch=None) -> torch.Tensor:
    """Hugging Face's causal-LM loss (labels shifted by one) from the backbone's last hidden
    states, through the chunked head."""
    from cutlass_ops.fused_cross_entropy import linear_cross_entropy

    shifted = nn.functional.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]
    head = model.lm_head
    num_items = int(num_items_in_batch) if num_items_in_batch is not None else None
    products = _head_products(head)
    if hasattr(head.weight, "to_local"):  # a vocabulary sharded over ranks (tensor parallel)
        from cutlass_ops.parallel.vocab_parallel_loss import vocab_parallel_linear_cross_entropy

        if products is not None:
            _bf16_head_once("its vocabulary is sharded (the vocabulary-parallel loss)")
        if head.bias is not None:
            raise UnsupportedInputError("the sharded head's loss takes no bias")
        rows = shifted.numel()
        return vocab_parallel_linear_cross_entropy(
            hidden, head.weight, shifted.to(hidden.device), ignore_index=IGNORE_INDEX,
            logit_softcap=getattr(model.config, "final_logit_softcapping", None),
            num_items_in_batch=num_items, chunk_rows=rows)  # one chunk: one gather a step
    return linear_cross_entropy(hidden, head.weight, shifted.to(hidden.device),
                                bias=head.bias, ignore_index=IGNORE_INDEX,
                                logit_softcap=getattr(model.config, "final_logit_softcapping",
                                                      None),
                                num_items_in_batch=num_items, products=products)


def _head_products(head: nn.Module):
    """The head's own products for the chunked loss (an FP8 head's: ``loss_head_products``),
    or None for the bf16 GEMMs. While torch.compile traces, None: the FP8 products run eagerly
    only, so a compiled step's loss head runs bf16 (as the conversion report says)."""
    own = getattr(head, "loss_head_products", None)
    if not callable(own) or torch.compiler.is_compiling():
        return None
    return own()


def _bf16_head_once(why: str) -> None:
    from custom_kernels.core.fallback import log_once

    log_once("the LM head's loss runs its GEMMs in bf16", f"the head is FP8, but {why}")


class RoutedLoss(NamedTuple):
    """A routed model's state (``cutlass_ops.module_state``): its own forward, the names of that
    forward's positional parameters and the output class it returns."""

    original_forward: Callable
    positional: tuple
    output_type: type


def is_routed(model: nn.Module) -> bool:
    return module_state.get(model, RoutedLoss) is not None


def _forward(self, *args, **kwargs):
    """The model's own forward without labels; with them, the backbone, then the chunked head
    and loss (no logits)."""
    # Positional arguments by the original forward's parameter names (cheaper than binding a
    # signature, and traceable by torch.compile).
    routed = module_state.get(self, RoutedLoss)
    arguments = dict(zip(routed.positional, args), **kwargs)
    labels = arguments.pop("labels", None)
    if labels is None:
        return routed.original_forward(*args, **kwargs)
    arguments.pop("logits_to_keep", None)
    arguments.pop("return_dict", None)
    outputs = self.model(**arguments)
    loss = loss_from_hidden(self, outputs[0], labels, arguments.get("num_items_in_batch"))
    fields = {k: v for k, v in outputs.items() if k != "last_hidden_state"}
    return routed.output_type(loss=loss, logits=None, **fields)


def route(model: nn.Module) -> str | None:
    """Routes ``model``'s loss through the chunked head after a probe; returns None when done,
    else why not (the model is then unchanged)."""
    why = structure_refusal(model)
    if why is not None:
        return why
    original = model.forward
    probe_ids = torch.randint(0, model.config.vocab_size, (1, PROBE_TOKENS),
                              generator=torch.Generator().manual_seed(0)).to(
        model.lm_head.weight.device)
    with torch.no_grad():
        expected = original(input_ids=probe_ids, labels=probe_ids)
    output_type = type(expected)
    if getattr(expected, "loss", None) is None:
        return "its forward returned no loss for labels"
    module_state.put(model, RoutedLoss(original, tuple(
        name for name, p in inspect.signature(original).parameters.items()
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)), output_type))
    model.forward = types.MethodType(_forward, model)
    with torch.no_grad():
        ours = model(input_ids=probe_ids, labels=probe_ids).loss
    error = abs(ours.item() - expected.loss.item()) / max(abs(expected.loss.item()), 1e-30)
    if not error <= PROBE_TOLERANCE:
        unroute(model)
        return (f"its loss differs from ours by {error:.3g} (relative; tolerance "
                f"{PROBE_TOLERANCE:g}): another loss than Hugging Face's causal-LM loss, left "
                "as it is")
    return None


def unroute(model: nn.Module) -> None:
    """Restores the model's own forward."""
    if "forward" in vars(model):
        del model.forward
    module_state.drop(model, RoutedLoss)
