"""The fused epilogue's meaning, in torch: ``activation(alpha * acc + bias) + beta * c``.

One definition serves the paths that do not run a fused kernel (an empty K, dispatch's fallback
to an unfused GEMM, autograd's recomputation) and the references of tests and the tuner.
"""

from __future__ import annotations

from cutlass_ops.gemms.config import Activation


def activate(x, activation: Activation | str):
    import torch.nn.functional as F

    activation = Activation(activation)
    if activation is Activation.IDENTITY:
        return x
    if activation is Activation.RELU:
        return F.relu(x)
    if activation is Activation.GELU:
        return F.gelu(x)
    if activation is Activation.GELU_TANH:
        return F.gelu(x, approximate="tanh")
    return F.silu(x)


def apply(acc, *, alpha: float = 1.0, bias=None, activation: Activation | str = "identity",
          c=None, beta: float = 1.0):
    """The epilogue on an accumulator ``acc`` (any dtype; computed in acc's dtype)."""
    x = acc if alpha == 1.0 else acc * alpha
    if bias is not None:
        x = x + bias.to(x.dtype)
    x = activate(x, activation)
    if c is not None and beta != 0:
        x = x + (c.to(x.dtype) if beta == 1.0 else beta * c.to(x.dtype))
    return x
