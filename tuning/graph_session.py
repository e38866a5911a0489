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

    def _launch_failure(self, choice, error: Exception) -> str | None:
        """What a launch error other than ours (``CutlassOpsError``) means: a failed candidate,
        as text, or None to raise it (a bug, not a result)."""
        return None

    def verify(self, choice) -> str | None:
        """Launches ``choice`` into ``self.out`` (NaN first, so that a kernel writing nothing
        fails) and checks it against ``self.reference`` within ``self.tolerance``."""
        import torch

        from custom_kernels.core.errors import CutlassOpsError
        from tuning.protocol import check

        try:
            launch = self._launcher(choice)
            self.out.fill_(float("nan"))
            launch()  # a DSL kernel compiles here on its first launch
            torch.cuda.synchronize(self.device)
        except CutlassOpsError as exc:  # a build's failure (NVRTC's for the skinny kernels too)
            return f"launch: {exc}"
        except Exception as exc:  # noqa: BLE001 - the session says which failures are results
            why = self._launch_failure(choice, exc)
            if why is None:
                raise
            return why
        return check([self.out], [self.reference], self.tolerance)

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
