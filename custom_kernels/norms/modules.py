"""``RMSNorm`` and ``LayerNorm`` modules on the fused kernels of ``custom_kernels.norms.ops``.

They subclass ``torch.nn.RMSNorm`` / ``torch.nn.LayerNorm``: same constructor, same parameters,
same ``state_dict`` (a checkpoint of one loads into the other). ``forward(x, residual=None)``
returns ``y``, or ``(y, new_residual)`` when a residual is given (pre-norm: ``h = x + residual``,
``y = norm(h)``).

Fallback to torch (the parent's forward, on ``x + residual`` when a residual is given) when the
kernels cannot run: CPU (or any non-CUDA) tensors, a ``normalized_shape`` of more than one
dimension, no affine weight (``elementwise_affine=False``), a LayerNorm without bias, or input
the kernels refuse (see ``norms.why_unsupported``: dtypes, shapes, strides, hidden size).
"""

from __future__ import annotations

from typing import Optional

import torch

from custom_kernels.norms import ops as norms


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
        if self._kernel_ok(x, residual):
            eps = self.eps if self.eps is not None else torch.finfo(x.dtype).eps
            return norms.rms_norm(x, self.weight, eps, residual=residual,
                                  out_dtype=self.out_dtype)
        return _fallback(super().forward, x, residual, self.out_dtype)

    def _kernel_ok(self, x, residual) -> bool:
        return (len(self.normalized_shape) == 1 and self.weight is not None
                and norms.why_unsupported("rms", x, self.weight, None, residual,
                                          self.out_dtype) is None)


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
        if self._kernel_ok(x, residual):
            return norms.layer_norm(x, self.weight, self.bias, self.eps, residual=residual,
                                    out_dtype=self.out_dtype)
        return _fallback(super().forward, x, residual, self.out_dtype)

    def _kernel_ok(self, x, residual) -> bool:
        return (len(self.normalized_shape) == 1 and self.weight is not None
                and self.bias is not None
                and norms.why_unsupported("ln", x, self.weight, self.bias, residual,
                                          self.out_dtype) is None)


def _fallback(forward, x, residual, out_dtype):
    h = x if residual is None else x + residual
    y = forward(h)
    if out_dtype is not None:
        y = y.to(out_dtype)
    return y if residual is None else (y, h)
