"""A Hugging Face model's rotary embedding module (``...RotaryEmbedding``: ``forward(x,
position_ids) -> (cos, sin)``) on one launch: ``custom_kernels.rotary_tables``.

Hugging Face computes the tables afresh at every forward: eight small launches and their host
time, at the start of the step where the GPU has nothing queued yet (a
converted MoE train step spends its first milliseconds waiting on the host:
docs/measurements.md), and at every decode step. The kernel computes the same bits in one launch.

Recognised by structure: a 1-D float ``inv_freq`` buffer, a float ``attention_scaling``, a
``rope_type`` string that is static (Hugging Face's ``dynamic_rope_update`` rewrites
``inv_freq`` from the positions for the dynamic types and longrope: those stay), and a forward
of ``(x, position_ids)``. Then a numeric probe on the GPU: the module's own tables and ours for
the same positions (batch 2, positions up to the model's maximum) must be equal within one
rounding of the dtype, else it stays and the report says why.

The module keeps its class as a base and its buffers; ``unfuse`` restores it. Its forward runs
Hugging Face's own under torch.compile (Inductor fuses those ops itself), off CUDA, and for inputs
the kernel does not take (position ids that are not int64 / int32, a buffer on another device).
"""

from __future__ import annotations

import inspect
from typing import Optional

import torch
from torch import nn

from cutlass_ops import conversion_refusals, mixins
from custom_kernels.core.tolerances import relative_error
from custom_kernels.rotary_tables import DTYPE_CODES, POSITION_DTYPES, rotary_tables

DYNAMIC_TYPES = ("dynamic", "longrope")  # rope types whose inv_freq follows the positions
PROBE_POSITIONS = 64


class FusedRotaryEmbedding:
    """The tables on one launch; mixed into the model's rotary embedding class."""

    def forward(self, x, position_ids):
        inv_freq = self.inv_freq
        if (torch.compiler.is_compiling() or not position_ids.is_cuda
                or position_ids.dtype not in POSITION_DTYPES or x.dtype not in DTYPE_CODES
                or inv_freq.device != position_ids.device or inv_freq.dtype not in DTYPE_CODES):
            return type(self)._hf_class.forward(self, x, position_ids)
        return rotary_tables(inv_freq, position_ids, float(self.attention_scaling), x.dtype)


def _fused_class(cls: type) -> type:
    return mixins.fused_class(FusedRotaryEmbedding, cls, "on one launch")


def looks_like_rotary_embedding(module: nn.Module) -> bool:
    """A module holding what a Hugging Face rotary embedding holds (``structure_refusal`` says
    whether it is one we take)."""
    return isinstance(getattr(module, "inv_freq", None), torch.Tensor) and \
        hasattr(module, "rope_type") and not isinstance(module, FusedRotaryEmbedding)


def structure_refusal(module: nn.Module) -> Optional[str]:
    """Why ``module`` is not a rotary embedding ``fuse`` takes, or None."""
    inv_freq = getattr(module, "inv_freq", None)
    if not isinstance(inv_freq, torch.Tensor) or inv_freq.dim() != 1 or \
            inv_freq.dtype not in DTYPE_CODES:
        return "no 1-D float inv_freq buffer"
    rope_type = getattr(module, "rope_type", None)
    if not isinstance(rope_type, str):
        return f"rope_type {rope_type!r} is not one string (a rope per layer type)"
    if any(kind in rope_type for kind in DYNAMIC_TYPES):
        return f"{rope_type} RoPE: its inv_freq follows the positions (Hugging Face's forward)"
    if not isinstance(getattr(module, "attention_scaling", None), (float, int)):
        return "no numeric attention_scaling"
    names = list(inspect.signature(type(module).forward).parameters)
    if names != ["self", "x", "position_ids"]:
        return f"its forward takes ({', '.join(names[1:])}), not (x, position_ids)"
    return None


def probe(module: nn.Module, dtype: torch.dtype) -> Optional[str]:
    """None when the module's tables and ours agree for ``dtype`` on random positions (within
    one rounding of it), else why not."""
    device = module.inv_freq.device
    top = int(getattr(getattr(module, "config", None), "max_position_embeddings", 4096) or 4096)
    generator = torch.Generator(device).manual_seed(0)
    positions = torch.randint(0, top, (2, PROBE_POSITIONS), device=device, generator=generator)
    x = torch.empty(0, device=device, dtype=dtype)
    with torch.no_grad():
        try:
            theirs = type(module).forward(module, x, positions)
        except Exception as exc:  # noqa: BLE001 - a module that is not what its structure says
            return f"its probe failed: {type(exc).__name__}: {exc}"[:300]
        ours = rotary_tables(module.inv_freq, positions, float(module.attention_scaling), dtype)
    if not (isinstance(theirs, tuple) and len(theirs) == 2 and
            all(isinstance(t, torch.Tensor) and t.shape == ours[0].shape and t.dtype == dtype
                for t in theirs)):
        return "its forward does not return (cos, sin) of [batch, positions, head_dim]"
    error = max(relative_error(a.float(), b.float()) for a, b in zip(ours, theirs))
    if not error <= torch.finfo(dtype).eps:
        return f"its tables differ from ours by {error:.3g} (relative): left as it is"
    return None


def fuse(module: nn.Module, dtype: torch.dtype) -> Optional[str]:
    """Makes ``module`` compute its tables on one launch; None when done, else why not (the
    module is then unchanged). ``dtype``: the model's (the tables' in the probe)."""
    why = structure_refusal(module)
    if why is None:
        why = conversion_refusals.off_cuda(module.inv_freq, "buffers")
    if why is None and dtype not in DTYPE_CODES:
        why = f"{dtype} tables: the kernel writes bf16, fp16 or float32"
    if why is None:
        why = probe(module, dtype)
    if why is not None:
        return why
    module.__class__ = _fused_class(type(module))
    return None


def unfuse(module: nn.Module) -> None:
    if isinstance(module, FusedRotaryEmbedding):
        module.__class__ = type(module)._hf_class


__all__ = ["FusedRotaryEmbedding", "fuse", "unfuse", "probe", "structure_refusal",
           "looks_like_rotary_embedding"]
