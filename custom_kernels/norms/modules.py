"""``RMSNorm`` and ``LayerNorm`` modules on the fused kernels of ``custom_kernels.norms.norm_ops``.

They subclass ``torch.nn.RMSNorm`` / ``torch.nn.LayerNorm``: same constructor, same parameters,
same ``state_dict`` (a checkpoint of one loads into the other). ``forward(x, residual=None)``
returns ``y``, or ``(y, new_residual)`` when a residual is given (pre-norm: ``h = x + residual``,
``y = norm(h)``).

Fallback to torch (the parent's forward, on ``x + residual`` when a residual is given, logged
once per reason) when the kernels cannot run: CPU (or any non-CUDA) tensors (the CPU rule,
``custom_kernels.core.fallback``), a ``normalized_shape`` of more than one dimension, no affine
weight (``elementwise_affine=False``), a LayerNorm without bias, or input the kernels refuse
(see ``norms.why_unsupported``: dtypes, shapes, strides, hidden size). Tensors on different
devices raise UnsupportedInputError. The inputs are checked once per call, through the
memoized ``norms.refusal``: a warm call pays one dictionary lookup, then the kernel.
"""

from __future__ import annotations

from typing import Optional

import torch

from custom_kernels.core.fallback import log_once
from custom_kernels.norms import norm_ops as norms


class RMSNorm(torch.nn.RMSNorm):
    """``torch.nn.RMSNorm`` with the fused kernel; ``eps=None`` means ``finfo(x.dtype).eps`` as
    in torch. ``out_dtype``: dtype of ``y`` (default: ``x``'s)."""

    def __init__(self, *args, out_dtype: Optional[torch.dtype] = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.out_dtype = out_dtype

    @classmethod
    def from_module(cls, module: torch.nn.RMSNorm) -> "RMSNorm":
        """A drop-in for ``module`` sharing its parameters (optimizer state stays valid)."""
        new = cls(module.normalized_shape, eps=module.eps,
                  elementwise_affine=module.elementwise_affine, device="meta")
        new.weight = module.weight
        new.train(module.training)
        return new

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None):
        weight = self._kernel_weight()
        if weight is not None and (self.out_dtype is None or self.out_dtype == x.dtype):
            eps = self.eps if self.eps is not None else torch.finfo(x.dtype).eps
            done = norms.host_norm("rms", x, weight, None, residual, float(eps))
            if done is not None:  # the compiled host path took it
                return done
        why = _refusal(self, "rms", x, weight, None, residual)
        if why is None:
            eps = self.eps if self.eps is not None else torch.finfo(x.dtype).eps
            return norms._norm("rms", x, weight, None, residual, float(eps),
                               self.out_dtype or x.dtype, None)
        log_once(self._fallback_message, why)
        return self._torch_forward(x, residual, weight)

    _fallback_message = "cutlass_ops.nn.RMSNorm uses torch.nn.RMSNorm"

    def forward_fp8(self, x: torch.Tensor, granularity, residual: Optional[torch.Tensor] = None,
                    *, fp8_dtype: torch.dtype = torch.float8_e4m3fn, write_y: bool = True):
        """``custom_kernels.norms.rms_norm_fp8`` with this module's weight, eps and out_dtype:
        ``(y, q, scale)``, or ``(y, q, scale, new_residual)`` with a residual; ``y`` is
        ``forward``'s. Input the kernel refuses raises (no torch fallback here: the caller
        quantizes ``forward``'s output instead)."""
        from custom_kernels.norms.fp8 import rms_norm_fp8

        eps = self.eps if self.eps is not None else torch.finfo(x.dtype).eps
        return rms_norm_fp8(x, self._kernel_weight(), eps, granularity, residual,
                            fp8_dtype=fp8_dtype, out_dtype=self.out_dtype, write_y=write_y)

    def _kernel_weight(self):
        return self.weight  # a module attribute lookup costs about as much as the check

    def _torch_forward(self, x, residual, weight):
        return _fallback(super().forward, x, residual, self.out_dtype)


class OffsetRMSNorm(RMSNorm):
    """Gemma's RMSNorm: ``x * rstd * (1 + weight)``, the statistics and the product in float32
    and one rounding (what Gemma computes), on the same kernel: the effective weight
    ``1 + weight`` is formed in float32 on each call (one small launch) and the kernel takes a
    float32 weight. The parameter is Gemma's ``weight`` (initialised to zeros), so its
    ``state_dict`` is Gemma's."""

    _fallback_message = "cutlass_ops.nn.OffsetRMSNorm uses torch"

    def _kernel_weight(self):
        return self.weight.float() + 1.0

    def _torch_forward(self, x, residual, weight):
        eps = self.eps if self.eps is not None else torch.finfo(x.dtype).eps
        return norms.rms_norm_reference(x, weight, eps, residual, self.out_dtype or x.dtype)


class LayerNorm(torch.nn.LayerNorm):
    """``torch.nn.LayerNorm`` with the fused kernel. ``out_dtype``: dtype of ``y``."""

    def __init__(self, *args, out_dtype: Optional[torch.dtype] = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.out_dtype = out_dtype

    @classmethod
    def from_module(cls, module: torch.nn.LayerNorm) -> "LayerNorm":
        new = cls(module.normalized_shape, eps=module.eps,
                  elementwise_affine=module.elementwise_affine, bias=module.bias is not None,
                  device="meta")
        new.weight = module.weight
        new.bias = module.bias
        new.train(module.training)
        return new

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None):
        weight, bias = self.weight, self.bias
        if (weight is not None and bias is not None
                and (self.out_dtype is None or self.out_dtype == x.dtype)):
            done = norms.host_norm("ln", x, weight, bias, residual, float(self.eps))
            if done is not None:  # the compiled host path took it
                return done
        why = _refusal(self, "ln", x, weight, bias, residual)
        if why is None:
            return norms._norm("ln", x, weight, bias, residual, float(self.eps),
                               self.out_dtype or x.dtype, None)
        log_once("cutlass_ops.nn.LayerNorm uses torch.nn.LayerNorm", why)
        return _fallback(super().forward, x, residual, self.out_dtype)


def _refusal(module, kind, x, weight, bias, residual) -> Optional[str]:
    """Why the module's kernel cannot run this call, or None (then nothing is checked again)."""
    if weight is None or len(module.normalized_shape) != 1:
        return "a normalized_shape of more than one dimension, or no affine weight"
    if kind == "ln" and bias is None:
        return "a LayerNorm without bias"
    return norms.refusal(kind, x, weight, bias, residual, module.out_dtype)


def _fallback(forward, x, residual, out_dtype):
    h = x if residual is None else x + residual
    y = forward(h)
    if out_dtype is not None:
        y = y.to(out_dtype)
    return y if residual is None else (y, h)
