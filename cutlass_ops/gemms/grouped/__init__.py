"""The grouped GEMM chain of the CUTLASS family (mixture-of-experts GEMMs), one layer a module:
``skew_dispatch`` (a routing's skew, read on the device) and ``dsl_grouped`` (QuACK's
variable-length kernels) -> ``grouped_build`` (our sm90 ptr-array kernel: emission and build) ->
``grouped_runtime`` (the launch) and ``grouped_entries`` (a tuned grouped entry, typed).

The public front end, ``cutlass_ops.grouped_mm``, is ``cutlass_ops/moe/grouped.py``.
"""
