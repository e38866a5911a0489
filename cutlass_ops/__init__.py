"""cutlass-ops: tuned CUTLASS GEMMs and the kernels around them, for PyTorch on Hopper.

Importing this package does nothing else: no CUDA initialization, no files, no cutlass_cppgen.
CPU tensors: ``matmul``, ``explain``, ``nn`` and ``convert``ed models run torch; ``gemm`` and
``plan``, which name a kernel, raise UnsupportedInputError (the rule of every public entry point
is written in ``custom_kernels.core.fallback``).
"""

from custom_kernels.core.version import __version__
from cutlass_ops.gemms.config import (Activation, Arch, BiasMode, DType, Epilogue, EpilogueSchedule,
                                GemmConfig, GemmOperands, GemmProblem, KernelSchedule, Layout,
                                RasterOrder, TileScheduler)
from custom_kernels.core.errors import (BuildError, CutlassOpsError, EmissionError, InvalidConfigError,
                                KernelLaunchError, ToolchainError, UnsupportedInputError)


def gemm(a, b, c=None, *, alpha=1.0, beta=0.0, bias=None, activation="identity", config,
         out=None, out_dtype=None):
    """D = activation(alpha * (a @ b) + bias) + beta * c with one chosen CUTLASS config (see
    cutlass_ops.gemms.plan.gemm)."""
    from cutlass_ops.gemms.plan import gemm as _gemm

    return _gemm(a, b, c, alpha=alpha, beta=beta, bias=bias, activation=activation,
                 config=config, out=out, out_dtype=out_dtype)


def plan(a, b, c=None, *, alpha=1.0, beta=0.0, bias=None, activation="identity", config,
         out=None, out_dtype=None):
    """Checks once and returns ``launch()`` for repeated runs (see cutlass_ops.gemms.plan)."""
    from cutlass_ops.gemms.plan import plan as _plan

    return _plan(a, b, c, alpha=alpha, beta=beta, bias=bias, activation=activation,
                 config=config, out=out, out_dtype=out_dtype)


def matmul(a, b, *, out_dtype=None, bias=None, activation="identity", residual=None, alpha=1.0,
           beta=1.0):
    """activation(alpha * (a @ b) + bias) + beta * residual on the tuned CUTLASS kernel for this
    GPU, shape and epilogue: an exact tuning-cache hit, else the nearest tuned shape's kernel,
    else the best already-built kernel, else torch (with one log line saying why); an epilogue
    without a fused kernel runs after the plain GEMM, in torch. See cutlass_ops.gemms.dispatch."""
    return _dispatch().matmul(a, b, out_dtype=out_dtype, bias=bias, activation=activation,
                              residual=residual, alpha=alpha, beta=beta)


def explain(a, b, *, out_dtype=None, bias=None, activation="identity", residual=None):
    """What ``matmul(a, b, ...)`` runs and why: a Decision(source, choice, reason)."""
    return _dispatch().explain(a, b, out_dtype=out_dtype, bias=bias, activation=activation,
                               residual=residual)


_dispatch_module = None


def _dispatch():
    # A global read on the warm call: an import statement here costs more than the rest of
    # matmul's Python entry (docs/measurements.md, "Whole calls through the compiled host path").
    global _dispatch_module
    if _dispatch_module is None:  # first call: import it (and torch) now, not at package import
        import cutlass_ops.gemms.dispatch as module

        _dispatch_module = module
    return _dispatch_module


def scaled_mm(a, b, scale_a, scale_b, *, bias=None, out_dtype=None, use_fast_accum=False):
    """FP8 ``(a * scale_a) @ (b * scale_b) + bias`` with torch._scaled_mm's meaning, the recipe
    (tensorwise, rowwise, blockwise) read from the scales' shapes (see
    cutlass_ops.fp8.scaled_mm_op)."""
    import torch

    from cutlass_ops.fp8.scaled_mm_op import scaled_mm as _scaled_mm

    return _scaled_mm(a, b, scale_a, scale_b, bias=bias, use_fast_accum=use_fast_accum,
                      out_dtype=torch.bfloat16 if out_dtype is None else out_dtype)


def scaled_grouped_mm(a, b, scale_a, scale_b, offs, *, out_dtype=None):
    """FP8 grouped GEMMs, an MoE layer's forward: ``(a * scale_a) @ (b * scale_b)`` an expert at
    a time in torch._scaled_grouped_mm's 2d-3d form, rowwise or blockwise scales (see
    cutlass_ops.fp8.scaled_grouped_mm_op)."""
    import torch

    from cutlass_ops.fp8.scaled_grouped_mm_op import scaled_grouped_mm as _scaled_grouped_mm

    return _scaled_grouped_mm(a, b, scale_a, scale_b, offs,
                              out_dtype=torch.bfloat16 if out_dtype is None else out_dtype)


def linear_cross_entropy(hidden, weight, labels, **options):
    """Cross-entropy of the LM head ``hidden @ weight.T`` against ``labels`` without
    materializing the logits (see cutlass_ops.fused_cross_entropy)."""
    from cutlass_ops.fused_cross_entropy import linear_cross_entropy as _loss

    return _loss(hidden, weight, labels, **options)


def vocab_parallel_linear_cross_entropy(hidden, weight_shard, labels, **options):
    """``linear_cross_entropy`` with the head's rows sharded across the ranks of a process group
    (tensor parallelism; see cutlass_ops.parallel.vocab_parallel_loss)."""
    from cutlass_ops.parallel.vocab_parallel_loss import vocab_parallel_linear_cross_entropy as _loss

    return _loss(hidden, weight_shard, labels, **options)


def grouped_mm(a, b, offs=None, *, out_dtype=None):
    """One GEMM per group (mixture-of-experts experts) with torch._grouped_mm's semantics, with
    autograd (see cutlass_ops.moe.grouped for the forms and the offsets)."""
    from cutlass_ops.moe.grouped import grouped_mm as _grouped_mm

    return _grouped_mm(a, b, offs, out_dtype=out_dtype)


def convert(model, config=None, **options):
    """Swaps a model's Linear layers, norms, decoder blocks, experts and loss for ours in place
    where our kernels apply; returns a report of every layer and why. Options: a
    ``cutlass_ops.nn.ConvertConfig``, or its fields as keywords."""
    from cutlass_ops.nn import convert as _convert

    return _convert(model, config, **options)


def graphed_train_step(model, optimizer=None, **options):
    """The model's train step (forward, loss, backward, and the optimizer step where it is
    capturable) replayed as one CUDA graph per input signature, without torch.compile; call it
    with the model's arguments, it returns the loss (see cutlass_ops.graphed_steps)."""
    from cutlass_ops.graphed_steps import graphed_train_step as _graphed

    return _graphed(model, optimizer, **options)


def graphed_forward(model, **options):
    """The model's inference forward replayed as one CUDA graph per input signature (see
    cutlass_ops.graphed_steps)."""
    from cutlass_ops.graphed_steps import graphed_forward as _graphed

    return _graphed(model, **options)


def generate(model, input_ids, **options):
    """Greedy ``generate()`` of a Hugging Face causal LM with a static KV cache, each decode step
    one CUDA graph and the token loop on the device (see cutlass_ops.graphed_decode)."""
    from cutlass_ops.graphed_decode import generate as _generate

    return _generate(model, input_ids, **options)


def __getattr__(name):
    # cutlass_ops.nn and cutlass_ops.ops import torch and register the custom ops: only on use.
    if name in ("nn", "ops"):
        import importlib

        return importlib.import_module(f"cutlass_ops.{name}")
    raise AttributeError(f"module 'cutlass_ops' has no attribute {name!r}")


__all__ = [
    "__version__", "gemm", "plan", "matmul", "explain", "convert", "linear_cross_entropy",
    "vocab_parallel_linear_cross_entropy",
    "grouped_mm", "graphed_train_step", "graphed_forward", "generate",
    "Activation", "Arch",
    "BiasMode", "DType", "Epilogue",
    "EpilogueSchedule", "GemmConfig",
    "GemmOperands", "GemmProblem", "KernelSchedule", "Layout", "RasterOrder", "TileScheduler",
    "BuildError",
    "CutlassOpsError", "EmissionError", "InvalidConfigError", "KernelLaunchError",
    "ToolchainError", "UnsupportedInputError",
]
