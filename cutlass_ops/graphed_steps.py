"""Whole train steps and inference forwards replayed as CUDA graphs, without torch.compile.

A converted model's kernels keep the GPU busy, but between them the GPU waits for Python: the
modules' forward code, autograd's bookkeeping, each launch (about 10 ms of a 94 ms train step of
the e2e model). ``graphed_train_step(model, optimizer)`` captures the forward, the loss, the
backward and, where the optimizer is capturable, the optimizer step into one CUDA graph per input
signature and then replays it: a copy of the inputs into the graph's buffers and one launch.
``graphed_forward(model)`` does the same for an inference forward (prefill).

What a user sees:
- **The first call of a signature runs eagerly** (it loads kernels, resolves GEMM routes, makes
  the optimizer's state); the second captures and replays; later calls replay. A signature is
  the tensors' shapes, strides, dtypes and devices and the other arguments' values.
- **Gradients**: after a graphed train step each parameter's ``.grad`` is this step's gradient,
  as after ``zero_grad(set_to_none=True)`` and ``backward()`` (replaced, not accumulated); the
  tensors are the graph's own, overwritten by its next replay.
- **The optimizer step** is captured when every parameter group says ``capturable=True`` (Adam,
  AdamW and the other torch optimizers that take the flag); otherwise it runs eagerly after the
  replay. Its hyperparameters that are Python numbers are frozen in a capture: when one changes
  (a scheduler's float ``lr``), the step is captured again, with a warning once; a tensor ``lr``
  (``torch.tensor(lr, device="cuda")``, which torch's schedulers fill in place) avoids that.
- **Outputs**: the train step returns the loss (a copy); ``graphed_forward`` returns the graph's
  own output tensors, overwritten by the next call of the same signature (clone what you keep),
  as ``torch.cuda.make_graphed_callables`` and ``torch.compile(mode="reduce-overhead")`` do.
- **Memory**: each captured signature keeps its activations and gradients in a memory pool
  (a ``torch.cuda.MemPool``) shared by the holder's graphs, at most ``max_graphs`` of them (the
  oldest dropped); ``memory_bytes()`` says what the pool holds; ``reset()`` frees it.
- **Refusals** (``CaptureRefused``, naming the reason): CPU tensors, inputs that require grad,
  arguments that cannot be part of a signature, and a step that synchronizes with the host
  while captured (``.item()``, ``nonzero``, a shape read from data: torch's sync debug mode is
  on during the capture, so the message names the operation). ``on_refusal="eager"`` runs such
  a signature eagerly instead, logged once.
- A new parameter tensor (``load_state_dict(assign=True)``, ``model.to``) or an optimizer's
  ``load_state_dict`` drops the graphs: they read the old memory.
- **Distributed models** (``distributed_refusal`` says why one is not graphed): NCCL
  collectives are captured with the rest (NCCL 2.9.6 or later, as torch's CUDA graphs notes
  require), so the replay reduces the gradients as the eager step did (GPU tests: a TP and a
  DDP step equal their eager twins bit for bit; ``CAPTURE_DISTRIBUTED = False`` refuses them
  all):
  - Tensor parallelism (DTensor parameters on a CUDA mesh: ``cutlass_ops.parallel`` or torch's
    plan): graphed like any model; ``.grad`` is each parameter's DTensor gradient.
  - DDP (``DistributedDataParallel`` over NCCL): captured after ``DDP_WARMUP_STEPS`` eager
    steps (the reducer times its first 10 iterations with CUDA events it reads back on the host,
    which a capture refuses); its runtime logging is then sampled never again, for the same
    reason. Refused with ``find_unused_parameters=True`` (the reducer finds the unused
    parameters on the host each step: a replay would freeze the first answer) and under
    ``no_sync`` (a replay would reduce anyway).
  - FSDP (``fully_shard``) is refused: its unshard / reshard state machine and its
    per-step allocations of unsharded parameters run on the host around every layer.
  - **Before ``destroy_process_group()``, call ``reset_all()``** (or each holder's ``reset()``):
    NCCL destroys a communicator only once every graph that captured one of its collectives is
    destroyed, so a graph still alive there hangs the exit (pytorch#115388; seen on an H200).
    The first distributed capture says so once in the log, and registers ``reset_all`` to run
    at interpreter exit (before torch's own exit handlers) for programs that never destroy
    their process group themselves.
"""

from __future__ import annotations

import collections
import dataclasses
import warnings
import weakref
from typing import Any, Callable, Optional

import torch
from torch import Tensor, nn
from torch.utils import _pytree as pytree

from cutlass_ops import step_graphs

DEFAULT_MAX_GRAPHS = 4


class CaptureRefused(RuntimeError):
    """A step that cannot be replayed as a CUDA graph, and why."""


@dataclasses.dataclass
class Captured:
    """One signature's graph: its input buffers (the flattened call's tensors, in order), its
    outputs, the gradients its backward writes (train steps)."""

    graph: Any
    inputs: list
    outputs: Any
    grads: Optional[list] = None


def signature(args: tuple, kwargs: dict) -> tuple:
    """What a graph's validity depends on, of a call's arguments: each tensor's shape, stride,
    dtype and device, and every other leaf's value; refused where a graph cannot hold it."""
    leaves, spec = pytree.tree_flatten((args, kwargs))
    key = []
    for leaf in leaves:
        if isinstance(leaf, Tensor):
            key.append(_tensor_key(leaf))
            continue
        try:
            hash(leaf)
        except TypeError:
            raise CaptureRefused(f"an argument of type {type(leaf).__name__} is neither a tensor "
                                 "nor hashable: a graph cannot tell one call from another") from None
        key.append(leaf)
    return (spec, tuple(key))


def _tensor_key(t: Tensor) -> tuple:
    if t.device.type != "cuda":
        raise CaptureRefused(f"a {t.device} tensor argument: CUDA graphs hold CUDA tensors only")
    if t.requires_grad:
        raise CaptureRefused("an argument requires grad: its gradient would stay in the graph's "
                             "buffer; pass inputs that do not require grad")
    return ("tensor", tuple(t.shape), t.stride(), t.dtype, t.device, t.data_ptr() % 16)


class Graphs:
    """A holder's graphs by signature, the oldest dropped past ``max_graphs``; ``sightings``
    counts the calls of signatures not captured yet (captured on the second)."""

    def __init__(self, max_graphs: int):
        if max_graphs < 1:
            raise ValueError(f"max_graphs must be at least 1, not {max_graphs}")
        self.max_graphs = max_graphs
        self.entries: collections.OrderedDict = collections.OrderedDict()
        self.sightings: collections.Counter = collections.Counter()
        self.refused: dict = {}
        self.pool = None  # the graphs' memory pool (torch.cuda.MemPool), made at first capture

    def __del__(self):
        # The graphs before their pool, whatever order a garbage collection of a reference
        # cycle takes (torch asks that a MemPool outlive the graphs captured into it; with the
        # order left to the collector, the GPU tests of graphed_decode met an illegal address
        # in a later kernel: docs/measurements.md).
        entries = self.__dict__.get("entries")
        if entries:
            entries.clear()

    def get(self, key) -> Optional[Captured]:
        entry = self.entries.get(key)
        if entry is not None:
            self.entries.move_to_end(key)
        return entry

    def seen_before(self, key) -> bool:
        """Whether ``key`` was called before (counting this call)."""
        if len(self.sightings) >= 16 * self.max_graphs:  # signatures seen once, long ago
            self.sightings.clear()
        self.sightings[key] += 1
        return self.sightings[key] > 1

    def store(self, key, entry: Captured) -> None:
        self.entries[key] = entry
        self.sightings.pop(key, None)
        while len(self.entries) > self.max_graphs:
            self.entries.popitem(last=False)

    def clear(self) -> None:
        self.entries.clear()
        self.sightings.clear()
        self.refused.clear()
        self.pool = None

    def pool_id(self):
        if self.pool is None:
            self.pool = torch.cuda.MemPool()
        return self.pool.id

    def pool_bytes(self) -> int:
        """What the graphs' pool holds from the device: its segments, in use or cached."""
        if self.pool is None:
            return 0
        return sum(segment["total_size"] for segment in self.pool.snapshot())


def capture(fn: Callable, inputs: list, spec, graphs: Graphs) -> Captured:
    """``fn`` called on the call rebuilt from the buffers ``inputs`` (``spec`` is its pytree),
    captured into a CUDA graph in ``graphs``' pool; not run (the caller replays). A host
    synchronization inside raises ``CaptureRefused`` naming it."""
    args, kwargs = pytree.tree_unflatten(inputs, spec)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    previous = torch.cuda.get_sync_debug_mode()
    try:
        # "thread_local": NCCL's watchdog thread may query its events meanwhile.
        with step_graphs.own_cublas_workspaces(), torch.cuda.graph(
                graph, pool=graphs.pool_id(), capture_error_mode="thread_local"):
            torch.cuda.set_sync_debug_mode("error")
            try:
                outputs = fn(*args, **kwargs)
            finally:
                torch.cuda.set_sync_debug_mode(previous)
    except Exception as error:
        why = _capture_failure(error)
        if why is None:
            raise
        raise CaptureRefused(why) from error
    return Captured(graph, inputs, outputs)


def _capture_failure(error: Exception) -> Optional[str]:
    """Why a capture failed, where the failure means "cannot be captured" rather than a bug of
    the step (which is raised as it is)."""
    text = str(error)
    if "synchroniz" in text or "capturing" in text or "capture" in text.lower():
        return ("the step synchronizes with the host while captured (a .item(), a nonzero, a "
                f"shape read from data, a copy to the CPU): {type(error).__name__}: "
                f"{text.splitlines()[0] if text else ''}"[:600])
    return None


def fill(entry: Captured, leaves: list) -> None:
    """Copies a call's tensors into the graph's input buffers."""
    for buffer, leaf in zip(entry.inputs, leaves):
        if isinstance(leaf, Tensor) and leaf is not buffer:
            buffer.copy_(leaf)


def static_inputs(leaves: list) -> list:
    """The graph's own copies of a call's tensors (its input buffers); other leaves as they
    are."""
    return [leaf.detach().clone() if isinstance(leaf, Tensor) else leaf for leaf in leaves]


DDP_WARMUP_STEPS = 11  # eager DDP steps before a capture (torch's notes on CUDA graphs)
# Distributed models (TP, DDP over NCCL) are graphed by the rules below; off refuses them all.
# On since their GPU tests passed on two H200s (docs/measurements.md, "Graphed distributed
# steps").
CAPTURE_DISTRIBUTED = True


def distributed_refusal(model: nn.Module) -> Optional[str]:
    """Why ``model``'s step cannot be graphed because of how it is distributed, or None (a
    model that is not distributed; with ``CAPTURE_DISTRIBUTED``, TP on a CUDA mesh over NCCL,
    or DDP over NCCL)."""
    if not CAPTURE_DISTRIBUTED and _distributed_kind(model):
        return (f"a {_distributed_kind(model)} model: graphed distributed steps are off "
                "(graphed_steps.CAPTURE_DISTRIBUTED); run the step ungraphed")
    if isinstance(model, nn.parallel.DistributedDataParallel):
        if model.find_unused_parameters:
            return ("a DistributedDataParallel model with find_unused_parameters=True: its "
                    "reducer finds the unused parameters on the host each step, which a replay "
                    "would skip; build it without, or run the step ungraphed")
        backend = _backend(model.process_group)
        if backend != "nccl":
            return (f"a DistributedDataParallel model over {backend}: only NCCL collectives "
                    "can be captured in a CUDA graph")
    for module in model.modules():
        if type(module).__name__.startswith(("FSDP", "FullyShardedDataParallel")):
            return ("an FSDP-sharded model (fully_shard): its unshard / reshard state machine "
                    "and the unsharded parameters' allocations run on the host around every "
                    "layer; run the step ungraphed")
    for parameter in model.parameters():
        mesh = getattr(parameter, "device_mesh", None)
        if mesh is None:
            continue
        if mesh.device_type != "cuda":
            return (f"tensor-parallel (DTensor) parameters on a {mesh.device_type} mesh: CUDA "
                    "graphs hold CUDA tensors only")
        backends = {_backend(group) for group in mesh.get_all_groups()}
        if backends != {"nccl"}:
            return (f"tensor-parallel (DTensor) parameters whose mesh talks over "
                    f"{', '.join(sorted(map(str, backends)))}: only NCCL collectives can be "
                    "captured in a CUDA graph")
        break
    if _nccl_too_old(model):
        return (f"NCCL {'.'.join(map(str, torch.cuda.nccl.version()))} cannot capture its "
                "collectives in a CUDA graph (2.9.6 or later can)")
    return None


def _distributed_kind(model: nn.Module) -> Optional[str]:
    if isinstance(model, nn.parallel.DistributedDataParallel):
        return "DistributedDataParallel"
    if any(type(m).__name__.startswith(("FSDP", "FullyShardedDataParallel"))
           for m in model.modules()):
        return "FSDP-sharded (fully_shard)"
    if any(hasattr(p, "placements") for p in model.parameters()):
        return "tensor-parallel (DTensor)"
    return None


def _backend(group) -> str:
    import torch.distributed as dist

    return str(dist.get_backend(group)).lower()


def _distributed(model: nn.Module) -> bool:
    return isinstance(model, nn.parallel.DistributedDataParallel) or any(
        hasattr(p, "device_mesh") for p in model.parameters())


def _nccl_too_old(model: nn.Module) -> bool:
    if not _distributed(model) or not torch.cuda.is_available():
        return False
    version = torch.cuda.nccl.version()
    return tuple(version)[:3] < (2, 9, 6)


def _ddp_ready(model: nn.Module, eager_steps: int) -> Optional[str]:
    """Why a DDP model's step is not captured yet (None: it may be): the warm-up, or a
    ``no_sync`` context (a replay would reduce the gradients all the same)."""
    if not isinstance(model, nn.parallel.DistributedDataParallel):
        return None
    if not model.require_backward_grad_sync:
        return "inside no_sync"
    if eager_steps < DDP_WARMUP_STEPS:
        return "warming up"
    return None


# Every graphed step and forward alive in this process, for reset_all.
_LIVE: "weakref.WeakSet[_Graphed]" = weakref.WeakSet()


_exit_hook: list = []


def _hold_collectives() -> None:
    """A graph now holds NCCL collectives: said once, and ``reset_all`` registered to run at
    interpreter exit (registered after torch's handlers, it runs before them)."""
    if _exit_hook:
        return
    import atexit

    from custom_kernels.core import fallback

    _exit_hook.append(atexit.register(reset_all))
    fallback.log_once("graphed steps hold NCCL collectives",
                      "call cutlass_ops.graphed_steps.reset_all() before "
                      "torch.distributed.destroy_process_group(), which waits for every graph "
                      "that captured a collective")


def reset_all() -> None:
    """Drops the graphs of every graphed step and forward alive in this process: call it before
    ``torch.distributed.destroy_process_group()``, which otherwise waits forever for the graphs
    holding captured NCCL collectives (see the module docstring)."""
    for holder in list(_LIVE):
        holder.reset()


class _Graphed:
    """What both wrappers share: the graphs, the refusal policy, the memory report."""

    def __init__(self, model: nn.Module, max_graphs: int, on_refusal: str):
        if on_refusal not in ("raise", "eager"):
            raise ValueError(f"on_refusal is 'raise' or 'eager', not {on_refusal!r}")
        _LIVE.add(self)
        self.model = model
        self.graphs = Graphs(max_graphs)
        self.on_refusal = on_refusal
        self.refusal = distributed_refusal(model)  # every call eager (or refused) when set
        if self.refusal is not None:
            self._refused(None, CaptureRefused(self.refusal))
        self._parameters = tuple(model.parameters())
        self._pointers = tuple(p.data_ptr() for p in self._parameters)

    def _store(self, key, entry: Captured) -> None:
        """Keeps a new capture; a distributed model's holds NCCL collectives (the exit rule)."""
        self.graphs.store(key, entry)
        if _distributed_kind(self.model):
            _hold_collectives()

    def _check_parameters(self) -> None:
        """Graphs read the parameters' memory: new parameters or new tensors in them
        (``load_state_dict(assign=True)``, ``to``) drop the graphs."""
        parameters = tuple(self.model.parameters())
        pointers = tuple(p.data_ptr() for p in parameters)
        if pointers != self._pointers or any(a is not b for a, b in
                                              zip(parameters, self._parameters)):
            self._parameters, self._pointers = parameters, pointers
            self.reset()

    def _refused(self, key, refusal: CaptureRefused):
        """Raises ``refusal`` (remembered under ``key``) or, with ``on_refusal="eager"``,
        logs it once: the caller then runs the call eagerly."""
        if key is not None:
            self.graphs.refused[key] = str(refusal)
        if self.on_refusal == "raise":
            raise refusal
        from custom_kernels.core.fallback import log_once

        log_once("a graphed step runs eagerly", str(refusal))

    def memory_bytes(self) -> int:
        """The device memory the graphs' pool holds: every captured signature's activations,
        gradients and temporaries (they share it)."""
        return self.graphs.pool_bytes()

    def reset(self) -> None:
        """Drops every graph (their memory returns to torch's allocator once unreferenced)."""
        self.graphs.clear()


class GraphedTrainStep(_Graphed):
    """See the module docstring and ``graphed_train_step``."""

    def __init__(self, model: nn.Module, optimizer: Optional[torch.optim.Optimizer],
                 loss_fn: Optional[Callable], max_graphs: int, on_refusal: str):
        super().__init__(model, max_graphs, on_refusal)
        self.optimizer = optimizer
        self.loss_fn = loss_fn or default_loss
        self.optimizer_captured = optimizer is not None and capturable(optimizer)
        self._hyperparameters = self._snapshot()
        self._warned = False
        self._eager_steps = 0  # DDP is captured after DDP_WARMUP_STEPS of them
        if self.refusal is None and isinstance(model, nn.parallel.DistributedDataParallel):
            # After its first 10 iterations the reducer times one in every N with CUDA events
            # read back on the host at the next forward: a capture landing there would fail.
            model._set_ddp_runtime_logging_sample_rate(2 ** 31 - 1)
        if optimizer is not None:
            optimizer.register_load_state_dict_post_hook(lambda *_: self.reset())

    def __call__(self, *args, **kwargs) -> Tensor:
        if self.refusal is not None:
            return self._eager(args, kwargs)
        if _ddp_ready(self.model, DDP_WARMUP_STEPS) is not None:
            self._refused(None, CaptureRefused(
                "a DistributedDataParallel step inside no_sync: a graphed step replaces the "
                "gradients and reduces them every call, so it cannot accumulate them"))
            return self._eager(args, kwargs)
        leaves, spec = pytree.tree_flatten((args, kwargs))
        try:
            key = signature(args, kwargs)
        except CaptureRefused as refusal:
            self._refused(None, refusal)
            return self._eager(args, kwargs)
        self._check_parameters()
        self._check_hyperparameters()
        entry = self.graphs.get(key)
        if entry is None:
            if key in self.graphs.refused:
                self._refused(key, CaptureRefused(self.graphs.refused[key]))
                return self._eager(args, kwargs)
            if not self.graphs.seen_before(key) or _ddp_ready(self.model, self._eager_steps):
                return self._eager(args, kwargs)
            entry = self._capture(key, leaves, spec)
            if entry is None:
                return self._eager(args, kwargs)
        else:
            fill(entry, leaves)
        entry.graph.replay()
        for parameter, grad in zip(self._parameters, entry.grads):
            parameter.grad = grad
        if self.optimizer is not None and not self.optimizer_captured:
            self.optimizer.step()
        return entry.outputs.clone()

    def _step(self, *args, **kwargs) -> Tensor:
        loss = self.loss_fn(self.model(*args, **kwargs))
        loss.backward()
        if self.optimizer_captured:
            self.optimizer.step()
        return loss.detach()

    def _eager(self, args, kwargs) -> Tensor:
        self._eager_steps += 1
        for parameter in self._parameters:
            parameter.grad = None
        loss = self._step(*args, **kwargs)
        if self.optimizer is not None and not self.optimizer_captured:
            self.optimizer.step()
        return loss

    def _capture(self, key, leaves, spec) -> Optional[Captured]:
        for parameter in self._parameters:
            parameter.grad = None  # the backward allocates this signature's own, in the pool
        try:
            entry = capture(self._step, static_inputs(leaves), spec, self.graphs)
        except CaptureRefused as refusal:
            for parameter in self._parameters:
                parameter.grad = None
            self._refused(key, refusal)
            return None
        entry.grads = [p.grad for p in self._parameters]
        self._store(key, entry)
        return entry

    def _snapshot(self) -> tuple:
        """The optimizer's hyperparameters that a capture freezes: its Python numbers."""
        if not self.optimizer_captured:
            return ()
        return tuple(tuple((name, value) for name, value in sorted(group.items())
                           if name != "params" and isinstance(value, (int, float, bool, tuple)))
                     for group in self.optimizer.param_groups)

    def _check_hyperparameters(self) -> None:
        now = self._snapshot()
        if now == self._hyperparameters:
            return
        if not self._warned:
            warnings.warn("an optimizer hyperparameter held as a Python number changed: the "
                          "graphed step is captured again (give lr as a CUDA tensor to avoid "
                          "recapturing)", stacklevel=3)
            self._warned = True
        self._hyperparameters = now
        self.reset()


class GraphedForward(_Graphed):
    """See the module docstring and ``graphed_forward``."""

    def __call__(self, *args, **kwargs):
        if self.refusal is not None:
            return self._forward(*args, **kwargs)
        leaves, spec = pytree.tree_flatten((args, kwargs))
        try:
            key = signature(args, kwargs)
        except CaptureRefused as refusal:
            self._refused(None, refusal)
            return self._forward(*args, **kwargs)
        self._check_parameters()
        entry = self.graphs.get(key)
        if entry is None:
            if key in self.graphs.refused:
                self._refused(key, CaptureRefused(self.graphs.refused[key]))
                return self._forward(*args, **kwargs)
            if not self.graphs.seen_before(key):
                return self._forward(*args, **kwargs)
            try:
                entry = capture(self._forward, static_inputs(leaves), spec, self.graphs)
            except CaptureRefused as refusal:
                self._refused(key, refusal)
                return self._forward(*args, **kwargs)
            self._store(key, entry)
        else:
            fill(entry, leaves)
        entry.graph.replay()
        return entry.outputs

    def _forward(self, *args, **kwargs):
        with torch.no_grad():
            return self.model(*args, **kwargs)


def default_loss(output) -> Tensor:
    """The loss of a model's output: a Hugging Face output's ``loss``, or a 0-d tensor itself."""
    loss = getattr(output, "loss", None)
    if loss is None and isinstance(output, Tensor) and output.dim() == 0:
        loss = output
    if not isinstance(loss, Tensor):
        raise CaptureRefused("the model's output has no loss (call it with labels, or pass "
                             "loss_fn=lambda output: ...)")
    return loss


def capturable(optimizer: torch.optim.Optimizer) -> bool:
    """Whether every parameter group of ``optimizer`` is built for capture
    (``capturable=True``)."""
    return all(group.get("capturable", False) for group in optimizer.param_groups)


def graphed_train_step(model: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None, *,
                       loss_fn: Optional[Callable] = None, max_graphs: int = DEFAULT_MAX_GRAPHS,
                       on_refusal: str = "raise") -> GraphedTrainStep:
    """``step(*args, **kwargs)``: ``loss_fn(model(*args, **kwargs))`` (default: the output's
    ``loss``), its backward and ``optimizer.step()`` as one CUDA graph per signature; returns
    the loss. See the module docstring for what is captured, when, and what is refused."""
    return GraphedTrainStep(model, optimizer, loss_fn, max_graphs, on_refusal)


def graphed_forward(model: nn.Module, *, max_graphs: int = DEFAULT_MAX_GRAPHS,
                    on_refusal: str = "raise") -> GraphedForward:
    """``forward(*args, **kwargs)``: ``model(*args, **kwargs)`` under no_grad as one CUDA graph
    per signature; returns the graph's own outputs (overwritten by the next call of the same
    signature)."""
    return GraphedForward(model, max_graphs, on_refusal)


__all__ = ["CaptureRefused", "GraphedTrainStep", "GraphedForward", "graphed_train_step",
           "graphed_forward", "signature", "capturable", "default_loss", "distributed_refusal",
           "reset_all"]
