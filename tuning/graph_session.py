"""The timing every GEMM session shares: candidates and torch's call replayed from CUDA graphs."""

from __future__ import annotations

from typing import Callable

from cutlass_ops.gemms.choice import Choice


class GraphTimedSession:
    """The timing of a session (``tuning.protocol.Session``) whose candidates and torch's call
    are launchers: ``_launcher(choice)`` and ``_torch_call()``, on ``self.device``. Times are
    replays of each call captured in a CUDA graph: GPU time without the host's launch cost."""

    device = None

    def _launcher(self, choice) -> Callable:
        raise NotImplementedError

    def _torch_call(self) -> Callable:
        raise NotImplementedError

    def time_ms(self, choice: Choice, reps: int) -> float:
        from tuning.timing import do_bench

        return do_bench(self._launcher(choice), warmup=3, reps=reps, graph=True,
                        device=self.device).median_ms

    def torch_ms(self, reps: int) -> float:
        from tuning.timing import do_bench

        return do_bench(self._torch_call(), warmup=3, reps=reps, graph=True,
                        device=self.device).median_ms

    def compare_ms(self, choices: list[Choice], reps: int) -> tuple[dict[Choice, float], float]:
        from tuning.timing import do_bench_interleaved

        fns: dict = {choice: self._launcher(choice) for choice in choices}
        fns["torch"] = self._torch_call()
        timings = do_bench_interleaved(fns, reps=reps, graph=True, device=self.device)
        torch_ms = timings.pop("torch").median_ms
        return {choice: t.median_ms for choice, t in timings.items()}, torch_ms
