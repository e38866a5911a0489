"""The CUTLASS GEMM family, one layer a module, each importing only those listed before it:

config (pure data) -> inputs (tensors to a checked problem: every input check) -> space (valid configs) -> emit and
cutlass_bridge (cutlass_cppgen to C++) -> build (nvcc, artifact cache) -> runtime (load, launch)
-> loader (emit + build + load, memoized) -> plan (one checked launch) -> choice, ranking ->
dispatch (which kernel runs a call: the tuned-results store, then what is built).
The folder is ``gemms`` so that it never shadows the public function ``cutlass_ops.gemm``.
"""
