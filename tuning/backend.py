"""Where a tune's candidates are built and measured: the GPU backend.

The GEMM search (``tuning.search``) only talks to this interface, so its logic (ranking,
budgets, verification, failure records, the cache) is tested on a CPU with a fake backend, and
the GPU backend stays a thin layer over ``cutlass_ops`` and ``tuning.timing``. Its sessions are
the tuner protocol's (``tuning.protocol.Session``).
"""

from __future__ import annotations

import math
from typing import Callable, Iterable, Protocol

from cutlass_ops.gemms import epilogues
from cutlass_ops.gemms.config import (Activation, BiasMode, DType, GemmConfig, GemmOperands,
                                      GemmProblem, Layout, Scaling)
from custom_kernels.core.tolerances import GEMM, relative_tolerance
from custom_kernels.core.tuned_store import CacheScope
from cutlass_ops.gemms.choice import Choice
from custom_kernels.core.device import DeviceSpec
from tuning.graph_session import GraphTimedSession
from tuning.protocol import Session


class Backend(Protocol):
    def device(self) -> DeviceSpec: ...

    def scope(self) -> CacheScope: ...

    def build(self, items: Iterable[tuple[GemmOperands, GemmConfig]], *,
              on_done: Callable | None = None) -> dict: ...

    def session(self, problem: GemmProblem) -> Session: ...


class GpuBackend:
    """Builds through the artifact cache and measures on a CUDA device (the current one)."""

    def __init__(self, device_index: int | None = None, jobs: int | None = None):
        import torch

        if not torch.cuda.is_available():
            from custom_kernels.core.errors import UnsupportedInputError

            raise UnsupportedInputError("tuning needs a CUDA GPU, and torch sees none (for what "
                                        "would be built, use `cutlass-tune compile --dry-run`)")
        self.index = torch.cuda.current_device() if device_index is None else device_index
        self.jobs = jobs

    def device(self) -> DeviceSpec:
        from custom_kernels.core.device import current_spec

        return current_spec(self.index)

    def scope(self) -> CacheScope:
        from custom_kernels.core.device import current_scope

        return current_scope(self.index)

    def build(self, items, *, on_done=None) -> dict:
        from cutlass_ops.gemms.loader import prepare_many

        return prepare_many(items, jobs=self.jobs, on_done=on_done)

    def session(self, problem: GemmProblem):
        if problem.operands.scaling is not Scaling.NONE:  # cutlass_ops.scaled_mm's problems
            from tuning.fp8_session import ScaledSession

            return ScaledSession(problem, self.index)
        return GpuSession(problem, self.index)


def _random_matrix(rows: int, cols: int, batch: int, layout: Layout, dtype, device):
    """Random data (never zeros), scaled so that sums over K stay near 1, in the given layout."""
    import torch

    shape = (batch, rows, cols) if layout is Layout.ROW else (batch, cols, rows)
    t = torch.randn(shape, device=device, dtype=torch.float32).to(dtype)
    t = t if layout is Layout.ROW else t.transpose(-1, -2)
    return t if batch > 1 else t[0]


class GpuSession(GraphTimedSession):
    """One GEMM problem's session (``tuning.protocol.Session``): random inputs, a fused
    epilogue's operands, the float32 reference and torch's same call. Times are replays of each
    call captured in a CUDA graph: GPU time without the host's launch cost."""

    def __init__(self, problem: GemmProblem, device_index: int):
        import torch

        from cutlass_ops.gemms.inputs import torch_dtype

        self.problem = problem
        ops = problem.operands
        device = torch.device("cuda", device_index)
        self.device = device
        with torch.cuda.device(device):
            m, n, k, batch = problem.m, problem.n, problem.k, problem.batch
            self.a = _random_matrix(m, k, batch, ops.layout_a, torch_dtype(ops.element_a), device)
            self.b = _random_matrix(k, n, batch, ops.layout_b, torch_dtype(ops.element_b), device)
            self.a.div_(math.sqrt(k))
            self.out = _random_matrix(m, n, batch, ops.layout_c, torch_dtype(ops.element_d),
                                      device)
            # A fused epilogue's operands: a bias along its extent, a residual in C's layout,
            # and alpha / beta that are not 1, so that a launcher mixing them up fails.
            epilogue = ops.epilogue
            out_dtype = torch_dtype(ops.element_d)
            self.activation = epilogue.activation
            self.alpha = 1.0 if epilogue.is_default else 0.75
            self.beta = 0.5 if epilogue.residual else 0.0
            self.bias = self.c = None
            if epilogue.bias is BiasMode.N:
                self.bias = torch.randn(n, device=device).to(out_dtype)
            elif epilogue.bias is BiasMode.M:
                self.bias = torch.randn(m, 1, device=device).to(out_dtype)
            if epilogue.residual:
                self.c = _random_matrix(m, n, batch, ops.layout_c, out_dtype, device)
            with _exact_float32():
                product = torch.matmul(self.a.float(), self.b.float())
            self.reference = epilogues.apply(
                product, alpha=self.alpha, bias=self.bias, activation=self.activation,
                c=self.c, beta=self.beta)
        # f32 operands run as TF32, whose input rounding dominates; else the output's rounding.
        self.tolerance = relative_tolerance(
            ops.element_a if ops.element_a is DType.F32 else ops.element_d, GEMM)
        self._launchers: dict[Choice, Callable] = {}

    def _launcher(self, choice) -> Callable:
        launch = self._launchers.get(choice)
        if launch is None:
            if choice.backend == "dsl":  # epilogues dsl.refusal allows (the search checks)
                from cutlass_ops.gemms import dsl

                launch = dsl.plan(choice, self.a, self.b, self.out, bias=self.bias, c=self.c,
                                  alpha=self.alpha, beta=self.beta)
            else:
                from cutlass_ops.gemms.choice import plan_choice

                launch = plan_choice(choice, self.a, self.b, self.c, alpha=self.alpha,
                                     beta=self.beta, bias=self.bias,
                                     activation=self.activation, out=self.out)
            self._launchers[choice] = launch
        return launch

    def _launch_failure(self, choice, error: Exception) -> str | None:
        if choice.backend != "dsl":  # the DSL's compiler and QuACK's asserts are results
            return None
        return f"launch: {type(error).__name__}: {error}"[:400]

    def _torch_call(self) -> Callable:
        import torch

        a, b = self.a, self.b  # the call a user makes, output allocation included
        if self.bias is None and self.c is None and self.activation is Activation.IDENTITY:
            return lambda: torch.matmul(a, b)
        bias, c, alpha, beta, activation = self.bias, self.c, self.alpha, self.beta, \
            self.activation

        def unfused():  # what a model does without fusion (cuBLAS fuses a 2-D bias in addmm)
            if bias is not None and bias.dim() == 1 and a.dim() == 2:
                y = torch.addmm(bias, a, b, alpha=alpha)
            else:
                y = epilogues.apply(torch.matmul(a, b), alpha=alpha, bias=bias)
            y = epilogues.activate(y, activation)
            return y if c is None else y.add_(c, alpha=beta)

        return unfused

    def whole_call_ms(self, choice, reps: int) -> tuple[float, float] | None:
        """``choice``'s and torch.matmul's calls made eagerly on the session's operands, as
        dispatch runs them warm (host included: argument handling, output allocation, launch),
        timed interleaved with no L2 flush (a flush would hide the host behind it): (ms, torch's
        ms). A CUTLASS winner is timed through the compiled host path where it is available, as
        its later eager calls would run (the build is waited for: about 20 s, once per torch);
        the record made for the timing is forgotten after it, since it is not dispatch's
        decision. torch.matmul is timed as dispatch's torch route runs it eagerly: after the
        compiled path's miss (a lookup of a signature with no record); the Python route's own
        lookup, which that route pays too, is left out. None for a fused epilogue or a winner
        dispatch does not run through a route."""
        from cutlass_ops.gemms import dispatch
        from custom_kernels import host_ops
        from tuning.timing import do_bench_interleaved

        if not self.problem.operands.epilogue.is_default or \
                getattr(choice, "backend", None) not in ("cutlass", "dsl"):
            return None
        a, b = self.a, self.b
        host_ops.ops(wait=True)
        route = dispatch.pinned_route(a, b, choice, host_record=True)
        route.run(a, b)  # prepares the launch (and records it for the compiled host path)
        try:
            if dispatch.host_gemm(a, b) is not None:
                def ours():
                    return dispatch.host_gemm(a, b)
            else:
                def ours():
                    return route.run(a, b)
            theirs = dispatch.torch_route().run
            unrecorded = (b.t(), a.t())  # another signature: the op's lookup misses

            def torch_call():
                dispatch.host_gemm(*unrecorded)
                return theirs(a, b)
            times = do_bench_interleaved({"ours": ours, "torch": torch_call}, warmup=5,
                                         reps=reps, flush_l2=False, device=self.device)
        finally:
            host_ops.clear_records()
        return times["ours"].median_ms, times["torch"].median_ms

    def close(self) -> None:
        self._launchers.clear()
        self.a = self.b = self.out = self.reference = self.bias = self.c = None


class _exact_float32:
    """A float32 reference computed in float32, not tf32."""

    def __enter__(self):
        import torch

        self.previous = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = False

    def __exit__(self, *exc):
        import torch

        torch.backends.cuda.matmul.allow_tf32 = self.previous
