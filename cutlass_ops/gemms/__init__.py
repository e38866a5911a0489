"""The CUTLASS GEMM family, one layer a module, each importing only those listed before it:

config (pure data) -> inputs (tensors to a checked problem: every input check) -> space (valid configs) -> emit and
cutlass_bridge (cutlass_cppgen to C++) -> build (nvcc, artifact cache) -> runtime (load, launch)
-> loader (emit + build + load, memoized) -> plan (one checked launch) -> choice, ranking,
gemm_entries (the tuned-results store's GEMM records, parsed and checked) -> dispatch (which
kernel runs a call: the tuned records, then what is built). The grouped (MoE) kernels beside
them: grouped_build -> grouped_runtime and grouped_entries (their records and lookup). The FP8
rules the chain reads, in fp8/ (scaled operands, the few-rows kernel's route, the blockwise
emission), stand on inputs and under cutlass_bridge; the scaled chain's plan and routes, which
stand on dispatch and loader, are in cutlass_ops/fp8/.
The folder is ``gemms`` so that it never shadows the public function ``cutlass_ops.gemm``.
"""
