"""Attention of one query token a sequence with grouped KV heads, without repeating the cache.

Hugging Face's SDPA path (transformers 5.17, which the GPU image has) repeats K and V to every
query head whenever a mask is given (``repeat_kv``: torch's SDPA falls back to its math kernel for
grouped heads with a mask), and a static cache always comes with one. At a decode step that copy
is the whole cache, twice a layer: on the 8-layer Llama-3-8B-shaped model at batch 16, 0.58 ms of
a 2.87 ms step (H200 profile, docs/measurements.md). With one query token, the query heads of a
group can instead be laid out as the rows of one head (``[B, H, 1, D]`` as ``[B, KV, H/KV, D]``):
SDPA then reads each cached K and V once and the mask, shared by the heads, broadcasts over the
rows. transformers 5.2x does the same (``pack_gqa``); doing it here gives every version it.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

# Keywords of the attention interface that this path does not implement: then the model's own.
_UNSUPPORTED = ("softcap", "position_bias", "s_aux", "sinks", "output_attentions")


def packed_decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            mask: Optional[torch.Tensor], scaling: Optional[float], groups: int,
                            **kwargs) -> Optional[torch.Tensor]:
    """SDPA of ``q`` [B, H, 1, D] over ``k`` / ``v`` [B, H / groups, L, D] as ``[B, 1, H, Dv]``
    (what Hugging Face's ``sdpa_attention_forward`` returns), or None when this layout does not
    apply: more than one query token, no grouping, a mask that differs by head, or an interface
    keyword it does not implement."""
    if q.shape[2] != 1 or groups <= 1 or k.shape[1] * groups != q.shape[1]:
        return None
    if mask is not None and (mask.dim() != 4 or mask.shape[1] != 1 or mask.shape[2] != 1):
        return None
    if any(kwargs.get(name) is not None and kwargs.get(name) is not False
           for name in _UNSUPPORTED):
        return None
    batch, heads, _, dim = q.shape
    # Query head h is row h % groups of KV head h // groups (repeat_kv's order).
    rows = q.reshape(batch, heads // groups, groups, dim)
    out = F.scaled_dot_product_attention(rows, k, v, attn_mask=mask, scale=scaling)
    return out.reshape(out.shape[0], heads, 1, v.shape[-1]).transpose(1, 2).contiguous()
