"""The tuner's session of an FP8 scaled GEMM (``cutlass_ops.scaled_mm``): the GEMM family's
search runs it as it runs a bf16 one, with these inputs, reference and baseline.

Inputs are quantized from random float32 data per the problem's recipe (scales that differ row
by row and block by block, so that a kernel reading the wrong scale fails verification). The
reference is the dequantized float32 product (``fp8_operands.reference``); torch's call is
``torch._scaled_mm`` on the same operands and scales. Times are CUDA-graph replays, as for
every GEMM (``graph_session.GraphTimedSession``).
"""

from __future__ import annotations

from typing import Callable

from cutlass_ops.gemms.config import BiasMode, GemmProblem
from cutlass_ops.gemms.fp8.fp8_operands import BLOCK, ScaleRecipe
from custom_kernels.core.tolerances import GEMM, relative_tolerance
from tuning.graph_session import GraphTimedSession


def quantized_inputs(recipe: ScaleRecipe, m: int, n: int, k: int, dtypes, device, seed: int = 0):
    """(a, b, scale_a, scale_b) as ``scaled_mm`` takes them: a (M, K) row-major, b = w.t() of a
    row-major (N, K) w, float32 dequantization scales of the recipe's shapes and layouts. Rows of
    x and w are drawn at magnitudes spread over 2^-4..2^4 so the scales differ."""
    import torch

    g = torch.Generator(device=device).manual_seed(seed)
    fp8_a, fp8_b = dtypes
    x = torch.randn(m, k, device=device, generator=g)
    w = torch.randn(n, k, device=device, generator=g) / k ** 0.5
    x = x * torch.exp2(torch.randint(-4, 5, (m, 1), device=device, generator=g).float())
    w = w * torch.exp2(torch.randint(-4, 5, (n, 1), device=device, generator=g).float())
    if recipe is ScaleRecipe.BLOCKWISE:  # 1x128 groups of x; 128x128 blocks of w
        x_groups = x.view(m, k // BLOCK, BLOCK)
        sa = _scale(x_groups.abs().amax(-1), fp8_a)  # (M, K/128)
        a = _cast(x_groups / sa[..., None], fp8_a).view(m, k)
        w_blocks = w.view(n // BLOCK, BLOCK, k // BLOCK, BLOCK)
        sw = _scale(w_blocks.abs().amax(dim=(1, 3)), fp8_b)  # (N/128, K/128)
        b = _cast(w_blocks / sw[:, None, :, None], fp8_b).view(n, k)
        return a, b.t(), sa.t().contiguous().t(), sw.t()
    if recipe is ScaleRecipe.ROWWISE:
        sa = _scale(x.abs().amax(1, keepdim=True), fp8_a)  # (M, 1)
        sw = _scale(w.abs().amax(1, keepdim=True), fp8_b)  # (N, 1)
        return _cast(x / sa, fp8_a), _cast(w / sw, fp8_b).t(), sa, sw.t()
    sa, sw = _scale(x.abs().amax(), fp8_a), _scale(w.abs().amax(), fp8_b)
    return _cast(x / sa, fp8_a), _cast(w / sw, fp8_b).t(), sa, sw


def _scale(amax, fp8_dtype):
    import torch

    scale = amax.float() / torch.finfo(fp8_dtype).max
    return torch.where(scale > 0, scale, torch.ones_like(scale))


def _cast(x, fp8_dtype):
    import torch

    limit = torch.finfo(fp8_dtype).max
    return x.clamp(-limit, limit).to(fp8_dtype)


class ScaledSession(GraphTimedSession):
    """One scaled problem's session (``tuning.protocol.Session``; timed as every GEMM's)."""

    def __init__(self, problem: GemmProblem, device_index: int):
        import torch

        from cutlass_ops.gemms.fp8 import fp8_operands
        from cutlass_ops.gemms.inputs import torch_dtype

        self.problem = problem
        ops = problem.operands
        self.recipe = ScaleRecipe(ops.scaling.value)
        self.fast_accum = ops.fast_accum
        self.device = torch.device("cuda", device_index)
        out_dtype = torch_dtype(ops.element_d)
        with torch.cuda.device(self.device):
            dtypes = (torch_dtype(ops.element_a), torch_dtype(ops.element_b))
            self.a, self.b, self.scale_a, self.scale_b = quantized_inputs(
                self.recipe, problem.m, problem.n, problem.k, dtypes, self.device)
            self.bias = (torch.randn(problem.n, device=self.device).to(out_dtype)
                         if ops.epilogue.bias is BiasMode.N else None)
            self.checked = fp8_operands.check_scaled(self.a, self.b, self.scale_a, self.scale_b,
                                                     bias=self.bias, out_dtype=out_dtype)
            self.reference = _exact(lambda: fp8_operands.reference(
                self.a, self.b, self.scale_a, self.scale_b, self.bias, torch.float32,
                self.recipe))
            self.out = torch.empty(problem.m, problem.n, dtype=out_dtype, device=self.device)
        self.tolerance = relative_tolerance(ops.element_d, GEMM)
        self._launchers: dict = {}

    def _launcher(self, choice) -> Callable:
        """A CUTLASS ``Choice``'s launch, or the skinny kernel's (``SkinnyConfig``)."""
        launch = self._launchers.get(choice)
        if launch is None:
            from cutlass_ops.fp8 import fp8_plan
            from cutlass_ops.gemms.fp8 import fp8_skinny_route

            if isinstance(choice, fp8_skinny_route.SkinnyConfig):
                launch = fp8_skinny_route.launcher(choice, self.recipe.value, self.a, self.b,
                                                   self.scale_a, self.scale_b, self.bias, self.out)
            else:
                launch = fp8_plan.plan(self.checked, choice.config, self.a, self.b,
                                       self.scale_a, self.scale_b, self.bias,
                                       fast_accum=self.fast_accum, out=self.out)
            self._launchers[choice] = launch
        return launch

    def _launch_failure(self, choice, error: Exception) -> str | None:
        if isinstance(error, RuntimeError):  # a launch the driver refused (cuda.core's CUDAError)
            return f"launch: {type(error).__name__}: {error}"
        return None

    def _torch_call(self) -> Callable:
        from cutlass_ops.fp8.fp8_routes import torch_scaled_mm

        a, b, sa, sb, bias = self.a, self.b, self.scale_a, self.scale_b, self.bias
        out_dtype, fast, recipe = self.out.dtype, self.fast_accum, self.recipe
        return lambda: torch_scaled_mm(a, b, sa, sb, bias, out_dtype, fast, recipe)

    def close(self) -> None:
        self._launchers.clear()
        self.a = self.b = self.out = self.reference = self.bias = None


def _exact(fn):
    """``fn()`` with float32 matmuls in float32, not TF32."""
    import torch

    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        return fn()
    finally:
        torch.backends.cuda.matmul.allow_tf32 = previous
