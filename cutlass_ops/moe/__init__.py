"""Mixture-of-experts: the grouped GEMM front end, the experts and the router, one room.

- ``grouped``: ``grouped_mm`` with ``torch._grouped_mm``'s semantics (custom op, fake, autograd),
  dispatching to the tuned kernels of ``cutlass_ops.gemms.grouped``;
- ``experts``: ``GroupedExperts``, Hugging Face's experts as grouped gate+up and down GEMMs, a
  SwiGLU kernel and one combine kernel, swapped in after a probe;
- ``moe_router``: a block's top-k router as one routing pass that also sorts tokens by expert.

The kernels are ``custom_kernels/moe/``; the tuner's side is ``tuning/grouped_search.py``.
"""

from cutlass_ops.moe.experts import GroupedExperts, looks_like_experts, probe

__all__ = ["GroupedExperts", "looks_like_experts", "probe"]
