"""Config search and dispatch for cutlass_ops GEMMs.

candidates (space, ranking, run-time variants) -> search (build, verify, time in rounds) -> cache
(per GPU and software versions) -> dispatch (cutlass_ops.matmul); cli is ``cutlass-tune``.
timing is the one benchmark clock of the project.
"""
