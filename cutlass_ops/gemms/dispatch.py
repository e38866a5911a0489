"""Dispatch of ``cutlass_ops.matmul``: which kernel runs a call.

Order, per (device, dtypes, layouts, strides, shape):
1. an exact hit in the tuning cache: its winner (or torch.matmul, when the tune found it faster);
2. the nearest tuned shape with the same operands (same dtypes and layouts): its winner, which
   already takes any M, N, K at run time, if its kernel is built;
3. a heuristic default: the best kernel by our model among those already built for these
   operands, so that an untuned shape runs at once, never behind a compile;
4. torch.matmul, with one log line per reason, for inputs we do not support or when nothing is
   built yet. Online modes (``CUTLASS_OPS_ONLINE`` or ``set_online``): ``compile`` builds the
   heuristic default on first use (about a minute); ``tune`` runs a quick tune on first use.

A fused epilogue (``bias``, ``activation``, ``residual``, alpha / beta) is part of the problem:
its kernels are tuned and built on their own. Where none is tuned or built, the call runs the
plain GEMM's route and the epilogue in torch (never a compile, never a wrong answer).

The decision is memoized per call signature, so a warm call costs one dictionary lookup before
the launch. Inputs are checked once per signature, by the checks ``cutlass_ops.gemm`` runs
(``inputs.check_product`` / ``check_epilogue``): a refusal sends the call to torch (or its
epilogue to torch), and the checked problem is what the kernel's launch arguments are built
from. Tensors off a CUDA device run torch (``custom_kernels.core.fallback``: the CPU rule).
``decide`` is the pure part (tested on a CPU); ``explain`` says what a call would do.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import os
import re
import threading
from typing import Any, Callable, Mapping, Protocol

import torch

from cutlass_ops.gemms import epilogues, inputs, ranking
from cutlass_ops.gemms.config import Arch, GemmConfig, GemmOperands, GemmProblem
from cutlass_ops.gemms.choice import Choice
from cutlass_ops.gemms.gemm_entries import GemmEntry, gemm_cache
from custom_kernels import host_ops
from custom_kernels.core import fallback
from custom_kernels.core.device import DeviceSpec
from custom_kernels.core.eager import plain_eager
from custom_kernels.core.errors import UnsupportedInputError

ONLINE_MODES = ("off", "compile", "tune")
_online: str | None = None
_routes: dict[tuple, Route] = {}
_lock = threading.Lock()


@dataclasses.dataclass(frozen=True)
class Decision:
    source: str  # "exact", "nearest", "heuristic", "online", "torch", "unfused" or "pinned"
    choice: Choice | None  # None: torch.matmul
    reason: str
    # The kernel inside CUDA graphs only; eager calls run torch.matmul, whose whole call (host
    # included) the tuner measured faster than the kernel's for this shape.
    graphs_only: bool = False
    # The mirror: the kernel for eager calls only, whose whole call the tuner measured faster
    # than torch.matmul's; inside CUDA graphs (no host cost) torch.matmul, whose kernel was.
    eager_only: bool = False


@dataclasses.dataclass(frozen=True)
class Route:
    decision: Decision
    run: Callable[..., Any]
    kind: str = ""  # "cutlass", "dsl", "torch", "graphs only" or "eager only"

    def __post_init__(self) -> None:
        if not self.kind:
            object.__setattr__(self, "kind",
                               "torch" if self.decision.choice is None else "cutlass")


def set_online(mode: str | None) -> None:
    """What an untuned shape with no built kernel does: "off" (torch.matmul, the default),
    "compile" (build the heuristic default), "tune" (a quick tune). None: the environment's."""
    global _online
    if mode is not None and mode not in ONLINE_MODES:
        raise ValueError(f"online mode must be one of {ONLINE_MODES}, got {mode!r}")
    _online = mode
    reset()


class OnlineTuner(Protocol):
    """What the online modes need from the tuner, which sits on the floor above this one and
    plugs in here (``register_online_tuner``, or the ``cutlass_ops.online_tuner`` entry point that
    the installed package declares for ``tuning.online``)."""

    def propose(self, problem: GemmProblem, device: DeviceSpec) -> Choice | None:
        """The config to build for an untuned shape with nothing built (online "compile")."""

    def tune(self, problem: GemmProblem, device_index: int) -> None:
        """A quick tune of one problem, stored in the tuning cache (online "tune")."""


_online_tuner: OnlineTuner | None = None


def register_online_tuner(tuner: OnlineTuner | None) -> None:
    global _online_tuner
    _online_tuner = tuner
    reset()


def online_tuner() -> OnlineTuner | None:
    """The registered online tuner, else the installed package's entry point, else None (then
    the online modes behave as "off" and say so once)."""
    global _online_tuner
    if _online_tuner is None:
        from importlib.metadata import entry_points

        for point in entry_points(group="cutlass_ops.online_tuner"):
            _online_tuner = point.load()
            break
        else:
            _log_once("no online tuner is installed (pip install cutlass-ops provides one)",
                      "the online modes are off")
    return _online_tuner


def online_mode() -> str:
    mode = _online or os.environ.get("CUTLASS_OPS_ONLINE", "off")
    return mode if mode in ONLINE_MODES else "off"


# Other entry points' memoized routes read the same cache (fp8_routes registers its own).
RESET_HOOKS: list[Callable[[], None]] = []


def reset() -> None:
    """Forgets memoized decisions (after a tune in this process, or a cache import)."""
    with _lock:
        _routes.clear()
    host_ops.clear_records()  # the compiled host path's records are routes too
    _entries_by_scope.clear()
    for hook in RESET_HOOKS:
        hook()


def _log_once(reason: str, what: str = "cutlass_ops.matmul uses torch.matmul") -> None:
    fallback.log_once(what, reason)


# ---- the pure decision ---------------------------------------------------------------------

def _distance(a: GemmProblem, b: GemmProblem) -> float:
    """Log-distance between shapes; N and K weigh more (they are the weights, fixed per layer,
    while M follows the batch)."""
    return (abs(math.log2(a.m / b.m)) + 2 * abs(math.log2(a.n / b.n))
            + 2 * abs(math.log2(a.k / b.k)) + abs(math.log2(a.batch / b.batch)))


def decide(problem: GemmProblem, entries: Mapping[str, GemmEntry], device: DeviceSpec,
           is_built: Callable[[Choice], bool], built_choices: Callable[[], list[Choice]],
           online: str = "off", tuner: OnlineTuner | None = None) -> Decision:
    """Which kernel runs ``problem``, from the tuning cache's records (validated when the file
    was read: ``gemm_entries``) and what is built."""
    entry = entries.get(problem.name)
    if entry is not None and entry.winner is not None:
        if entry.eager_prefers_kernel and (is_built(entry.winner) or online != "off"):
            return Decision(
                "exact", entry.winner, "tuned for this shape: torch.matmul's kernel was faster, "
                f"the winner's whole eager call too ({entry.whole_call_ms * 1e3:.1f} us against "
                f"{entry.torch_whole_call_ms * 1e3:.1f}): the kernel eagerly, torch.matmul "
                "inside CUDA graphs", eager_only=True)
        if not entry.uses_kernel:
            return Decision("exact", None, "tuned for this shape: torch.matmul was faster")
        if is_built(entry.winner) or online != "off":
            return _tuned("exact", entry, "tuned for this shape")
        # The winner's artifact is not here (a cache imported from another machine): fall
        # through to a built kernel rather than compile on a call.
    elif entry is not None:
        return Decision("exact", None, "tuned for this shape: every candidate failed")

    family = sorted((_distance(problem, other.problem), name, other)
                    for name, other in entries.items()
                    if other.problem.operands == problem.operands and other.winner is not None
                    and problem.m and problem.n and problem.k
                    and _takes(other.winner, problem))
    for _, _, other in family:
        tuned = other.problem
        if not other.uses_kernel:
            return Decision("nearest", None, f"nearest tuned shape {tuned.m}x{tuned.n}x{tuned.k}"
                            " found torch.matmul faster")
        if is_built(other.winner):
            return _tuned("nearest", other, f"nearest tuned shape {tuned.m}x{tuned.n}x{tuned.k}")
        break

    built = [c for c in built_choices() if ranking.fits_shape(problem, c)]
    if built:
        best = ranking.rank(problem, device, [c.replace(splits=1) for c in built])[0]
        return Decision("heuristic", best, "untuned shape: the model's best built kernel")
    if online in ("compile", "tune") and tuner is not None:
        best = tuner.propose(problem, device)
        if best is not None:
            return Decision("online", best, f"untuned shape, nothing built: online {online}")
    return Decision("torch", None, f"no tuned or built kernel for {problem.name} on this GPU; run "
                    f"`cutlass-tune tune {problem.m}x{problem.n}x{problem.k}` (or set "
                    "CUTLASS_OPS_ONLINE=compile)")


def _tuned(source: str, entry: GemmEntry, reason: str) -> Decision:
    """The decision of a tuned entry whose kernel won on GPU time."""
    if entry.eager_prefers_torch:
        return Decision(source, entry.winner, f"{reason}; the kernel inside CUDA graphs only: "
                        f"called eagerly, torch.matmul's whole call is faster "
                        f"({entry.torch_whole_call_ms * 1e3:.1f} us against "
                        f"{entry.whole_call_ms * 1e3:.1f})", graphs_only=True)
    return Decision(source, entry.winner, reason)


def _takes(winner, problem: GemmProblem) -> bool:
    """Whether a tuned shape's winner can compute ``problem`` at all: the skinny FP8 kernel
    takes few rows only (``fp8_skinny_route``), so a nearer shape's skinny winner is passed over
    for the next tuned shape rather than ending the search."""
    if getattr(winner, "backend", None) != "skinny":
        return True
    from cutlass_ops.gemms.fp8 import fp8_skinny_route

    return fp8_skinny_route.operands_refusal(problem) is None


# ---- what is built, from the artifact cache ------------------------------------------------

_ARTIFACT_SUFFIX = re.compile(r"-[0-9a-f]{20}$")


def built_choices(operands: GemmOperands, arch: str) -> list[Choice]:
    """The kernels built for these operands (either orientation), listed from the artifact cache
    without emitting or compiling anything."""
    from custom_kernels.core import cache_dir
    from cutlass_ops.gemms.loader import is_built
    from cutlass_ops.gemms.choice import swapped_operands

    root = cache_dir.versioned_dir("artifacts", arch)
    out = []
    orientations = [(False, operands)]
    if operands.scaling.value == "none":  # scaled FP8 kernels run unswapped
        orientations.append((True, swapped_operands(operands)))
    for swap, ops in orientations:
        prefix = ops.name + "-"
        for path in sorted(root.glob(prefix + "*")):
            if not path.is_dir() or not (path / "kernel.so").exists():
                continue
            build_name = _ARTIFACT_SUFFIX.sub("", path.name[len(prefix):])
            try:
                config = GemmConfig.from_name(build_name + "-split1-rheuristic-sw1")
            except ValueError:
                continue
            choice = Choice(config, swap)
            if choice not in out and is_built(ops, config):  # built from today's sources
                out.append(choice)
    return out


# ---- the call path ---------------------------------------------------------------------------

_entries_by_scope: dict[Any, dict[str, GemmEntry]] = {}


def _entries(scope) -> dict[str, GemmEntry]:
    entries = _entries_by_scope.get(scope)
    if entries is None:
        entries = gemm_cache(scope).entries()
        _entries_by_scope[scope] = entries
    return entries


_PLAIN_KEY_LENGTH = 11  # _signature's: a route key with nothing after it has no epilogue


def _signature(a, b, out_dtype) -> tuple:
    aligned = a.data_ptr() % 16 == 0 and b.data_ptr() % 16 == 0
    return (a.device, b.device, a.dtype, b.dtype, out_dtype, a.shape, a.stride(), b.shape,
            b.stride(), aligned, torch.is_grad_enabled() and (a.requires_grad or b.requires_grad))


def _grad_needed(a, b) -> bool:
    return torch.is_grad_enabled() and (a.requires_grad or b.requires_grad)


def _torch_route(decision: Decision, out_dtype, activation="identity") -> Route:
    def run(a, b, bias=None, residual=None, alpha=1.0, beta=1.0):
        if out_dtype is not None and out_dtype != a.dtype:
            a, b = a.to(out_dtype), b.to(out_dtype)
        if bias is None and residual is None and activation == "identity" and alpha == 1.0:
            return torch.matmul(a, b)
        fused = _torch_addmm(a, b, bias, activation, residual, alpha, beta)
        if fused is not None:
            return fused
        return epilogues.apply(torch.matmul(a, b), alpha=alpha, bias=bias,
                               activation=activation, c=residual, beta=beta)

    return Route(decision, run)


def _torch_addmm(a, b, bias, activation, residual, alpha, beta):
    """``alpha * (a @ b) + bias + beta * residual`` as one cuBLAS GEMM whose epilogue adds the
    residual (or the bias), when the epilogue is linear and the operands are 2-D of one dtype;
    None otherwise. Unfused, the add would cost another pass over the output."""
    if activation != "identity" or a.dim() != 2 or b.dim() != 2:
        return None
    c = residual if residual is not None else bias
    if c is None or c.dtype != a.dtype or b.dtype != a.dtype:
        return None
    out = torch.addmm(c, a, b, beta=beta if residual is not None else 1.0, alpha=alpha)
    if residual is not None and bias is not None:
        out += bias
    return out


def _unfused_route(decision: Decision, plain: Route, activation) -> Route:
    """No fused kernel for this epilogue: the plain GEMM's own route, then the epilogue in torch."""
    def run(a, b, bias=None, residual=None, alpha=1.0, beta=1.0):
        if plain.kind == "torch":
            fused = _torch_addmm(a, b, bias, activation, residual, alpha, beta)
            if fused is not None:
                return fused
        return epilogues.apply(plain.run(a, b), alpha=alpha, bias=bias, activation=activation,
                               c=residual, beta=beta)

    return Route(dataclasses.replace(decision, choice=plain.decision.choice), run,
                 kind=plain.kind)


def _cutlass_route(decision: Decision, checked: inputs.CheckedGemm, key,
                   activation="identity", host_record: bool = False) -> Route:
    """Runs the chosen kernel on the route's checked problem. The first call loads the kernel
    and builds its launch arguments from the checked problem (``plan.prepare``, then
    can_implement and the workspace query); every call, the first one too, copies them and
    swaps in its own pointers and scalars, which the signature (shapes, strides, dtypes,
    alignment, devices) keeps valid: the per-call host work is an output allocation, a struct
    copy and the launch. ``host_record``: a plain product's route, handed to the compiled host
    path (``custom_kernels.host_ops``) once prepared, so that its later calls skip Python."""
    from custom_kernels.core.errors import InvalidConfigError, UnsafeCacheError

    choice = decision.choice
    assert choice is not None
    out_dtype = checked.out_dtype
    launcher: list[Callable] = []  # the fast launch, once prepared

    def run(a, b, bias=None, residual=None, alpha=1.0, beta=1.0):
        if launcher:
            return launcher[0](a, b, bias, residual, alpha, beta)
        from cutlass_ops.gemms import plan

        try:
            kernel, args = plan.prepare(choice.orient(checked), choice.config)
        except (InvalidConfigError, UnsafeCacheError) as exc:
            # A rule of the config the decision did not foresee, or a kernel cache that turned
            # writable by others since the decision (cache_trust): this signature goes to torch.
            torch_route = _torch_route(Decision("torch", None, str(exc)), out_dtype, activation)
            _log_once(str(exc))
            if key is not None:
                with _lock:
                    _routes[key] = torch_route
            return torch_route.run(a, b, bias, residual, alpha, beta)
        workspace_bytes = kernel.workspace_bytes(args)
        launcher.append(_fast_launch(kernel, args, workspace_bytes, choice.swap_ab,
                                     "C" in checked.views, out_dtype))
        out = launcher[0](a, b, bias, residual, alpha, beta)
        if host_record:
            _record_for_host(a, b, kernel, args, workspace_bytes, choice.swap_ab, out_dtype,
                             decision.eager_only)
        return out

    return Route(decision, run)


def _dsl_route(decision: Decision, checked: inputs.CheckedGemm, key,
               activation="identity") -> Route:
    """Runs a CuTe DSL winner (``cutlass_ops.gemms.dsl``) into a new output, with the epilogue
    it was tuned for fused. The first call checks the operands and compiles or loads the
    kernel; later calls of the signature launch it directly. Should the first call fail, the
    signature goes to torch for good, with the reason logged."""
    from cutlass_ops.gemms import dsl

    config = decision.choice
    out_dtype = checked.out_dtype
    runner: list[Callable] = []

    def run(a, b, bias=None, residual=None, alpha=1.0, beta=1.0):
        out = torch.empty((*a.shape[:-1], b.shape[-1]), dtype=out_dtype, device=a.device)
        if runner:
            runner[0](a, b, out, bias, residual, alpha, beta)
            return out
        try:
            dsl.check(a, b, out, bias, residual)
            launch = dsl.runner(config)
            launch(a, b, out, bias, residual, alpha, beta)
        except Exception as exc:  # noqa: BLE001 - the DSL's compiler: torch runs it instead
            reason = f"the DSL kernel {config.name} failed: {type(exc).__name__}: {exc}"[:300]
            _log_once(reason)
            torch_route = _torch_route(Decision("torch", None, reason), out_dtype, activation)
            if key is not None:
                with _lock:
                    _routes[key] = torch_route
            return torch_route.run(a, b, bias, residual, alpha, beta)
        runner.append(launch)
        return out

    return Route(decision, run, kind="dsl")


def _record_for_host(a, b, kernel, template, workspace_bytes: int, swap_ab: bool,
                     out_dtype, eager_only: bool = False) -> None:
    """The plain product's prepared launch (alpha 1, no C: C is D with beta 0) as a record of the
    compiled host path (``custom_kernels.host_ops.record_gemm``); ``eager_only``: not taken
    under stream capture (an eager-only decision)."""
    from cutlass_ops.gemms.runtime import GemmArgs, pointer_offsets

    args = GemmArgs.from_buffer_copy(template)
    args.alpha = 1.0
    run, last_error = kernel.entry_points()
    host_ops.record_gemm(a, b, run, last_error, bytes(args), pointer_offsets(), swap_ab,
                         workspace_bytes, out_dtype, eager_only)


def _fast_launch(kernel, template, workspace_bytes: int, swap_ab: bool, has_c: bool, out_dtype):
    """A launch of checked arguments with one call's pointers and scalars swapped in."""
    from cutlass_ops.gemms.runtime import GemmArgs

    def launch(a, b, bias, residual, alpha, beta):
        out = torch.empty((*a.shape[:-1], b.shape[-1]), dtype=out_dtype, device=a.device)
        args = GemmArgs.from_buffer_copy(template)
        first, second = (b, a) if swap_ab else (a, b)  # swapped, the kernel's A is b^T
        args.a, args.b = first.data_ptr(), second.data_ptr()
        args.d = out.data_ptr()
        if has_c:  # the signature fixes whether a residual comes, and its strides
            args.c, args.beta = residual.data_ptr(), beta
        else:
            args.c = args.d
        args.alpha = alpha
        if bias is not None:
            args.bias = bias.data_ptr()
        workspace = (torch.empty(workspace_bytes, dtype=torch.uint8, device=out.device)
                     if workspace_bytes else None)
        kernel.run_checked(args, workspace.data_ptr() if workspace_bytes else 0, workspace_bytes,
                           _current_stream(out.device.index))
        return out

    return launch


def _current_stream(index: int) -> int:
    """torch's current stream on a device, as a raw handle. The private call avoids building a
    Stream object per launch (a cost docs/measurements.md gives); the public one is the fallback."""
    try:
        return torch._C._cuda_getCurrentRawStream(index)
    except AttributeError:
        return torch.cuda.current_stream(index).cuda_stream


def _torch_reason(a, b, bias, residual) -> str | None:
    """Why torch runs this call whatever its shapes, or None: operands that are not tensors,
    tensors off a CUDA device (the CPU rule; tensors on several devices raise), gradients, a
    GPU that is not an sm90 one."""
    if not _tensors(a, b):
        return "the operands are not tensors"
    device = fallback.common_device({"A": a, "B": b, "bias": bias, "residual": residual},
                                    "cutlass_ops.matmul")
    if device.type != "cuda":
        return f"the tensors are on {device}, not a CUDA device"
    if _grad_needed(a, b):
        return "an operand requires grad: use cutlass_ops.nn / the custom ops for autograd"
    if torch.is_grad_enabled() and any(
            isinstance(t, torch.Tensor) and t.requires_grad for t in (bias, residual)):
        return "the bias or residual requires grad: use cutlass_ops.nn / the custom ops"
    refusal = inputs.arch_refusal(Arch.SM90A, device)
    return None if refusal is None else f"{refusal}, not an sm90 GPU"


def _check(a, b, out_dtype, bias, activation, residual
           ) -> tuple[inputs.CheckedGemm | None, str | None, str | None]:
    """(the checked problem, why torch runs the product, why torch runs the epilogue): the
    product's refusal sends the call to torch, the epilogue's to the plain GEMM's route with the
    epilogue in torch. Dispatch fuses epilogues of 2-D problems only."""
    try:
        checked = inputs.check_product(a, b, out_dtype=out_dtype)
    except UnsupportedInputError as exc:
        return None, str(exc), None
    if checked.problem is None:
        return None, "an empty product (M, N, K or the batch is 0)", None
    if bias is None and residual is None and activation == "identity":
        return checked, None, None
    try:
        checked = inputs.check_epilogue(checked, c=residual, bias=bias, activation=activation,
                                        beta=0.0 if residual is None else 1.0)
    except UnsupportedInputError as exc:
        return checked, None, str(exc)
    if checked.problem.batch != 1 and not checked.problem.operands.epilogue.is_default:
        return checked, None, "a fused epilogue on batched (3-D) operands"
    return checked, None, None


def _resolve(a, b, out_dtype, key=None, bias=None, activation="identity",
             residual=None) -> Route:
    checked = epilogue_reason = None
    reason = _torch_reason(a, b, bias, residual)
    if reason is None:
        checked, reason, epilogue_reason = _check(a, b, out_dtype, bias, activation, residual)
    if reason is not None:
        _log_once(reason)
        return _torch_route(Decision("torch", None, reason), out_dtype, activation)
    if epilogue_reason is not None:
        _log_once(epilogue_reason, "cutlass_ops.matmul runs the epilogue unfused, in torch")
        return _unfused_route(Decision("unfused", None, epilogue_reason), route(a, b, out_dtype),
                              activation)
    problem = checked.problem
    fused = not problem.operands.epilogue.is_default

    from cutlass_ops.gemms.loader import is_built
    from custom_kernels.core.device import current_scope, current_spec

    index = a.device.index
    device = current_spec(index)
    decision = decide(
        problem, _entries(current_scope(index)), device,
        is_built=lambda c: _ready(c, problem, is_built),
        built_choices=lambda: built_choices(problem.operands, device.arch),
        online=online_mode(), tuner=online_tuner() if online_mode() != "off" else None)
    if decision.source == "online" and online_mode() == "tune":
        online_tuner().tune(problem, index)
        _entries_by_scope.clear()
        decision = decide(problem, _entries(current_scope(index)), device, lambda c: True,
                          lambda: [])
    if decision.choice is None:
        if fused and decision.source == "torch":
            # Nothing tuned or built for this epilogue: the plain GEMM's route, unfused.
            plain = route(a, b, out_dtype)
            return _unfused_route(Decision("unfused", None, f"{decision.reason}; the plain GEMM "
                                           "runs with the epilogue in torch"), plain, activation)
        if decision.source == "torch":
            decision = _unsafe_cache_reason(decision, device.arch)
            _log_once(decision.reason)
        return _torch_route(decision, out_dtype, activation)
    if decision.choice.backend == "dsl":
        kernel = _dsl_route(decision, checked, key, activation)
    else:
        # A plain product with no out_dtype and no gradient (the signature says so), not kept
        # for CUDA graphs alone: its eager calls may skip Python.
        plain = (key is not None and len(key) == _PLAIN_KEY_LENGTH and key[4] is None
                 and not key[-1] and not decision.graphs_only)
        kernel = _cutlass_route(decision, checked, key, activation, host_record=plain)
    if decision.graphs_only:
        return _split_route(decision, kernel, _torch_route(decision, out_dtype, activation),
                            "graphs only")
    if decision.eager_only:
        return _split_route(decision, _torch_route(decision, out_dtype, activation), kernel,
                            "eager only")
    return kernel


def _split_route(decision: Decision, captured: Route, eager: Route, kind: str) -> Route:
    """``captured`` while a CUDA graph is being captured (a replay has no host cost), ``eager``
    otherwise: what the tuner found faster for each (graphs-only: the kernel captured, torch
    eagerly; eager-only the mirror, whose kernel record the C++ op declines under capture too).
    The first eager call runs ``captured`` as well, its output dropped, so that what a capture
    needs is made outside it: the kernel loaded and its launch planned, or cuBLAS's handle,
    which a thread makes on its first call and a capture refuses (seen on an H200)."""
    captured_run, eager_run = captured.run, eager.run
    prepared: list = []

    def run(*args):
        if torch.cuda.is_current_stream_capturing():
            return captured_run(*args)
        if not prepared:
            prepared.append(True)
            captured_run(*args)
        return eager_run(*args)

    return Route(decision, run, kind=kind)


def pinned_route(a, b, choice: Choice, host_record: bool = False) -> Route:
    """The route of ``choice`` for (a, b)'s signature, without the tuning cache: what the
    tuner times as the winner's whole call (the dispatch lookup before it is the same for
    every route). Plain products only; raises UnsupportedInputError otherwise.
    ``host_record``: a CUTLASS route hands its prepared launch to the compiled host path on its
    first run (``host_gemm`` then takes the signature; ``host_ops.clear_records`` forgets it)."""
    checked, reason, _ = _check(a, b, None, None, "identity", None)
    if reason is not None:
        raise UnsupportedInputError(reason)
    decision = Decision("pinned", choice, "timed by the tuner")
    if choice.backend == "dsl":
        return _dsl_route(decision, checked, None)
    return _cutlass_route(decision, checked, None, host_record=host_record)


def torch_route() -> Route:
    """torch.matmul's route, as dispatch runs it (the tuner's whole-call reference)."""
    return _torch_route(Decision("torch", None, "timed by the tuner"), None)


def _unsafe_cache_reason(decision: Decision, arch: str) -> Decision:
    """Nothing built, because the kernel cache is writable by others (``loader.is_built`` then
    counts nothing as built): say that, not "run cutlass-tune tune", which would not help."""
    from custom_kernels.core import cache_dir, cache_trust

    why = cache_trust.refusal(cache_dir.versioned_dir("artifacts", arch))
    return decision if why is None else dataclasses.replace(decision, reason=why[0])


def _ready(choice, problem: GemmProblem, is_built) -> bool:
    """Whether ``choice`` can run now without an nvcc build: a C++ kernel whose artifact is in
    the cache, or a DSL kernel with the extra installed (it compiles in about 2 s, or loads
    from the DSL cache, on the signature's first call)."""
    if choice.backend == "dsl":
        from cutlass_ops.gemms import dsl

        return dsl.refusal(problem) is None
    return _safe(lambda: is_built(choice.operands_for(problem.operands), choice.config))


def _safe(fn) -> bool:
    from custom_kernels.core.errors import CutlassOpsError

    try:
        return fn()
    except (CutlassOpsError, OSError):
        return False


def route(a, b, out_dtype=None, bias=None, activation="identity", residual=None) -> Route:
    if not _tensors(a, b):
        return _resolve(a, b, out_dtype, None, bias, activation, residual)
    key = _signature(a, b, out_dtype)
    if bias is not None or residual is not None or activation != "identity":
        key += (_meta(bias), activation, _meta(residual))
    found = _routes.get(key)
    if found is None:
        found = _resolve(a, b, out_dtype, key, bias, activation, residual)
        with _lock:
            _routes[key] = found
    return found


def _meta(t) -> tuple | None:
    """What of an epilogue tensor decides the route: its layout, type and alignment."""
    if not isinstance(t, torch.Tensor):
        return None if t is None else (type(t),)
    return (t.device, t.dtype, t.shape, t.stride(), t.data_ptr() % 16 == 0,
            torch.is_grad_enabled() and t.requires_grad)


def _tensors(a, b) -> bool:
    return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)


# Calls per route kind ("cutlass", "dsl", "torch", "graphs only", "eager only") in this process
# that took the Python route. The products the compiled host path takes are counted in C++ (a
# counter here would cost the hot call as much as its checks). call_counts() is what really
# ran, for benchmarks and for users checking that a model runs our kernels.
calls: collections.Counter = collections.Counter()


def call_counts() -> collections.Counter:
    """Calls per route kind in this process: ``calls`` plus the compiled host path's products,
    on CUTLASS records as "cutlass" and on torch records (``HOST_TORCH_RECORDS``) as "torch"."""
    counts = calls.copy()
    on_cutlass, on_torch = host_ops.product_calls()
    if on_cutlass:
        counts["cutlass"] += on_cutlass
    if on_torch:
        counts["torch"] += on_torch
    return counts


def host_gemm(a, b):
    """The compiled host path's plain product (``custom_kernels.host_ops``): ``a @ b`` on a
    record (a CUTLASS route or torch's), or None when it does not take the call (not loaded
    yet, traced or non-plain tensors, a signature with no record: then the Python route runs,
    and records)."""
    if HOST_GEMM.off or torch.compiler.is_compiling() or not plain_eager(a, b) or not a.is_cuda:
        return None  # (off CUDA: nothing to launch, and no reason to build the library)
    op = HOST_GEMM.op or HOST_GEMM.load()
    return None if op is None else op(a, b)


HOST_GEMM = host_ops.LazyOp("gemm")


def matmul(a, b, *, out_dtype=None, bias=None, activation="identity", residual=None,
           alpha: float = 1.0, beta: float = 1.0):
    """``activation(alpha * (a @ b) + bias) + beta * residual`` on the tuned kernel for this
    shape and epilogue (see the module docstring for the order). ``bias``: (N,), the output's
    dtype; ``activation``: identity, relu, gelu, gelu_tanh or silu; ``residual``: the output's
    shape and dtype (beta = 0 ignores it, as torch.addmm ignores C)."""
    if residual is not None and beta == 0:
        residual = None
    if (out_dtype is None and bias is None and residual is None and alpha == 1.0
            and activation == "identity"):
        out = host_gemm(a, b)
        if out is not None:  # (counted in C++: call_counts)
            return out
        plain = True
    else:
        plain = False
    activation = getattr(activation, "value", activation)
    found = route(a, b, out_dtype, bias, activation, residual)
    calls[found.kind] += 1
    if plain and found.kind == "torch" and HOST_TORCH_RECORDS:
        _record_torch_for_host(a, b)
    return found.run(a, b, bias, residual, alpha, beta)


# Whether a plain product dispatch sends to torch is handed to the compiled host path too, so
# that its warm call skips Python (the whole-call rows where the route is torch's:
# docs/measurements.md, "Whole calls through the compiled host path"); call_counts() counts
# such calls as "torch". Off: on two H200 runs its whole calls were no nearer torch's than the
# Python route's (docs/measurements.md, "The torch record on a GPU").
HOST_TORCH_RECORDS = False


def _record_torch_for_host(a, b) -> None:
    if HOST_GEMM.op is not None and a.dim() == 2 and b.dim() == 2 and plain_eager(a, b) and \
            a.is_cuda and a.dtype == b.dtype:
        host_ops.record_torch_gemm(a, b)


def explain(a, b, *, out_dtype=None, bias=None, activation="identity", residual=None) -> Decision:
    """What ``matmul(a, b, ...)`` would run, and why."""
    return route(a, b, out_dtype, bias, getattr(activation, "value", activation),
                 residual).decision
