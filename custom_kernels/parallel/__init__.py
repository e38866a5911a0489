"""Tensor and data parallelism for the custom kernels: the DTensor sharding rules of their ops
(norms, rotary, SwiGLU; the GEMM family's own register through them), the distributed
``clip_grad_norm_`` (FSDP2's sharded gradients, one all-reduce) and the two per-chunk passes of
the vocabulary-parallel cross-entropy (``shard_cross_entropy``: a slice's statistics, then its
gradient given the global log-sum-exp).

The tensor-parallel plan, the sharded GEMMs and the vocabulary-parallel loss are in
``cutlass_ops`` (``tensor_parallel``, ``sharded_gemms``, ``vocab_parallel_loss``).
"""
