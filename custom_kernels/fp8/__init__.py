"""FP8 kernels, one family: quantization with scales written on the device, the skinny split-K
FP8 GEMM for M <= 128, and the gradient amax slot the fused producers fill.

- ``fp8_quant``: ``quantize`` (tensorwise, rowwise, 1x128 / 128x128 blockwise scales; no host
  sync) and ``fp8_amax``;
- ``fp8_skinny``: the FP8 scaled GEMM for M <= 128, split along K over a cluster;
- ``grad_amax``: ``GradAmax``, where a backward kernel leaves the amax of the gradient it wrote.

Kernels of other families that write FP8 beside their output keep it in their family: the norms'
(``custom_kernels/norms/fp8.py``) and SwiGLU's (``swiglu_fp8``, ``swiglu_with_amax`` in
``custom_kernels/swiglu.py``). The GEMM side of FP8 is ``cutlass_ops/fp8/`` (its README).
"""
