"""Hugging Face's SDPA attention (``sdpa_attention_forward``) for the fused decoder blocks, with
two things torch's own path loses on the GPU:

- Under ``torch.compile``, Hugging Face cannot tell that a batch has no padding (that is data),
  so it materializes the causal mask, and SDPA runs the masked kernels: on an H100 at 2 x 2048
  tokens, 32 / 8 heads, cuDNN's backward took 1.37 ms a layer against 0.55 ms with
  ``is_causal`` (docs/measurements.md). Here a boolean mask that is exactly the causal one is
  recognised at run time (one comparison, once per mask tensor) and dropped for ``is_causal``.
- The gradient arriving at SDPA's output is a transposed view (Hugging Face transposes the output
  to [B, S, H, D] and makes it contiguous); cuDNN's backward is faster on a gradient laid out
  like its output (0.65 against 1.02 ms in that setting), so the backward hands it one.

Semantics are ``sdpa_attention_forward``'s: grouped heads through ``enable_gqa`` without a mask
and repeated keys and values with one, ``is_causal`` for more than one query without a mask,
keys cut to the queries' length when causal with a longer cache. Dropout, ``position_bias`` and
``output_attentions`` are not taken (``supports`` says so; the caller then uses Hugging Face's
function). Returns the output as [B, S, H, D] contiguous, as Hugging Face's function does.

Eagerly, an autograd.Function keeps SDPA's own graph (no recomputation); under torch.compile a
custom op pair does, and its backward recomputes the forward (cheap next to the backward).
"""

from __future__ import annotations

import weakref
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

_causal_masks: dict[int, tuple] = {}


def supports(module, query: Tensor, dropout: float, kwargs: dict) -> bool:
    """Whether ``attention`` computes what Hugging Face's SDPA function would for this call."""
    return (module.config._attn_implementation == "sdpa" and dropout == 0.0
            and kwargs.get("position_bias") is None
            and not kwargs.get("output_attentions", False))


def _is_causal_mask(mask: Tensor, q_length: int, kv_length: int) -> bool:
    """A boolean [B or 1, 1, S, S] mask allowing exactly the causal positions. Read once per
    mask tensor (the same mask serves every layer of a forward); a host sync when read."""
    if mask.dtype != torch.bool or mask.dim() != 4 or mask.shape[1] != 1 or \
            q_length != kv_length or tuple(mask.shape[-2:]) != (q_length, kv_length):
        return False
    if mask.is_cuda and torch.cuda.is_current_stream_capturing():
        return False  # no host sync inside a CUDA graph: the mask is kept
    cached = _causal_masks.get(id(mask))
    if cached is not None and cached[0]() is mask:
        return cached[1]
    causal = torch.ones(q_length, kv_length, dtype=torch.bool, device=mask.device).tril_()
    found = bool(torch.equal(mask, causal.expand_as(mask)))
    for key in [k for k, (ref, _) in _causal_masks.items() if ref() is None]:
        del _causal_masks[key]
    _causal_masks[id(mask)] = (weakref.ref(mask), found)
    return found


def _sdpa(q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor], scale: float,
          causal: bool) -> Tensor:
    """SDPA as Hugging Face calls it; [B, H, S, D]."""
    groups = q.shape[1] // k.shape[1]
    q_length, kv_length = q.shape[2], k.shape[2]
    if mask is not None and causal and _is_causal_mask(mask, q_length, kv_length):
        mask = None
    if mask is None:
        is_causal = causal and q_length > 1
        if is_causal and kv_length > q_length:
            k, v = k[:, :, :q_length], v[:, :, :q_length]
        return F.scaled_dot_product_attention(q, k, v, scale=scale, is_causal=is_causal,
                                              enable_gqa=groups > 1)
    if groups > 1:
        k, v = (t.repeat_interleave(groups, dim=1) for t in (k, v))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


def _grads(q, k, v, mask, scale, causal, grad_bshd):
    """(dq, dk, dv) by recomputing the forward, the gradient laid out as SDPA's output. Inside
    a custom op the autograd dispatch keys are excluded (torch.autograd would record nothing)
    and torch.func.vjp would decompose SDPA into its math form: the keys come back for this
    recomputation only."""
    include = torch._C._dispatch_tls_local_include_set()
    exclude = torch._C._dispatch_tls_local_exclude_set()
    for key in (torch._C.DispatchKey.AutogradFunctionality, torch._C.DispatchKey.ADInplaceOrView):
        exclude = exclude.remove(key)
    with torch._C._ForceDispatchKeyGuard(include, exclude), torch.enable_grad():
        inputs = [t.detach().requires_grad_() for t in (q, k, v)]
        out = _sdpa(*inputs, mask, scale, causal)
        return torch.autograd.grad(out, inputs, grad_bshd.transpose(1, 2).contiguous())


# ---- custom ops (torch.compile) ----------------------------------------------------------------

@torch.library.custom_op("cutlass_ops::sdpa", mutates_args=())
def sdpa_op(q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor], scale: float,
            causal: bool) -> Tensor:
    """Hugging Face's SDPA attention; [B, S, H, D] contiguous."""
    with torch.no_grad():
        return _sdpa(q, k, v, mask, scale, causal).transpose(1, 2).contiguous()


@sdpa_op.register_fake
def _(q, k, v, mask, scale, causal):
    b, h, s, _ = q.shape
    return q.new_empty((b, s, h, v.shape[-1]))


@torch.library.custom_op("cutlass_ops::sdpa_backward", mutates_args=())
def sdpa_backward_op(grad: Tensor, q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor],
                     scale: float, causal: bool) -> tuple[Tensor, Tensor, Tensor]:
    return tuple(g.contiguous() for g in _grads(q, k, v, mask, scale, causal, grad))


@sdpa_backward_op.register_fake
def _(grad, q, k, v, mask, scale, causal):
    return (q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape))


def _setup(ctx, inputs, output):
    q, k, v, mask, scale, causal = inputs
    ctx.save_for_backward(q, k, v, mask)
    ctx.scale, ctx.causal = scale, causal


def _backward(ctx, grad):
    q, k, v, mask = ctx.saved_tensors
    dq, dk, dv = sdpa_backward_op(grad, q, k, v, mask, ctx.scale, ctx.causal)
    return dq, dk, dv, None, None, None


sdpa_op.register_autograd(_backward, setup_context=_setup)


# ---- eager ------------------------------------------------------------------------------------

class _EagerSdpa(torch.autograd.Function):
    """Keeps SDPA's own graph from the forward, so the backward only re-lays the gradient."""

    @staticmethod
    def forward(ctx, q, k, v, mask, scale, causal):
        with torch.enable_grad():
            inputs = [t.detach().requires_grad_(t.requires_grad) for t in (q, k, v)]
            out = _sdpa(*inputs, mask, scale, causal)
        ctx.graph = (inputs, out)
        return out.detach().transpose(1, 2).contiguous()

    @staticmethod
    def backward(ctx, grad):
        inputs, out = ctx.graph
        ctx.graph = None
        wanted = [t for t in inputs if t.requires_grad]
        found = iter(torch.autograd.grad(out, wanted, grad.transpose(1, 2).contiguous()))
        return (*(next(found) if t.requires_grad else None for t in inputs), None, None, None)


def attention(q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor], scale: float,
              causal: bool = True) -> Tensor:
    """``sdpa_attention_forward(module, q, k, v, mask, scaling=scale)[0]`` for a module whose
    ``is_causal`` is ``causal``: q [B, H, S, D], k and v [B, Hkv, S_kv, D]; [B, S, H, D] out."""
    if torch.compiler.is_compiling():
        return sdpa_op(q, k, v, mask, float(scale), bool(causal))
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        return _EagerSdpa.apply(q, k, v, mask, float(scale), bool(causal))
    return _sdpa(q, k, v, mask, scale, causal).transpose(1, 2).contiguous()


__all__ = ["attention", "supports"]
