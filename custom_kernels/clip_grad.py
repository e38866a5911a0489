"""``clip_grad_norm_`` in one persistent cooperative launch (``csrc/clip_grad.cu``).

Same semantics as ``torch.nn.utils.clip_grad_norm_`` for gradients on one CUDA device: any number
of tensors of any sizes (empty ones too) in float32, float16 and bfloat16, mixed in one list;
norm types 2, 1 and inf; the total norm (returned as a 0-d tensor of the dtype torch returns: the
promotion of the gradients' dtypes) is computed without a host sync, and the gradients are scaled
in place by ``min(1, max_norm / (norm + 1e-6))``, computed in fp32 as torch computes it
(``reciprocal(norm + 1e-6) * max_norm``, clamped with NaN kept). A NaN or inf norm scales the
gradients by NaN or 0 as torch does. Norm contributions are accumulated in fp32 per task and
combined in a fixed order, so the result does not depend on the scheduling (it differs from
torch's only by rounding: torch rounds each tensor's norm to its dtype first). One deliberate
difference: torch refuses the inf norm when a gradient is empty ("no identity"); here an empty
tensor's max |x| is 0, as for its 2-norm.

Read top-down: the plan (task table, cached), the launchers, the compile function, the public
function, the torch fallback and the float64 reference.

- ``parameters_or_grads``: a tensor or an iterable of them. An ``nn.Parameter`` (frozen ones
  too) or any tensor that requires grad stands for its ``.grad`` (skipped when None), like torch;
  any other tensor is itself a gradient.
- ``error_if_nonfinite=True`` needs the norm on the host before anything is scaled: it runs the
  two-kernel path with a host sync between the norm and the scaling (so not inside CUDA graph
  capture), and raises ``RuntimeError`` like torch, leaving the gradients untouched.
- Fallback to torch (documented, not an error; logged once per reason): norm types other than
  1, 2 and inf, gradients on the CPU (the CPU rule, ``custom_kernels.core.fallback``) or on
  several GPUs, other dtypes, sparse or non-contiguous gradients. Gradients on a GPU and off one
  together raise UnsupportedInputError.
- DTensor gradients (FSDP2's ``fully_shard``) take torch's clip here, with the reason logged:
  ``custom_kernels.parallel.clip_grad_distributed.clip_grad_norm_`` is the one for them (our local norm
  and one all-reduce).
- Devices without cooperative launch take the two-kernel path (``cooperative=False`` forces it).
- CUDA graphs: call once eagerly before capturing (the queue counters and the task table are
  allocated on first use); the captured launch replays with the counters reset on the device.
- ``launches`` counts our kernel launches by name (the benchmark reads it).

Task table: the gradients laid end to end form one index space, cut into tasks of ``chunk``
elements (small tensors share a task, large ones span many); the table holds each tensor's start
in that space, its address and its dtype. It is cached, keyed by every tensor's (address, numel,
dtype) and the device, so a training step whose gradients sit at the same addresses (as torch's
caching allocator makes them, even with ``zero_grad(set_to_none=True)``) pays the key and a dict
lookup; a new key costs one pinned host-to-device copy. Tensors must not overlap in memory.
Cheaper still (two passes over the tensors instead of five, which matters with thousands of
small tensors): when the gradients are the very tensor objects of the previous call on the device
(checked through weak references) at the same addresses, that call's plan is reused without the
full key. The one case this trusts rather than checks: a gradient tensor whose shape, dtype or
strides are changed in place (``resize_``, ``as_strided_``, ``set_``, ``.data =``) while its
address stays the same.
"""

from __future__ import annotations

import collections
import ctypes
import dataclasses
import math
import operator
import weakref
from array import array
from functools import reduce
from pathlib import Path

import torch

from custom_kernels.core import elements
from custom_kernels import jit, work_queue
from custom_kernels.cooperative import (launch_cooperative, max_cooperative_grid,
                                        supports_cooperative_launch)
from custom_kernels.core import int_limits
from custom_kernels.core.errors import UnsupportedInputError
from custom_kernels.core.fallback import log_once
from custom_kernels.launch import launch, sm_count

SOURCE = "clip_grad.cu"
KERNELS = ("clip_grad_fused", "clip_grad_partials", "clip_grad_finish")
BLOCK = 256
NORM_CODES = {2.0: 2, 1.0: 1, math.inf: 0}
DTYPE_CODES = elements.float_codes()
# Tasks per block the queue aims at (balance: the last tasks finish within one task of each
# other), for a grid estimated at ESTIMATED_BLOCKS_PER_SM; chunk sizes are multiples of ALIGN.
TASKS_PER_BLOCK = 32
ESTIMATED_BLOCKS_PER_SM = 4
MIN_CHUNK, MAX_CHUNK, ALIGN = 8192, 1 << 21, 2048
PLAN_CACHE_SIZE = 16
# The kernels index the gradients with an int (csrc/clip_grad.cu's Table::n): more of them run on
# torch, whose loop has no such limit.
MAX_TENSORS = int_limits.c_range(ctypes.c_int)[1]

launches: collections.Counter = collections.Counter()


# ---------------------------------------------------------------------------------------------
# The plan: task table and sizes, cached by the gradients' (address, numel, dtype)
# ---------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Plan:
    table: torch.Tensor  # int64 on the device: starts[n + 1], ptrs[n], dtype codes[n]
    host: torch.Tensor   # its pinned source (kept: the copy is asynchronous)
    n_tensors: int
    total: int           # elements
    chunk: int           # elements per task
    n_tasks: int
    out_dtype: torch.dtype


_plans: collections.OrderedDict = collections.OrderedDict()
_captured_plans: list = []  # plans a captured graph refers to: never evicted
# device -> (weak references to the last gradients, their addresses, their plan): see _recent_plan
_recent: dict = {}


def chunk_size(total: int, sms: int) -> int:
    """Elements per task: about TASKS_PER_BLOCK tasks per block of the expected grid."""
    target = total / (sms * ESTIMATED_BLOCKS_PER_SM * TASKS_PER_BLOCK)
    chunk = ALIGN * max(1, math.ceil(target / ALIGN))
    return int(min(MAX_CHUNK, max(MIN_CHUNK, chunk)))


def build_table(ptrs, numels, codes) -> tuple[list[int], int]:
    """The table's values (starts, ptrs, codes) and the total element count."""
    starts = [0]
    for n in numels:
        starts.append(starts[-1] + n)
    return starts + list(ptrs) + list(codes), starts[-1]


def result_dtype(codes) -> torch.dtype:
    """The dtype torch's clip_grad_norm_ returns: torch.stack promotes the per-tensor norms."""
    return reduce(torch.promote_types, (elements.from_code(c).torch_dtype for c in set(codes)))


def make_plan(ptrs, numels, codes, device: int) -> Plan:
    values, total = build_table(ptrs, numels, codes)
    chunk = chunk_size(total, sm_count(device))
    host = torch.tensor(values, dtype=torch.int64).pin_memory()
    table = host.to(f"cuda:{device}", non_blocking=True)
    return Plan(table, host, len(numels), total, chunk, -(-total // chunk),
                result_dtype(codes))


def _plan(grads, device: int) -> Plan | None:
    """The cached plan of these gradients; None if one of them is not ours to run."""
    plan = _recent_plan(grads, device)
    if plan is not None:
        if torch.cuda.is_current_stream_capturing():
            _captured_plans.append(plan)
        return plan
    plan, ptrs = _keyed_plan(grads, device)
    if plan is not None:
        # Weak references to every tensor only once the first one came back (the same tensor
        # objects clipped again); gradients made anew every step (zero_grad(set_to_none=True))
        # keep a probe of one reference and pay nothing more than the full key.
        previous = _recent.get(device)
        again = previous is not None and previous[0][0]() is grads[0]
        refs = list(map(weakref.ref, grads)) if again else [weakref.ref(grads[0])]
        _recent[device] = (refs, ptrs, plan)
    return plan


def _recent_plan(grads, device: int) -> Plan | None:
    """The fast path: the last plan of ``device`` when ``grads`` are the very same tensor objects
    (weak references, so nothing is kept alive and a freed tensor never matches) at the same
    addresses. Two passes over the tensors instead of the full key's five."""
    recent = _recent.get(device)
    if recent is None:
        return None
    refs, ptrs, plan = recent
    if (len(refs) != len(grads)
            or not all(map(operator.is_, map(weakref.ref.__call__, refs), grads))
            or array("Q", map(torch.Tensor.data_ptr, grads)) != ptrs):
        return None
    return plan


def _keyed_plan(grads, device: int) -> tuple[Plan | None, array | None]:
    """The plan cached under the full key (every tensor's address, numel and dtype), and the
    addresses; checks dtypes, contiguity and the device ((None, None) when one fails)."""
    try:
        codes = bytes(map(DTYPE_CODES.__getitem__, map(operator.attrgetter("dtype"), grads)))
        if not all(map(torch.Tensor.is_contiguous, grads)):
            return None, None
    except (KeyError, RuntimeError):  # another dtype; sparse tensors have no is_contiguous
        return None, None
    ptrs = array("Q", map(torch.Tensor.data_ptr, grads))
    numels = array("q", map(torch.Tensor.numel, grads))
    if set(map(torch.Tensor.get_device, grads)) != {device}:
        return None, None
    key = (device, ptrs.tobytes(), numels.tobytes(), codes)
    plan = _plans.get(key)
    capturing = torch.cuda.is_current_stream_capturing()
    if plan is None:
        if capturing:
            raise RuntimeError("clip_grad_norm_: these gradients were never clipped outside CUDA "
                               "graph capture; run one step before capturing (warm-up)")
        plan = _plans[key] = make_plan(ptrs, numels, codes, device)
        while len(_plans) > PLAN_CACHE_SIZE:
            _plans.popitem(last=False)
    else:
        _plans.move_to_end(key)
    if capturing:
        _captured_plans.append(plan)
    return plan, ptrs


# ---------------------------------------------------------------------------------------------
# Launchers
# ---------------------------------------------------------------------------------------------

def _kernel(name: str, norm_code: int, device: int):
    return jit.get_kernel(SOURCE, name, defines=_defines(norm_code), device=device)


def _defines(norm_code: int) -> dict:
    return {"NORM_TYPE": norm_code, "BLOCK": BLOCK}


def _launch_fused(plan: Plan, norm_code: int, max_norm: float, norm: torch.Tensor,
                  device: int) -> None:
    kernel = _kernel("clip_grad_fused", norm_code, device)
    grid = min(plan.n_tasks, max_cooperative_grid(kernel, BLOCK, 0, device))
    work_queue.check_tickets(plan.n_tasks, grid, BLOCK)
    partials = torch.empty(plan.n_tasks, dtype=torch.float32, device=norm.device)
    launch_cooperative(kernel, plan.table, plan.n_tensors, plan.total, plan.chunk, plan.n_tasks,
                       partials, work_queue.counters(device), norm, DTYPE_CODES[norm.dtype],
                       max_norm, grid=grid, block=BLOCK, device=device)
    launches["clip_grad_fused"] += 1


def _launch_two_kernels(plan: Plan, norm_code: int, max_norm: float, norm: torch.Tensor,
                        device: int, check_finite: bool) -> None:
    """The fallback: per-task partials, then the total and the scaling. With check_finite, the
    total is stored first (one block, no scaling) and checked on the host."""
    args = _launch_partials(plan, norm_code, device)
    if check_finite:
        _store_total(args, norm_code, max_norm, norm, device)
        _raise_if_nonfinite(norm, norm_code)
    finish = _kernel("clip_grad_finish", norm_code, device)
    work_queue.launch_persistent(finish, *args, norm, DTYPE_CODES[norm.dtype], max_norm, 1,
                                 tasks=plan.n_tasks, block=BLOCK, device=device)
    launches["clip_grad_finish"] += 1


def _launch_partials(plan: Plan, norm_code: int, device: int) -> tuple:
    """The per-task partials kernel; returns the arguments both finish launches take first."""
    partials = torch.empty(plan.n_tasks, dtype=torch.float32, device=plan.table.device)
    args = (plan.table, plan.n_tensors, plan.total, plan.chunk, plan.n_tasks, partials,
            work_queue.counters(device))
    work_queue.launch_persistent(_kernel("clip_grad_partials", norm_code, device), *args,
                                 tasks=plan.n_tasks, block=BLOCK, device=device)
    launches["clip_grad_partials"] += 1
    return args


def _store_total(args: tuple, norm_code: int, max_norm: float, norm: torch.Tensor,
                 device: int) -> None:
    """The finish kernel's mode 0: one block stores the total in ``norm``, scaling nothing."""
    launch(_kernel("clip_grad_finish", norm_code, device), *args, norm, DTYPE_CODES[norm.dtype],
           max_norm, 0, grid=1, block=BLOCK, device=device)
    launches["clip_grad_finish"] += 1


def _raise_if_nonfinite(norm: torch.Tensor, norm_code: int) -> None:
    if not bool(torch.isfinite(norm)):  # host sync: only with error_if_nonfinite=True
        norm_type = {0: math.inf, 1: 1.0, 2: 2.0}[norm_code]
        raise RuntimeError(
            f"The total norm of order {norm_type} for gradients from `parameters` is non-finite, "
            "so it cannot be clipped. To disable this error and scale the gradients by the "
            "non-finite norm anyway, set `error_if_nonfinite=False`")


# ---------------------------------------------------------------------------------------------
# Compile (tensor-free, no GPU)
# ---------------------------------------------------------------------------------------------

def compile_clip_grad(norm_type: float = 2.0, arch: str = jit.DEFAULT_ARCH) -> list[Path]:
    """The cubins of the three kernels for ``norm_type``, as ``get_kernel`` will ask for them."""
    defines = _defines(NORM_CODES[float(norm_type)])
    return [jit.compile_cubin(SOURCE, defines=defines, name_expressions=(name,), arch=arch)
            for name in KERNELS]


# ---------------------------------------------------------------------------------------------
# Public function
# ---------------------------------------------------------------------------------------------

def gradients(parameters_or_grads) -> list[torch.Tensor]:
    """The gradients to clip: an ``nn.Parameter`` (frozen ones too) or a tensor that requires
    grad gives its ``.grad`` (skipped when None), any other tensor is a gradient itself."""
    if isinstance(parameters_or_grads, torch.Tensor):
        parameters_or_grads = (parameters_or_grads,)
    parameter = torch.nn.Parameter
    # Two comprehensions (no per-item append): a tensor is never None, so the filter drops
    # exactly the missing .grads.
    grads = [t.grad if isinstance(t, parameter) or t.requires_grad else t
             for t in parameters_or_grads]
    return [g for g in grads if g is not None]


def clip_grad_norm_(parameters_or_grads, max_norm: float, norm_type: float = 2.0,
                    error_if_nonfinite: bool = False, foreach: bool | None = None, *,
                    cooperative: bool | None = None) -> torch.Tensor:
    """torch.nn.utils.clip_grad_norm_ in one launch; see the module docstring. ``foreach`` is
    accepted for compatibility and ignored. ``cooperative=False`` forces the two-kernel path;
    None picks the cooperative one where the device supports it."""
    grads = gradients(parameters_or_grads)
    max_norm, norm_type = float(max_norm), float(norm_type)
    if not grads:
        return torch.tensor(0.0)
    norm_code, device, plan = _kernel_plan(grads, norm_type)
    if plan is None:
        log_once("clip_grad_norm_ uses torch.nn.utils.clip_grad_norm_",
                 _torch_reason(grads, norm_code))
        return torch_clip_grad_norm_(grads, max_norm, norm_type, error_if_nonfinite, foreach)
    norm = torch.empty((), dtype=plan.out_dtype, device=grads[0].device)
    if plan.n_tasks == 0:  # only empty tensors: torch's norm is 0 and nothing is scaled
        return norm.zero_()
    if cooperative is None:
        cooperative = supports_cooperative_launch(device)
    if cooperative and not error_if_nonfinite:
        _launch_fused(plan, norm_code, max_norm, norm, device)
    else:
        _launch_two_kernels(plan, norm_code, max_norm, norm, device, error_if_nonfinite)
    return norm


def total_norm(parameters_or_grads, norm_type: float = 2.0,
               out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """The total norm that ``clip_grad_norm_`` would clip by, without scaling anything: the
    two-kernel path's per-task partials and its total (no host sync), or torch's
    ``get_total_norm`` where ``clip_grad_norm_`` falls back to torch. ``out_dtype``: the
    result's dtype (default torch's, the promotion of the gradients' dtypes; float32 keeps the
    kernels' float32 total unrounded). The distributed clip's local step
    (``custom_kernels.parallel.clip_grad_distributed``)."""
    grads = gradients(parameters_or_grads)
    norm_type = float(norm_type)
    if not grads:
        return torch.tensor(0.0)
    norm_code, device, plan = _kernel_plan(grads, norm_type)
    if plan is None:
        log_once("total_norm uses torch.nn.utils.get_total_norm",
                 _torch_reason(grads, norm_code))
        return _torch_total_norm(grads, norm_type, out_dtype)
    norm = torch.empty((), dtype=out_dtype or plan.out_dtype, device=grads[0].device)
    if plan.n_tasks == 0:
        return norm.zero_()
    _store_total(_launch_partials(plan, norm_code, device), norm_code, math.inf, norm, device)
    return norm


def _kernel_plan(grads, norm_type: float) -> tuple:
    """(norm code, device index, plan); the plan is None where torch runs instead."""
    norm_code = NORM_CODES.get(norm_type)
    device = grads[0].get_device()
    ours = norm_code is not None and device >= 0 and len(grads) <= MAX_TENSORS
    plan = _plan(grads, device) if ours else None
    return norm_code, device, plan


def _torch_total_norm(grads, norm_type: float, out_dtype=None) -> torch.Tensor:
    get_total_norm = getattr(torch.nn.utils, "get_total_norm", None)  # torch >= 2.6
    if get_total_norm is not None and out_dtype is None:
        return get_total_norm(grads, norm_type)
    # An empty gradient adds nothing (its max |x| is 0, as in the kernels; torch refuses the
    # inf norm of an empty tensor).
    norms = [torch.linalg.vector_norm(g, norm_type, dtype=out_dtype) for g in grads if g.numel()]
    if not norms:
        return torch.zeros((), dtype=out_dtype or grads[0].dtype, device=grads[0].device)
    return torch.linalg.vector_norm(torch.stack([n.to(grads[0].device) for n in norms]),
                                    norm_type)


# ---------------------------------------------------------------------------------------------
# Torch fallback and float64 reference
# ---------------------------------------------------------------------------------------------

def _torch_reason(grads, norm_code) -> str:
    """Why torch clips these gradients (``_plan`` found no plan). Raises UnsupportedInputError
    for gradients on a GPU and off one together."""
    devices = sorted({str(g.device) for g in grads})
    on_gpu = {device.startswith("cuda") for device in devices}
    if on_gpu == {True, False}:
        raise UnsupportedInputError(f"clip_grad_norm_: gradients on {', '.join(devices)}: on "
                                    "CUDA devices and off them in one call")
    if any(hasattr(g, "device_mesh") for g in grads):
        return ("DTensor gradients (FSDP2): custom_kernels.parallel.clip_grad_distributed.clip_grad_norm_ "
                "clips them with our kernels and one all-reduce")
    if on_gpu == {False}:
        return f"the gradients are on {', '.join(devices)}, not a CUDA device"
    if len(devices) > 1:
        return f"the gradients are on several GPUs ({', '.join(devices)})"
    if norm_code is None:
        return "a norm type other than 1, 2 and inf"
    if len(grads) > MAX_TENSORS:
        return f"{len(grads)} gradients, more than the kernels' int index holds ({MAX_TENSORS})"
    if any(g.dtype not in DTYPE_CODES for g in grads):
        return "a gradient dtype other than float32, float16 and bfloat16"
    return "a sparse or non-contiguous gradient"


def torch_clip_grad_norm_(grads, max_norm, norm_type, error_if_nonfinite, foreach):
    """What torch.nn.utils.clip_grad_norm_ does, for a list of gradients (not parameters)."""
    get_total_norm = getattr(torch.nn.utils, "get_total_norm", None)  # torch >= 2.6
    if get_total_norm is not None:
        total = get_total_norm(grads, norm_type, error_if_nonfinite, foreach)
    else:
        norms = [torch.linalg.vector_norm(g, norm_type) for g in grads]
        first = grads[0].device
        total = torch.linalg.vector_norm(torch.stack([n.to(first) for n in norms]), norm_type)
        if error_if_nonfinite and torch.logical_or(total.isnan(), total.isinf()):
            raise RuntimeError(
                f"The total norm of order {norm_type} for gradients from `parameters` is "
                "non-finite, so it cannot be clipped. To disable this error and scale the "
                "gradients by the non-finite norm anyway, set `error_if_nonfinite=False`")
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads:
        g.mul_(coef.to(g.device))
    return total


def reference_clip_grad_norm(grads, max_norm: float, norm_type: float = 2.0):
    """The total norm and the clipped gradients in float64, without touching ``grads``."""
    flat = torch.cat([g.detach().double().reshape(-1) for g in grads]) if grads else \
        torch.zeros(0, dtype=torch.float64)
    total = torch.linalg.vector_norm(flat, norm_type) if flat.numel() else flat.new_zeros(())
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    return total, [g.detach().double() * coef for g in grads]
