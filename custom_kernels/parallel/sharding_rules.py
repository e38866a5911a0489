"""DTensor sharding rules for this package's custom ops: norms, rotary and SwiGLU.

With DTensor inputs (torch's tensor-parallel styles: ColwiseParallel, RowwiseParallel,
SequenceParallel) the public functions call the ``custom_kernels::*`` ops, and DTensor needs a
sharding strategy for each: without one it raises, and a fallback that gathers the inputs
(``full_tensor()``) would add a collective the unconverted model never runs. Each rule lists
the (output placements, input placements) pairs under which the op is exact on each rank's
local tensors, so that DTensor runs it locally and redistributes only inputs that match none:

* norms: the statistics are per row, so activations sharded on any dimension but the normalized
  last one stay local (outputs and per-row statistics sharded alike, weight and bias
  replicated). The backward's weight / bias gradients sum over rows, so with sharded rows each
  rank holds a partial sum: ``Partial()``, reduced where torch reduces any parameter gradient.
  A last-dimension shard needs the whole row: no local rule, DTensor gathers it.
* rotary: q / k ``[B, S, H, D]`` sharded on batch, sequence or heads stay local; cos / sin
  ``[B or 1, S, D]`` are per position, so they are sharded on the sequence alongside (on batch
  too when they have one row per batch entry) and replicated otherwise. The outputs are
  ``[B, H, S, D]``: sequence and heads trade places. The head size is rotated in halves: not
  shardable.
* swiglu: ``gate_up [..., 2I]`` is split in halves on its last dimension, so any other dimension
  shards; the last does not (a Colwise merged projection whose shards hold [gate_r, up_r] each
  is a layout question for the plan, not for this rule).

Every rule also offers the all-replicated strategy. The op modules call ``register`` after
defining their ops; ``cutlass_ops.gemm_sharding_rules`` registers its GEMM ops' rules through it too. ``torch.distributed.tensor`` costs about 0.4 s to import (six times the
ops' modules), and a DTensor cannot exist before it is imported: so the rules are registered at
once when it is loaded, else right after it is (an import hook that removes itself).
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys

import torch

_DTENSOR = "torch.distributed.tensor"
_pending: list[tuple] = []  # (namespace, name, rule, static_from)


# ---------------------------------------------------------------------------------------------
# Rules: each takes the op's arguments (tensors as DTensor's spec objects with ``.ndim`` /
# ``.shape``) and returns [(output placements, input placements), ...], one placement per
# argument (None for a non-tensor or an absent optional tensor).
# ---------------------------------------------------------------------------------------------

def _placements():
    from torch.distributed.tensor import Partial, Replicate, Shard

    return Partial, Replicate, Shard


def _opt(t, placement):
    """The placement of an optional tensor argument: None when it is absent."""
    return None if t is None else placement


def _rms_fwd(x, weight, residual, eps, out_dtype, config=None):
    _, R, S = _placements()
    # Outputs: y, new residual (an empty tensor without one: replicated), rstd [rows...].
    rules = [([R(), R(), R()], [R(), R(), _opt(residual, R()), None, None, None])]
    for d in range(x.ndim - 1):
        res = S(d) if residual is not None else R()
        rules.append(([S(d), res, S(d)], [S(d), R(), _opt(residual, S(d)), None, None, None]))
    return rules


def _rms_bwd(dy, h, weight, rstd, d_residual_out, config=None):
    P, R, S = _placements()
    rules = [([R(), R()], [R(), R(), R(), R(), _opt(d_residual_out, R()), None])]
    for d in range(h.ndim - 1):
        rules.append(([S(d), P()],
                      [S(d), S(d), R(), S(d), _opt(d_residual_out, S(d)), None]))
    return rules


def _ln_fwd(x, weight, bias, residual, eps, out_dtype, config=None):
    _, R, S = _placements()
    # Outputs: y, new residual (or an empty tensor), mean, rstd.
    rules = [([R(), R(), R(), R()], [R(), R(), R(), _opt(residual, R()), None, None, None])]
    for d in range(x.ndim - 1):
        res = S(d) if residual is not None else R()
        rules.append(([S(d), res, S(d), S(d)],
                      [S(d), R(), R(), _opt(residual, S(d)), None, None, None]))
    return rules


def _ln_bwd(dy, h, weight, mean, rstd, d_residual_out, config=None):
    P, R, S = _placements()
    rules = [([R(), R(), R()], [R(), R(), R(), R(), R(), _opt(d_residual_out, R()), None])]
    for d in range(h.ndim - 1):
        rules.append(([S(d), P(), P()],
                      [S(d), S(d), R(), S(d), S(d), _opt(d_residual_out, S(d)), None]))
    return rules


def _per_position(cos, batch: int, d: int):
    """cos / sin [B or 1, S, D] when q / k [B, S, H, D] are sharded on ``d``."""
    _, R, S = _placements()
    if d == 1 or (d == 0 and cos.shape[0] == batch and batch > 1):
        return S(d)
    return R()  # heads, or a batch of q / k against a cos / sin of batch 1


def _rotary_fwd(q, k, cos, sin):
    _, R, S = _placements()
    rules = [([R(), R()], [R(), R(), R(), R()])]
    # [B, S, H, D] in, [B, H, S, D] out: batch stays, sequence and heads swap.
    for d_in, d_out in ((0, 0), (1, 2), (2, 1)):
        c = _per_position(cos, q.shape[0], d_in)
        rules.append(([S(d_out), S(d_out)], [S(d_in), S(d_in), c, c]))
    return rules


def _rotary_bwd(dq_out, dk_out, cos, sin):
    _, R, S = _placements()
    # An absent gradient comes back as an empty tensor: replicated.
    rules = [([R(), R()], [_opt(dq_out, R()), _opt(dk_out, R()), R(), R()])]
    given = dq_out if dq_out is not None else dk_out
    if given is None:
        return rules
    # [B, H, S, D] in, [B, S, H, D] out.
    for d_in, d_out in ((0, 0), (2, 1), (1, 2)):
        c = _per_position(cos, given.shape[0], d_out)
        out = [S(d_out) if g is not None else R() for g in (dq_out, dk_out)]
        rules.append((out, [_opt(dq_out, S(d_in)), _opt(dk_out, S(d_in)), c, c]))
    return rules


def _swiglu_fwd(gate_up):
    _, R, S = _placements()
    return [([R()], [R()])] + [([S(d)], [S(d)]) for d in range(gate_up.ndim - 1)]


def _swiglu_bwd(dy, gate_up):
    _, R, S = _placements()
    return [([R()], [R(), R()])] + [([S(d)], [S(d), S(d)]) for d in range(gate_up.ndim - 1)]


# One table: op name in the custom_kernels namespace -> its rule.
RULES = {
    "rms_norm_fwd": _rms_fwd, "rms_norm_bwd": _rms_bwd,
    "layer_norm_fwd": _ln_fwd, "layer_norm_bwd": _ln_bwd,
    "rotary_fwd": _rotary_fwd, "rotary_bwd": _rotary_bwd,
    "swiglu_fwd": _swiglu_fwd, "swiglu_bwd": _swiglu_bwd,
}


# ---------------------------------------------------------------------------------------------
# Registration
# ---------------------------------------------------------------------------------------------

def register(*names: str, namespace: str = "custom_kernels", rules=None,
             static_from=None) -> None:
    """Registers the rules of the named ops (defined already) with DTensor: now when
    ``torch.distributed.tensor`` is loaded, else right after it is. Nothing without
    torch.distributed (a build without it has no DTensor to serve). ``namespace`` / ``rules``:
    another package's ops and its table (cutlass_ops.gemm_sharding_rules); ``static_from``: op name -> the
    index of its first non-tensor argument that changes the rule's answer (DTensor caches a
    strategy by the input placements and, from that index on, the other arguments; by default
    only int arguments are in the key, so a str or bool the rule reads must be named here)."""
    if not torch.distributed.is_available():
        return
    table = RULES if rules is None else rules
    entries = [(namespace, n, table[n], (static_from or {}).get(n)) for n in names]
    if _DTENSOR in sys.modules:
        _register_now(entries)
        return
    _pending.extend(entries)
    if not any(isinstance(f, _AfterDTensorImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterDTensorImport())


def _register_now(entries) -> None:
    try:
        from torch.distributed.tensor import DTensor
        from torch.distributed.tensor._op_schema import RuntimeSchemaInfo
        from torch.distributed.tensor.experimental import register_sharding
    except ImportError:  # a torch without the experimental API: DTensor keeps its own rules
        return
    for namespace, name, rule, static in entries:
        overload = getattr(getattr(torch.ops, namespace), name).default
        register_sharding(overload)(rule)
        if static is not None:  # the documented way to widen the cache key (register_op_strategy)
            DTensor._op_dispatcher.sharding_propagator.op_to_schema_info[overload] = \
                RuntimeSchemaInfo(static_argnum=static, needs_pytree=True)


class _AfterDTensorImport(importlib.abc.MetaPathFinder):
    """Finds ``torch.distributed.tensor`` with the other finders and wraps its loader so that,
    once the module has run, the pending rules are registered; then leaves ``sys.meta_path``."""

    def find_spec(self, name, path=None, target=None):
        if name != _DTENSOR:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            entries = tuple(_pending)
            _pending.clear()
            _register_now(entries)

        spec.loader.exec_module = exec_module  # this spec's own loader instance
        return spec
