"""Dispatch of ``cutlass_ops.scaled_mm``: a tuned CUTLASS FP8 kernel, or ``torch._scaled_mm``.

The decision is ``dispatch.decide``'s, on the scaled problem (``fp8_plan.problem_of``: the
recipe and fast accumulation are part of its operands, so FP8 winners never mix with bf16 ones):
an exact tuned shape or the nearest tuned shape of the same operands on this GPU, whose winner
is a CUTLASS kernel or, for few rows, the skinny kernel (``fp8_skinny_route``); else
``torch._scaled_mm``, with one log line saying why (nothing tuned, a scale layout our kernels do
not read, an unsafe cache). Unlike bf16, an untuned FP8 shape does not run the built kernel our
performance model ranks first (``UNTUNED_BUILT_KERNELS``). Never a compile on a call.

The route is memoized per call signature (devices, dtypes, shapes, strides, alignment, the
recipe, bias and fast accumulation), so a warm call costs a dictionary lookup, an output
allocation, a copy of the checked launch arguments with this call's pointers, and the launch.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any, Callable

import torch

from cutlass_ops.fp8 import fp8_plan
from cutlass_ops.gemms import dispatch
from cutlass_ops.gemms.fp8 import fp8_skinny_route
from cutlass_ops.gemms.fp8.fp8_operands import CheckedScaled, ScaleRecipe
from custom_kernels.core import fallback

ENTRY = "cutlass_ops.scaled_mm"
_routes: dict[tuple, ScaledRoute] = {}
_lock = threading.Lock()


@dataclasses.dataclass(frozen=True)
class ScaledRoute:
    decision: dispatch.Decision
    run: Callable[..., Any]  # run(a, b, scale_a, scale_b, bias) -> out

    @property
    def kind(self) -> str:
        """"torch", "cutlass" or "skinny" (``fp8_skinny_route``)."""
        if self.decision.choice is None:
            return "torch"
        return getattr(self.decision.choice, "backend", "cutlass")


def _forget_routes() -> None:
    with _lock:
        _routes.clear()


dispatch.RESET_HOOKS.append(_forget_routes)


def reset() -> None:
    """Forgets memoized routes and tuned entries (``dispatch.reset``: after a tune, an import)."""
    dispatch.reset()


# Whether an untuned FP8 shape may run the built kernel our performance model ranks first (as
# bf16 does) rather than torch._scaled_mm. Off: the model ranks tiles on bf16 evidence, and the
# built FP8 kernels include the promoted-accumulation seeds, well below cuBLAS untuned: an
# FP8 train step on a GPU without its own tuning ran far slower than bf16 that way
# (docs/measurements.md, "FP8 GEMMs"). A tuned entry decides instead.
UNTUNED_BUILT_KERNELS = False

# cuBLAS's blockwise GEMM (torch 2.11's torch._scaled_mm, H200) returns wrong values, silently,
# unless K is a multiple of 512 (four 128-deep scale blocks): relative errors of 0.3 to 1e4 at
# K = 256, 384, 640 for every M and N tried, 0.0017 at K = 512 and 1024 (docs/measurements.md).
TORCH_BLOCKWISE_K = 512


def torch_scaled_mm(a, b, scale_a, scale_b, bias, out_dtype, use_fast_accum: bool,
                    recipe: ScaleRecipe):
    """``torch._scaled_mm``. torch fuses a bias only into a tensorwise or rowwise bf16 output;
    elsewhere it refuses one, so the bias is added after (float32 outputs round once either
    way). A blockwise call whose K cuBLAS gets wrong runs on copies padded along K with zeros
    (``padded_k``)."""
    if recipe is ScaleRecipe.BLOCKWISE and a.shape[1] % TORCH_BLOCKWISE_K:
        a, b, scale_a, scale_b = padded_k(a, b, scale_a, scale_b, TORCH_BLOCKWISE_K)
    fused = bias is not None and out_dtype == torch.bfloat16 and recipe is not ScaleRecipe.BLOCKWISE
    out = torch._scaled_mm(a, b, scale_a, scale_b, bias=bias if fused else None,
                           out_dtype=out_dtype, use_fast_accum=use_fast_accum)
    return out if bias is None or fused else out.add_(bias)


def padded_k(a, b, scale_a, scale_b, multiple: int):
    """Blockwise operands (a (M, K), b (K, N) column-major, scale_a (M, K/128) column-major,
    scale_b the (K/128, N/128) view of an (N/128, K/128) tensor) padded along K to a multiple
    of ``multiple`` in the same layouts: zeros in a and b (they add nothing to the product),
    ones in the scales. The product is unchanged."""
    m, k = a.shape
    n = b.shape[1]
    padded = -(-k // multiple) * multiple
    blocks, padded_blocks = k // 128, padded // 128
    a2 = torch.zeros((m, padded), dtype=a.dtype, device=a.device)
    a2[:, :k].copy_(a)
    b2_rows = torch.zeros((n, padded), dtype=b.dtype, device=b.device)
    b2_rows[:, :k].copy_(b.t())
    sa2 = torch.ones((padded_blocks, m), dtype=scale_a.dtype, device=scale_a.device)
    sa2[:blocks].copy_(scale_a.t())
    sb2 = torch.ones((scale_b.shape[1], padded_blocks), dtype=scale_b.dtype,
                     device=scale_b.device)
    sb2[:, :blocks].copy_(scale_b.t())
    return a2, b2_rows.t(), sa2.t(), sb2.t()


def _torch_route(decision: dispatch.Decision, checked: CheckedScaled, fast_accum: bool) -> ScaledRoute:
    fallback.log_once(f"{ENTRY} uses torch._scaled_mm", decision.reason)
    out_dtype, recipe = checked.out_dtype, checked.recipe

    def run(a, b, scale_a, scale_b, bias):
        return torch_scaled_mm(a, b, scale_a, scale_b, bias, out_dtype, fast_accum, recipe)

    return ScaledRoute(decision, run)


def _blockwise_copy_reason(checked: CheckedScaled, scale_a, scale_b) -> str | None:
    """Why a blockwise call is run on copies of its inputs (else None): M not a multiple of 4,
    which neither our kernels (scale_a's TMA load) nor torch._scaled_mm (cuBLAS: not supported)
    take, or scales with padded leading strides, which our kernels do not read."""
    if checked.recipe is not ScaleRecipe.BLOCKWISE or scale_a.device.type != "cuda":
        return None
    if checked.m % 4:
        return (f"M={checked.m} is not a multiple of 4: a and scale_a are copied with "
                f"{-checked.m % 4} more rows")
    return fp8_plan.layout_refusal(checked, scale_a, scale_b)


def _copying_route(checked: CheckedScaled, fast_accum: bool, reason: str) -> ScaledRoute:
    """A blockwise call on copies (``_blockwise_copy_reason``): rows padded to a multiple of 4
    (zeros in a, ones in scale_a), both scales compact; the copy is dispatched as any other call
    and its first M rows returned."""
    from cutlass_ops.gemms.fp8 import fp8_operands

    pad = -checked.m % 4
    fallback.log_once(f"{ENTRY} copies blockwise inputs", reason)

    def run(a, b, scale_a, scale_b, bias):
        if pad:
            a = torch.cat([a, a.new_zeros(pad, a.shape[1])])
        # scale_a (M, K/128) column-major: pad the rows of its (K/128, M) transpose.
        columns = scale_a.t()
        scale_a = torch.cat([columns, columns.new_ones(columns.shape[0], pad)], 1).t()
        scale_b = scale_b.t().contiguous().t()
        copied = known_route(a, b, scale_a, scale_b, bias, checked.out_dtype, fast_accum)
        if copied is None:  # the copies' first call: checked once, as any call
            again = fp8_operands.check_scaled(a, b, scale_a, scale_b, bias=bias,
                                              out_dtype=checked.out_dtype)
            copied = route(a, b, scale_a, scale_b, bias, again, fast_accum)
        out = copied.run(a, b, scale_a, scale_b, bias)
        return out[:checked.m] if pad else out

    return ScaledRoute(dispatch.Decision("copy", None, reason), run)


def _skinny_without_copies(checked: CheckedScaled, fast_accum: bool, scale_a,
                           scale_b) -> ScaledRoute | None:
    """The skinny kernel on a blockwise call's own tensors where its copies (rows padded to a
    multiple of 4: a decode step's M) would be routed to it: it takes any M and reads the scales
    through their strides, so the copies would buy nothing. None otherwise."""
    if any(t.shape[0] > 1 and t.stride(0) != 1 for t in (scale_a, scale_b)):
        return None  # not the column-major views it reads
    padded = dataclasses.replace(checked, m=checked.m + -checked.m % 4)
    decision = decide(padded, fast_accum, scale_a, scale_b, scales_read=False)
    if not isinstance(decision.choice, fp8_skinny_route.SkinnyConfig):
        return None
    return _skinny_route(decision, checked)


def _cutlass_route(decision: dispatch.Decision, checked: CheckedScaled, fast_accum: bool,
                   key) -> ScaledRoute:
    """The chosen kernel; its first call plans it on that call's tensors (load, can_implement,
    workspace size), every call then launches a copy of those arguments with its own pointers."""
    from custom_kernels.core.errors import CutlassOpsError

    config = decision.choice.config
    template: list = []
    blockwise = checked.recipe is ScaleRecipe.BLOCKWISE

    def run(a, b, scale_a, scale_b, bias):
        if not template:
            try:
                launch = fp8_plan.plan(checked, config, a, b, scale_a, scale_b, bias,
                                       fast_accum=fast_accum)
            except CutlassOpsError as exc:  # a rule or cache state the decision did not see
                route = _torch_route(dispatch.Decision("torch", None, str(exc)), checked,
                                     fast_accum)
                with _lock:
                    _routes[key] = route
                return route.run(a, b, scale_a, scale_b, bias)
            template.append(launch)
            return launch()
        first = template[0]
        out = torch.empty((checked.m, checked.n), dtype=checked.out_dtype, device=a.device)
        args = type(first.args).from_buffer_copy(first.args)
        args.a, args.b, args.c, args.d = a.data_ptr(), b.data_ptr(), out.data_ptr(), \
            out.data_ptr()
        args.scale_a, args.scale_b = scale_a.data_ptr(), scale_b.data_ptr()
        if bias is not None and not blockwise:
            args.bias = bias.data_ptr()
        nbytes = first.workspace_bytes
        workspace = torch.empty(nbytes, dtype=torch.uint8, device=a.device) if nbytes else None
        first.kernel.run_checked(args, workspace.data_ptr() if nbytes else 0, nbytes,
                                 dispatch._current_stream(a.device.index))
        return out.add_(bias) if bias is not None and blockwise else out

    return ScaledRoute(decision, run)


def _skinny_route(decision: dispatch.Decision, checked: CheckedScaled) -> ScaledRoute:
    """The few-rows FP8 kernel (``fp8_skinny_route``): one launch into a new output, the bias
    fused for every recipe."""
    config, recipe, out_dtype = decision.choice, checked.recipe.value, checked.out_dtype

    def run(a, b, scale_a, scale_b, bias):
        return fp8_skinny_route.run(config, recipe, a, b, scale_a, scale_b, bias, out_dtype)

    return ScaledRoute(decision, run)


def _signature(a, b, scale_a, scale_b, bias, out_dtype, fast_accum: bool) -> tuple:
    """Everything ``fp8_operands.check_scaled`` and the route depend on: a call with the same
    signature passed the same checks (so a known one skips them)."""
    aligned = (a.data_ptr() % 16 == 0 and b.data_ptr() % 16 == 0
               and scale_a.data_ptr() % 16 == 0)
    bias_meta = None if bias is None else (bias.shape, bias.stride(), bias.dtype, bias.device)
    return (a.device, b.device, a.dtype, b.dtype, a.shape, a.stride(), b.shape, b.stride(),
            scale_a.device, scale_a.dtype, scale_a.shape, scale_a.stride(),
            scale_b.device, scale_b.dtype, scale_b.shape, scale_b.stride(),
            out_dtype, bias_meta, fast_accum, aligned)


def known_route(a, b, scale_a, scale_b, bias, out_dtype, fast_accum: bool) -> ScaledRoute | None:
    """The memoized route of a call whose signature was checked before, else None: the eager
    fast path (a dictionary lookup instead of the checks)."""
    if not all(isinstance(t, torch.Tensor) for t in (a, b, scale_a, scale_b)) or \
            bias is not None and not isinstance(bias, torch.Tensor) or not a.is_cuda:
        return None  # off a GPU, scaled_mm computes the reference (the CPU rule)
    return _routes.get(_signature(a, b, scale_a, scale_b, bias, out_dtype, fast_accum))


def decide(checked: CheckedScaled, fast_accum: bool, scale_a, scale_b, *,
           scales_read: bool = True) -> dispatch.Decision:
    """Which kernel runs the call (see the module docstring). ``scales_read=False``: the
    scales' layout is not judged (the decision for copies of them, ``_skinny_without_copies``)."""
    from custom_kernels.core.device import current_scope, current_spec
    from cutlass_ops.gemms.loader import is_built

    if scale_a.device.type != "cuda":  # the op called directly on other tensors
        return dispatch.Decision("torch", None, f"the tensors are on {scale_a.device}")
    refusal = fp8_plan.layout_refusal(checked, scale_a, scale_b) if scales_read else None
    if refusal is not None:
        return dispatch.Decision("torch", None, refusal)
    problem = fp8_plan.problem_of(checked, fast_accum)
    index = scale_a.device.index
    spec = current_spec(index)
    if spec.arch != "sm90a":
        return dispatch.Decision("torch", None, f"our FP8 kernels are built for sm90a, this GPU "
                                 f"is {spec.arch}")
    operands = problem.operands

    def ready(choice) -> bool:
        if isinstance(choice, fp8_skinny_route.SkinnyConfig):
            return fp8_skinny_route.is_built(problem, choice, index, bias=checked.has_bias)
        return not choice.swap_ab and is_built(operands, choice.config)

    decision = dispatch.decide(
        problem, dispatch._entries(current_scope(index)), spec, ready,
        lambda: [c for c in dispatch.built_choices(operands, spec.arch) if not c.swap_ab]
        if UNTUNED_BUILT_KERNELS else [])
    if decision.choice is None and decision.source == "torch":
        recipe = checked.recipe.value
        return dispatch.Decision("torch", None, (
            f"no tuned {recipe} FP8 kernel for {problem.name} on this GPU; run "
            f"`cutlass-tune tune --fp8 {recipe} {checked.m}x{checked.n}x{checked.k}`"))
    return decision


def route(a, b, scale_a, scale_b, bias, checked: CheckedScaled, fast_accum: bool) -> ScaledRoute:
    key = _signature(a, b, scale_a, scale_b, bias, checked.out_dtype, fast_accum)
    found = _routes.get(key)
    if found is not None:
        return found
    copy_reason = _blockwise_copy_reason(checked, scale_a, scale_b)
    if copy_reason is not None:
        made = _skinny_without_copies(checked, fast_accum, scale_a, scale_b) or \
            _copying_route(checked, fast_accum, copy_reason)
        with _lock:
            return _routes.setdefault(key, made)
    decision = decide(checked, fast_accum, scale_a, scale_b)
    if decision.choice is None:
        made = _torch_route(decision, checked, fast_accum)
    elif isinstance(decision.choice, fp8_skinny_route.SkinnyConfig):
        made = _skinny_route(decision, checked)
    else:
        made = _cutlass_route(decision, checked, fast_accum, key)
    with _lock:
        return _routes.setdefault(key, made)


def explain(a, b, scale_a, scale_b, *, bias=None, out_dtype=None,
            use_fast_accum: bool = False) -> dispatch.Decision:
    """What ``scaled_mm`` would run for these inputs, and why (runs nothing)."""
    from cutlass_ops.gemms.fp8.fp8_operands import check_scaled

    checked = check_scaled(a, b, scale_a, scale_b, bias=bias, out_dtype=out_dtype)
    copy_reason = _blockwise_copy_reason(checked, scale_a, scale_b)
    if copy_reason is not None:  # the copies are dispatched in turn, unless the skinny
        direct = _skinny_without_copies(checked, use_fast_accum, scale_a, scale_b)  # takes it
        return direct.decision if direct is not None else \
            dispatch.Decision("copy", None, copy_reason)
    return decide(checked, use_fast_accum, scale_a, scale_b)


__all__ = ["ScaledRoute", "decide", "explain", "reset", "route", "torch_scaled_mm"]
