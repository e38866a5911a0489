"""Mixture-of-experts kernels: routing, combine and the skew dispatch's choice, one family.

- ``moe_routing``: a router's top-k, weights and the sort of tokens by expert in one pass;
- ``moe_combine``: the experts' outputs weighted and summed back per token, forward and
  backward, in one launch;
- ``routing_split``: on the device, which of two grouped kernels a routing wants (the skew
  dispatch of ``cutlass_ops.gemms.grouped``).

The room above it is ``cutlass_ops/moe/`` (experts, router, grouped GEMM front end).
"""
