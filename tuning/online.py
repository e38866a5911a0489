"""The tuner's online hooks for ``cutlass_ops.matmul`` (``CUTLASS_OPS_ONLINE``): dispatch finds
``ONLINE`` through the package's ``cutlass_ops.online_tuner`` entry point, so the dispatch floor
never imports the tuner."""

from __future__ import annotations

from cutlass_ops.gemms.choice import Choice
from cutlass_ops.gemms.config import GemmProblem
from custom_kernels.core.device import DeviceSpec
from tuning import candidates


class QuickTuner:
    def propose(self, problem: GemmProblem, device: DeviceSpec) -> Choice | None:
        best = candidates.select(problem, device, candidates.Strategy.QUICK, use_heuristics=True)
        return best[0] if best else None

    def tune(self, problem: GemmProblem, device_index: int) -> None:
        from tuning.backend import GpuBackend
        from tuning.search import tune

        tune([problem], backend=GpuBackend(device_index), strategy="quick")


ONLINE = QuickTuner()
