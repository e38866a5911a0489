"""cutlass_ops.gemm_sharding_rules on the CPU: two gloo ranks, a 1-D mesh, DTensor inputs laid out as torch's
tensor-parallel styles lay them (ColwiseParallel: W Shard(0); RowwiseParallel: x Shard(-1), W
Shard(1); sequence parallel: x Shard(1), W replicated) through the public functions
(``ops.linear_fast``, ``fused_linear.merged_linear`` / ``linear_residual``), which hand DTensors to
the custom ops. Outputs have the expected placements (Rowwise stays Partial: no all-reduce inside
the op), equal torch's computation on the whole tensors (gradients too), and CommDebugMode counts
no collective in the forward of the local strategies. Layouts with no exact local strategy
(Colwise merged weights, Rowwise with a residual or an activation) are redistributed by DTensor
and still right.

The ops' own implementations launch CUDA kernels; the workers give them CPU kernels (the torch
formulas below), so that the sharding rules, the only thing under test, run without a GPU.
"""

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from gloo_ranks import on_ranks  # noqa: E402

B, S, K, N = 2, 4, 8, 6
ROWS = (6, 2, 2)  # merged q, k, v out features


# ---------------------------------------------------------------------------------------------
# CPU kernels for the custom ops, registered in the workers only
# ---------------------------------------------------------------------------------------------

def _linear(x, weight, bias=None, activation="identity"):
    from cutlass_ops.gemms import epilogues

    return epilogues.activate(F.linear(x, weight, bias), activation).contiguous()


def _merged_backward(grad, x, weights, need_x, need_w):
    w = torch.cat(weights)
    rows = grad.reshape(-1, grad.shape[-1])
    gx = (rows @ w).reshape(x.shape) if need_x else grad.new_empty(0)
    gw = rows.t() @ x.reshape(-1, x.shape[-1]) if need_w else grad.new_empty(0)
    return gx, gw


CPU_KERNELS = {
    "mm": lambda a, b: a @ b, "linear": _linear,
    "merged_linear": lambda x, ws, b: F.linear(x, torch.cat(ws), b),
    "merged_linear_backward": _merged_backward,
    "linear_residual": lambda x, w, b, r: F.linear(x, w, b) + r,
}


# ---------------------------------------------------------------------------------------------
# Cases: (ours, reference, full tensors, placements by style)
# ---------------------------------------------------------------------------------------------

def _gen(seed, *shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _case(kind, activation="identity"):
    from cutlass_ops import fused_linear, ops

    x = _gen(1, B, S, K)
    if kind == "linear":
        full = {"x": x, "w": _gen(2, N, K), "b": _gen(3, N)}
        return (lambda x, w, b: ops.linear_fast(x, w, b, activation),
                lambda x, w, b: _linear(x, w, b, activation), full)
    if kind == "merged":
        full = {"x": x, "q": _gen(2, ROWS[0], K), "k": _gen(3, ROWS[1], K),
                "v": _gen(4, ROWS[2], K), "b": _gen(5, sum(ROWS))}
        return (lambda x, q, k, v, b: fused_linear.merged_linear(x, [q, k, v], b),
                lambda x, q, k, v, b: F.linear(x, torch.cat([q, k, v]), b), full)
    full = {"x": x, "w": _gen(2, N, K), "b": _gen(3, N), "r": _gen(4, B, S, N)}
    return (fused_linear.linear_residual, lambda x, w, b, r: F.linear(x, w, b) + r, full)


def _placement(style, name):
    from torch.distributed.tensor import Replicate, Shard

    if style in ("seq", "batch"):  # activations on rows, parameters replicated
        return Shard(1 if style == "seq" else 0) if name in ("x", "r") else Replicate()
    if style == "colwise":  # out features: weights, bias and the residual's last dim
        return {"x": Replicate(), "r": Shard(2)}.get(name, Shard(0))
    return {"x": Shard(2), "b": Replicate()}.get(name, Shard(1))  # rowwise


def _run(mesh, kind, style, activation, local):
    from torch.distributed.tensor import Partial, Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.debug import CommDebugMode

    ours, ref, full = _case(kind, activation)
    full = {n: t.requires_grad_() for n, t in full.items()}
    dist = {n: distribute_tensor(t.detach(), mesh, [_placement(style, n)]).requires_grad_()
            for n, t in full.items()}
    with CommDebugMode() as fwd:
        y = ours(*dist.values())
    placement = y.placements[0]
    grad = _gen(9, *y.shape)
    if local:
        expect = {"seq": Shard(1), "batch": Shard(0), "colwise": Shard(2),
                  "rowwise": Partial()}[style]
        assert placement == expect, (kind, style, y.placements)
        assert fwd.get_total_counts() == 0, (kind, style, fwd.get_comm_counts())
    else:
        assert fwd.get_total_counts() > 0, (kind, style)
    # The plan's own step after the op (RowwiseParallel's all-reduce), outside the count.
    y_full = y.redistribute(mesh, [Replicate()]) if isinstance(placement, Partial) else y
    dy = distribute_tensor(grad, mesh, y_full.placements)  # a scatter: outside the count
    with CommDebugMode() as bwd:
        y_full.backward(dy)
    expected = ref(*full.values())
    expected.backward(grad)
    torch.testing.assert_close(y.full_tensor(), expected, rtol=1e-5, atol=1e-5)
    grads = {}
    for n, t in full.items():
        torch.testing.assert_close(dist[n].grad.full_tensor(), t.grad, rtol=1e-5, atol=1e-5)
        grads[n] = tuple(str(p) for p in dist[n].grad.placements)
    return fwd.get_total_counts(), bwd.get_total_counts(), grads


def _cases(rank, world, cases):
    from torch.distributed.device_mesh import init_device_mesh

    import cutlass_ops.fused_linear  # noqa: F401  (defines the ops before their CPU kernels)
    import cutlass_ops.ops  # noqa: F401

    for name, kernel in CPU_KERNELS.items():
        torch.library.register_kernel(f"cutlass_ops::{name}", "cpu", kernel)
    mesh = init_device_mesh("cpu", (world,))
    return {case: _run(mesh, *case) for case in cases}


def test_linear_merged_and_residual_stay_local_under_tp_styles(tmp_path):
    """One spawn for every case (a spawn costs seconds): local strategies first, then the
    layouts DTensor must redistribute. ``linear`` with relu under Rowwise runs after the
    identity case on the same shapes: the activation is in DTensor's cache key, so the Partial
    strategy cached for identity is not reused (relu of a partial sum would be wrong)."""
    local = [("linear", s, "identity", True) for s in ("colwise", "rowwise", "seq", "batch")]
    local += [("linear", s, "gelu", True) for s in ("colwise", "seq")]
    local += [("merged", s, "identity", True) for s in ("rowwise", "seq", "batch")]
    local += [("residual", s, "identity", True) for s in ("colwise", "seq", "batch")]
    gathered = [("linear", "rowwise", "relu", False), ("merged", "colwise", "identity", False),
                ("residual", "rowwise", "identity", False)]
    results = on_ranks(tmp_path, _cases, local + gathered)[0]
    # Rows sharded, weights replicated: weight / bias gradients are partial sums, no collective.
    # linear's backward flattens [B, S] to rows for mm: a sequence shard is gathered there.
    for case in [("linear", "batch"), ("merged", "seq"), ("merged", "batch"),
                 ("residual", "seq"), ("residual", "batch")]:
        _, bwd, grads = results[(*case, "identity", True)]
        weight = "q" if case[0] == "merged" else "w"
        assert grads[weight] == ("P(sum)",) and grads["x"] == ("S(0)",) * (case[1] == "batch") \
            + ("S(1)",) * (case[1] == "seq") and bwd == 0, (case, grads, bwd)
    # Colwise and Rowwise backward stay local too (dX Partial / Shard(-1)).
    for case in [("linear", "colwise"), ("linear", "rowwise"), ("merged", "rowwise"),
                 ("residual", "colwise")]:
        result = results[(*case, "identity", True)]
        assert result[1] == 0, (case, result)
