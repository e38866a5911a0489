"""Hugging Face's SDPA attention without a materialized causal mask under torch.compile.

Eagerly, Hugging Face leaves an unpadded batch's causal mask to SDPA's ``is_causal``; while
tracing it cannot look at the padding mask's values, so it builds the [B, 1, S, S] mask, and SDPA
runs its masked kernels. cuDNN's masked backward takes more than twice as long as with
``is_causal`` (docs/measurements.md has the figures), which is most of
what a compiled model loses against the converted eager one. Without any padding mask (no
``attention_mask`` passed: a training batch of full sequences), whether the mask is needed is not
data but the call's structure, which a compiled graph is specialised on anyway.

``route(model)`` registers an attention implementation ``cutlass_ops_sdpa`` with Hugging Face's
attention and mask interfaces (Hugging Face's own SDPA function; its own SDPA mask function,
except that it returns no mask for a plain causal mask over a full, unpadded, uncached block of
queries, as eager Hugging Face does) and points the model's config at it. Everything else (a
padding mask, a cache offset, sliding windows, packed sequences, bidirectional masks) goes to
Hugging Face's function unchanged. ``unroute(model)`` restores ``sdpa``.
"""

from __future__ import annotations

import sys

NAME = "cutlass_ops_sdpa"


def _modules():
    """transformers' masking and modeling modules, when the process has imported them (a
    Hugging Face model exists), else None: transformers is never imported here."""
    masking = sys.modules.get("transformers.masking_utils")
    modeling = sys.modules.get("transformers.modeling_utils")
    if masking is None or modeling is None:
        return None
    needed = (hasattr(masking, "AttentionMaskInterface") and hasattr(masking, "sdpa_mask")
              and hasattr(masking, "causal_mask_function")
              and hasattr(modeling, "AttentionInterface")
              and hasattr(modeling, "ALL_ATTENTION_FUNCTIONS"))
    return (masking, modeling) if needed else None


def _unmasked_causal(masking, kwargs) -> bool:
    """The call asks for the plain causal mask of a full block with nothing else in it."""
    return (kwargs.get("allow_is_causal_skip", True)
            and kwargs.get("mask_function") is masking.causal_mask_function
            and kwargs.get("attention_mask") is None
            and kwargs.get("local_size") is None
            and kwargs.get("q_offset", 0) == 0 and kwargs.get("kv_offset", 0) == 0
            and "q_length" in kwargs and kwargs["q_length"] == kwargs.get("kv_length"))


def _register(masking, modeling) -> None:
    def mask(*args, **kwargs):
        if not args and _unmasked_causal(masking, kwargs):
            return None
        return masking.sdpa_mask(*args, **kwargs)

    if NAME not in masking.AttentionMaskInterface._global_mapping:
        masking.AttentionMaskInterface.register(NAME, mask)
    if NAME not in modeling.AttentionInterface._global_mapping:
        modeling.AttentionInterface.register(NAME, modeling.ALL_ATTENTION_FUNCTIONS["sdpa"])


def structure_refusal(model) -> str | None:
    config = getattr(model, "config", None)
    if getattr(config, "_attn_implementation", None) != "sdpa":
        return "not a Hugging Face model on SDPA attention"
    if _modules() is None:
        return "this transformers has no attention and mask interfaces to register with"
    return None


def route(model) -> None:
    """Points a Hugging Face model on SDPA at ``cutlass_ops_sdpa`` (see the module docstring)."""
    masking, modeling = _modules()
    _register(masking, modeling)
    model.config._attn_implementation = NAME


def unroute(model) -> None:
    config = getattr(model, "config", None)
    if getattr(config, "_attn_implementation", None) == NAME:
        config._attn_implementation = "sdpa"


__all__ = ["route", "unroute", "structure_refusal", "NAME"]
