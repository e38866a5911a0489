"""Tensor parallelism for converted models, one room:

- ``tensor_parallel``: ``parallelize(model, mesh)`` shards the fused blocks (each rank's q, k,
  v packed: one GEMM; two all-reduces a layer each way) and the LM head by vocabulary rows;
  ``llama_plan`` is torch's Llama plan in one place;
- ``sharded_gemms``: the fused blocks' GEMMs on each rank's shards (a
  ``cutlass_ops.block_gemms.BlockGemms``) and ``adopt``, which takes over a plan's DTensor
  shards when ``convert`` fuses a layer a plan sharded first;
- ``vocab_parallel_loss``: the chunked head and loss on each rank's vocabulary slice.

Beside it: the DTensor sharding rules of the GEMM ops (``cutlass_ops.gemm_sharding_rules``,
registered where those ops are defined) and of the custom kernels, and the distributed
``clip_grad_norm_`` (``custom_kernels/parallel/``).
"""
