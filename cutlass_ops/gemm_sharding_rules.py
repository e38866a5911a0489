"""DTensor sharding rules for the GEMM family's custom ops: ``cutlass_ops::mm``, ``::linear``,
``::merged_linear`` (with its backward) and ``::linear_residual``.

The public functions (``ops.linear_fast``, ``fused_linear.merged_linear`` / ``linear_residual``)
send DTensor inputs to these ops; each rule lists the (output placements, input placements)
pairs under which the op is exact on each rank's local tensors, so that DTensor runs it locally
and redistributes only inputs that match none. ``custom_kernels.parallel.sharding_rules`` registers them (the
same deferred registration as the norms'). For y = x W^T + b, x [..., K], W [N, K]:

* ColwiseParallel: W and b Shard(0) (out features), x replicated -> y Shard(-1).
* RowwiseParallel: x Shard(-1), W Shard(1) (in features) -> y Partial(): each rank holds a
  partial sum, reduced where the plan reduces it (RowwiseParallel's output all-reduce), not in
  the op. The bias must then be added once: the rule takes it ``Partial()``, as torch's own
  ``aten.addmm`` rule does, so DTensor turns a replicated bias into b / world on each rank (no
  collective). Only without an activation: act(partial) summed is not act(sum).
* x sharded on any dimension but the last (batch, sequence), weights replicated -> y sharded
  alike (data / sequence parallel). All replicated, too.
* mm (a @ b): torch's ``aten.mm`` strategies (rows, columns, contraction -> Partial).

``merged_linear`` (x @ cat(W_q, W_k, W_v)^T, one GEMM) offers no Colwise strategy: with each
weight Shard(0), rank r computes [q_r, k_r, v_r], while Shard(-1) of the global [q, k, v] would
be a contiguous slice of it (rank 0: all of q and half of k for three equal weights on two
ranks). No output placement describes the per-rank layout, so DTensor gathers the weights
instead (a collective per call; the result stays right). A plan that wants a local merged
Colwise projection needs one merged weight per rank laid out interleaved, [q_r, k_r, v_r] on
rank r, and must split the local output itself; that is the plan's layout, not this rule's.
Rowwise (x Shard(-1), every weight Shard(1)) is exact: the contraction shards concatenate.

``linear_residual`` (x W^T + b + residual): Rowwise would add the residual on every rank into a
partial sum, so it is not offered (DTensor redistributes; a Rowwise o_proj should add the
residual after the plan's reduction). Colwise is exact with the residual sharded on the output
features alongside, batch / sequence sharding with the residual sharded alike.

Backward: ``merged_linear_backward`` (also ``linear_residual``'s, with one weight): with x and
dY sharded on rows and the weights replicated, dX is sharded alike and dW (a sum over the rows)
is Partial(); Rowwise gives dX Shard(-1) and dW Shard(1); Colwise (one weight only) dX Partial()
and dW Shard(0). ``linear``'s backward runs through ``mm`` on rows flattened to 2-D: local for
Colwise, Rowwise and batch shards, but flattening [B, S] makes DTensor gather a sequence shard
first (a collective in the backward; the gradients stay right).
"""

from __future__ import annotations

from custom_kernels.parallel import sharding_rules as _base

_opt = _base._opt


def _placements():
    from torch.distributed.tensor import Partial, Replicate, Shard

    return Partial, Replicate, Shard


def _mm(a, b):
    P, R, S = _placements()
    return [([R()], [R(), R()]), ([S(0)], [S(0), R()]), ([S(1)], [R(), S(1)]),
            ([P()], [S(1), S(0)])]


def _linear(x, weight, bias=None, activation="identity"):
    P, R, S = _placements()
    last = x.ndim - 1
    rules = [([R()], [R(), R(), _opt(bias, R()), None]),
             ([S(last)], [R(), S(0), _opt(bias, S(0)), None])]  # Colwise
    if activation == "identity":  # Rowwise: partial sums, the bias added once
        rules.append(([P()], [S(last), S(1), _opt(bias, P()), None]))
    rules += [([S(d)], [S(d), R(), _opt(bias, R()), None]) for d in range(last)]
    return rules


def _merged(x, weights, bias):
    P, R, S = _placements()
    n, last = len(weights), x.ndim - 1
    rules = [([R()], [R(), *[R()] * n, _opt(bias, R())]),
             ([P()], [S(last), *[S(1)] * n, _opt(bias, P())])]  # Rowwise; no Colwise (above)
    rules += [([S(d)], [S(d), *[R()] * n, _opt(bias, R())]) for d in range(last)]
    return rules


def _merged_backward(grad, x, weights, need_x, need_w):
    P, R, S = _placements()
    n, last = len(weights), x.ndim - 1

    def out(gx, gw):  # a gradient not needed comes back as an empty tensor: replicated
        return [gx if need_x else R(), gw if need_w else R()]

    rules = [(out(R(), R()), [R(), R(), *[R()] * n, None, None]),
             (out(S(last), S(1)), [R(), S(last), *[S(1)] * n, None, None])]  # Rowwise
    if n == 1:  # Colwise, one weight (linear_residual's backward); not exact for a concatenation
        rules.append((out(P(), S(0)), [S(last), R(), S(0), None, None]))
    rules += [(out(S(d), P()), [S(d), S(d), *[R()] * n, None, None]) for d in range(last)]
    return rules


def _residual(x, weight, bias, residual):
    _, R, S = _placements()
    last = x.ndim - 1
    rules = [([R()], [R(), R(), _opt(bias, R()), R()]),
             ([S(last)], [R(), S(0), _opt(bias, S(0)), S(last)])]  # Colwise, residual alike
    rules += [([S(d)], [S(d), R(), _opt(bias, R()), S(d)]) for d in range(last)]
    return rules


# One table: op name in the cutlass_ops namespace -> its rule.
RULES = {"mm": _mm, "linear": _linear, "merged_linear": _merged,
         "merged_linear_backward": _merged_backward, "linear_residual": _residual}
# The index of the first non-tensor argument a rule reads (DTensor's cache key must hold it).
STATIC_FROM = {"linear": 3, "merged_linear_backward": 3}


def register(*names: str) -> None:
    """Registers the named ops' rules (the ops defined already) with DTensor."""
    _base.register(*names, namespace="cutlass_ops", rules=RULES, static_from=STATIC_FROM)
