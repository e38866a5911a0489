"""The FP8 rules of the CUTLASS GEMM chain that the chain's own modules read, one room: scaled
operands, the few-rows kernel's route, the blockwise kernels' emission.

- ``fp8_operands``: a ``scaled_mm`` call's tensors to a checked problem (K-major FP8 operands,
  float32 scales, the recipe read from their shapes) and the dequantized float32 reference;
- ``fp8_skinny_route``: the few-rows FP8 kernel (``custom_kernels.fp8.fp8_skinny``) as a candidate
  and a tuned winner of the chain (read by ``gemm_entries``, ``dispatch`` and the tuner's search);
- ``blockwise_emit``: the C++ of the blockwise-scaled sm90a kernels (``cutlass_bridge`` runs it).

They stand on ``inputs`` and ``config`` and under ``cutlass_bridge``, ``gemm_entries`` and
``dispatch``. The top of the scaled chain imports ``dispatch`` and ``loader``, so it lives a layer
up, in ``cutlass_ops/fp8/``: ``fp8_plan`` (one checked launch), ``fp8_routes`` (which kernel runs
a call) and ``scaled_mm_op`` (the op). cutlass_ops/fp8/README.md says where each FP8 piece lives.
"""
