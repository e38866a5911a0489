"""CUDA graphs for the host-bound stretches of a decode step.

At a decode step (one or a few tokens per sequence) a fused decoder layer's kernels take a few
microseconds each on the GPU, and launching them from Python takes longer: the step is bound by
the host. Between the attention calls, though, a layer's work has fixed shapes for the whole of a
``generate()``: the input norm, the merged QKV GEMM and the rotary kernel before the attention;
o_proj, the norm, the gate+up GEMM, SwiGLU and down_proj after it. ``Segment`` captures such a
stretch once per input signature into a CUDA graph and replays it: one launch and a copy of the
inputs into the graph's own buffers instead of the stretch's Python and launches. The attention
and the KV cache, whose shapes grow every step, stay outside, as the model runs them.

What a replay returns is the graph's own output buffer, overwritten by the next replay: the
caller copies what outlives the call (``Segment.__call__`` returns the buffers; the fused layer
clones the layer output it hands back). Inputs are copied into the graph's buffers before each
replay; ``SharedInputs`` holds the rotary cos / sin that every layer of a step reads, copied once
per step (the same tensor object at the same version is not copied again).

When graphs are used (``eligible``): gradients off, not under torch.compile or inside a capture,
plain CUDA tensors, at most ``MAX_ROWS`` token rows of at most ``MAX_TOKENS`` per sequence.
``CUTLASS_OPS_STEP_GRAPHS=0`` turns them off. A signature is run eagerly the first time it is
seen (that call also loads the kernels and resolves the GEMM routes) and captured the second time;
a holder keeps at most ``MAX_GRAPHS`` of them, dropping the oldest. The kernels a graph replays
are those the GEMM dispatch chose at capture: a tune later in the process applies to graphs
captured after it.
"""

from __future__ import annotations

import collections
import contextlib
import os
from typing import Callable, Optional, Sequence

import torch
from torch import Tensor

from custom_kernels.core.eager import plain_eager
from custom_kernels.launch import current_stream_handle

MAX_TOKENS = 16  # per sequence: decoding, speculative decoding's few tokens
MAX_ROWS = 256  # tokens in all; past this the GPU's work hides the launches
MAX_GRAPHS = 8  # per holder (a layer): decode batch sizes seen in one process


_paused = 0


def enabled() -> bool:
    return not _paused and os.environ.get("CUTLASS_OPS_STEP_GRAPHS", "1") != "0"


@contextlib.contextmanager
def paused():
    """No graphs are captured or replayed inside (``convert``'s probes: calls of shapes a model
    will not see again)."""
    global _paused
    _paused += 1
    try:
        yield
    finally:
        _paused -= 1


def eligible(hidden_states: Tensor, *others: Optional[Tensor]) -> bool:
    """Whether a call on ``hidden_states`` [B, S, H] (and ``others``) may replay a graph."""
    if torch.is_grad_enabled() or hidden_states.dim() != 3 or not hidden_states.is_cuda:
        return False
    batch, tokens = hidden_states.shape[0], hidden_states.shape[1]
    if tokens > MAX_TOKENS or batch * tokens > MAX_ROWS or batch * tokens == 0:
        return False
    if torch.compiler.is_compiling() or not plain_eager(hidden_states, *others):
        return False
    # Graphs are captured and replayed on the current device's streams: tensors elsewhere run
    # eagerly.
    return enabled() and hidden_states.device.index == torch.cuda.current_device() and \
        not torch.cuda.is_current_stream_capturing()


def signature(*tensors: Tensor) -> tuple:
    """What a graph's validity depends on, of its inputs: shapes, strides, dtypes, devices,
    16-byte alignment (the kernels' vector paths), the stream, and inference mode (whose tensors
    cannot be written outside it)."""
    device = tensors[0].device
    stream = current_stream_handle(device.index) if device.type == "cuda" else 0
    return (tuple((t.shape, t.stride(), t.dtype, t.data_ptr() % 16) for t in tensors),
            device, stream, torch.is_inference_mode_enabled())


@contextlib.contextmanager
def own_cublas_workspaces():
    """Around a capture: cuBLAS's workspaces dropped before it and after it, as Inductor's CUDA
    graph trees do around theirs. torch keeps one workspace per (handle, stream), the first
    matmul on a stream allocating it, and a graph bakes its address in. Dropped before, the
    captured matmuls allocate theirs inside the capture, so in the graph's own pool, which lives
    as long as the graph (one made earlier could be anyone's memory, and Inductor drops them all
    around its own recordings). Dropped after, no later capture on the same stream bakes this
    graph's workspace in, which would outlive it when this graph goes."""
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)  # absent from CPU builds
    if clear is not None:
        clear()
    try:
        yield
    finally:
        if clear is not None:
            clear()


class Segment:
    """``fn()`` captured into a CUDA graph: ``fn`` reads ``inputs`` (buffers owned here, filled
    by ``__call__``) and returns a tensor or a tuple of tensors, the graph's outputs."""

    def __init__(self, fn: Callable[[], object], inputs: Sequence[Tensor]):
        self.inputs = tuple(inputs)
        # Warm up on a side stream, as torch.cuda.graphs asks (lazy initialisations, cuBLAS
        # workspaces), then capture.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with own_cublas_workspaces(), torch.cuda.graph(self.graph):
            self.outputs = fn()

    def __call__(self, *values: Tensor):
        """Copies ``values`` into the input buffers (those given as None are left as they are),
        replays, and returns the output buffers."""
        for buffer, value in zip(self.inputs, values):
            if value is not None and value is not buffer:
                buffer.copy_(value)
        self.graph.replay()
        return self.outputs


class SharedInputs:
    """Buffers that several segments read, per (signature, key): filled once per distinct
    tensor (the same object at the same version is not copied again)."""

    def __init__(self):
        self._buffers: dict = {}

    def get(self, key, tensors: Sequence[Tensor]) -> tuple[Tensor, ...]:
        full = (key, signature(*tensors))
        entry = self._buffers.get(full)
        if entry is None:
            entry = self._buffers[full] = [tuple(t.clone() for t in tensors), None]
        buffers, seen = entry
        # Inference tensors keep no version counter: they are copied every time.
        now = tuple((t, -1 if t.is_inference() else t._version) for t in tensors)
        if seen is None or any(a is not b or va != vb or va < 0
                               for (a, va), (b, vb) in zip(now, seen)):
            for buffer, t in zip(buffers, tensors):
                buffer.copy_(t)
            entry[1] = now  # holds the tensors: an id seen here cannot be reused meanwhile
        return buffers


shared = SharedInputs()


EAGER = object()  # a key whose capture failed: it runs eagerly


class Holder:
    """A module's graphs by key: ``lookup`` says whether to run eagerly (first sighting), replay
    (a graph exists) or capture (second sighting); ``weights`` is part of every key's validity
    (the data pointers a graph reads): when it changes, every graph is dropped."""

    def __init__(self):
        self.graphs: collections.OrderedDict = collections.OrderedDict()
        self.seen: set = set()
        self.weights: tuple = ()

    def __deepcopy__(self, memo):
        return Holder()  # a copied module starts without graphs (they read this one's memory)

    def __reduce__(self):
        return Holder, ()

    def lookup(self, key, weights: tuple):
        """The graphs kept under ``key``, or None: then ``should_capture`` says what to do."""
        if weights != self.weights:
            self.graphs.clear()
            self.seen.clear()
            self.weights = weights
        found = self.graphs.get(key)
        if found is not None:
            self.graphs.move_to_end(key)
        return found

    def should_capture(self, key) -> bool:
        if key in self.seen:
            return True
        if len(self.seen) >= 4 * MAX_GRAPHS:  # signatures seen once, long ago
            self.seen.clear()
        self.seen.add(key)
        return False

    def capture(self, key, make: Callable[[], object]):
        """``make()``'s graphs, kept under ``key``; when the capture fails (an operation a
        graph cannot hold), None, and the key runs eagerly from then on (logged once)."""
        try:
            graphs = make()
        except Exception as exc:  # noqa: BLE001 - any failure means: run this eagerly
            from custom_kernels.core.fallback import log_once

            log_once("a decode step runs without CUDA graphs",
                     f"capturing it failed: {type(exc).__name__}: {exc}")
            self.store(key, EAGER)
            return None
        self.store(key, graphs)
        return graphs

    def store(self, key, graphs) -> None:
        self.graphs[key] = graphs
        while len(self.graphs) > MAX_GRAPHS:
            self.graphs.popitem(last=False)


__all__ = ["Segment", "SharedInputs", "Holder", "eligible", "signature", "enabled", "shared",
           "MAX_TOKENS", "MAX_ROWS", "MAX_GRAPHS"]
