"""custom_kernels.parallel.sharding_rules on the CPU: two gloo ranks, a 1-D mesh, DTensor inputs sharded on the
sequence or the batch (or the heads) through the path the public functions take for DTensors
(``norms.ops._norm``, ``rotary._rotary``, ``swiglu._swiglu``: the custom ops). The results stay
sharded (no gather), equal the references on the whole tensors (gradients too, weight gradients
Partial until reduced), and CommDebugMode counts no collective in the forward or the backward. A
last-dimension shard is not a local strategy: DTensor gathers it and the result is still right.

The ops' own implementations launch CUDA kernels; the workers give them CPU kernels (the torch
formulas below), so that the sharding rules, the only thing under test, run without a GPU.
"""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from gloo_ranks import on_ranks  # noqa: E402

B, S, HIDDEN, HQ, HK, D = 2, 4, 16, 4, 2, 8


# ---------------------------------------------------------------------------------------------
# CPU kernels for the custom ops (float32 math), registered in the workers only
# ---------------------------------------------------------------------------------------------

def _rms_fwd(x, weight, residual, eps, out_dtype, config=None):
    h = x if residual is None else (x.float() + residual.float()).to(x.dtype)
    rstd = torch.rsqrt(h.float().pow(2).mean(-1) + eps)
    y = (h.float() * rstd[..., None] * weight.float()).to(out_dtype)
    return y, (h.clone() if residual is not None else x.new_empty(0)), rstd


def _rms_bwd(dy, h, weight, rstd, d_residual_out, config=None):
    xhat = h.float() * rstd[..., None]
    g = dy.float() * weight.float()
    dx = rstd[..., None] * (g - xhat * (g * xhat).mean(-1, keepdim=True))
    if d_residual_out is not None:
        dx = dx + d_residual_out.float()
    dw = (dy.float() * xhat).reshape(-1, h.shape[-1]).sum(0)
    return dx.to(h.dtype), dw.to(weight.dtype)


def _ln_fwd(x, weight, bias, residual, eps, out_dtype, config=None):
    h = x if residual is None else (x.float() + residual.float()).to(x.dtype)
    mean = h.float().mean(-1)
    rstd = torch.rsqrt(h.float().var(-1, unbiased=False) + eps)
    y = ((h.float() - mean[..., None]) * rstd[..., None] * weight.float() + bias.float())
    return (y.to(out_dtype), h.clone() if residual is not None else x.new_empty(0), mean, rstd)


def _ln_bwd(dy, h, weight, mean, rstd, d_residual_out, config=None):
    xhat = (h.float() - mean[..., None]) * rstd[..., None]
    g = dy.float() * weight.float()
    dx = rstd[..., None] * (g - g.mean(-1, keepdim=True)
                            - xhat * (g * xhat).mean(-1, keepdim=True))
    if d_residual_out is not None:
        dx = dx + d_residual_out.float()
    rows = h.shape[-1]
    dw = (dy.float() * xhat).reshape(-1, rows).sum(0)
    db = dy.float().reshape(-1, rows).sum(0)
    return dx.to(h.dtype), dw.to(weight.dtype), db.to(weight.dtype)


def _rotary_fwd(q, k, cos, sin):
    from custom_kernels.rotary import rotary_reference

    return tuple(y.contiguous() for y in rotary_reference(q, k, cos, sin))


def _rotary_bwd(dq_out, dk_out, cos, sin):
    def adjoint(g):  # [B, H, S, D] -> [B, S, H, D]: g * cos + rotate_half's transpose of g * sin
        if g is None:
            return cos.new_empty(0)
        gs = g * sin.unsqueeze(1)
        half = g.shape[-1] // 2
        rot_t = torch.cat((gs[..., half:], -gs[..., :half]), dim=-1)
        return (g * cos.unsqueeze(1) + rot_t).transpose(1, 2).contiguous()

    return adjoint(dq_out), adjoint(dk_out)


def _swiglu_fwd(gate_up):
    from custom_kernels.swiglu import swiglu_reference

    return swiglu_reference(gate_up).contiguous()


def _swiglu_bwd(dy, gate_up):
    inter = gate_up.shape[-1] // 2
    g, u = gate_up[..., :inter].float(), gate_up[..., inter:].float()
    sig = torch.sigmoid(g)
    dg = dy.float() * u * sig * (1 + g * (1 - sig))
    du = dy.float() * g * sig
    return torch.cat((dg, du), dim=-1).to(gate_up.dtype)


CPU_KERNELS = {"rms_norm_fwd": _rms_fwd, "rms_norm_bwd": _rms_bwd, "layer_norm_fwd": _ln_fwd,
               "layer_norm_bwd": _ln_bwd, "rotary_fwd": _rotary_fwd, "rotary_bwd": _rotary_bwd,
               "swiglu_fwd": _swiglu_fwd, "swiglu_bwd": _swiglu_bwd}


# ---------------------------------------------------------------------------------------------
# The cases: (name, build) where build(full tensors) -> (our call, reference call, inputs)
# ---------------------------------------------------------------------------------------------

def _gen(seed, *shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _norm_case(kind, residual):
    from custom_kernels.norms import norm_ops as ops

    def ours(x, w, b, r):
        return ops._norm(kind, x, w, b, r, 1e-6, x.dtype, None)

    def ref(x, w, b, r):
        if kind == "rms":
            return ops.rms_norm_reference(x, w, 1e-6, r)
        return ops.layer_norm_reference(x, w, b, 1e-6, r)

    full = {"x": _gen(1, B, S, HIDDEN), "w": _gen(2, HIDDEN) + 1, "b": _gen(3, HIDDEN),
            "r": _gen(4, B, S, HIDDEN) if residual else None}
    if kind == "rms":
        full["b"] = None
    return ours, ref, full, ("w", "b")


def _rotary_case(cos_batch):
    from custom_kernels import rotary

    cos_sin = _gen(7, cos_batch, S, D)
    full = {"q": _gen(5, B, S, HQ, D), "k": _gen(6, B, S, HK, D), "cos": cos_sin.cos(),
            "sin": cos_sin.sin()}
    return rotary._rotary, rotary.rotary_reference, full, ()


def _swiglu_case():
    from custom_kernels import swiglu

    return (swiglu._swiglu, swiglu.swiglu_reference, {"gate_up": _gen(8, B, S, 2 * HIDDEN)},
            ())


CASES = {"rms": lambda: _norm_case("rms", False), "rms_residual": lambda: _norm_case("rms", True),
         "ln": lambda: _norm_case("ln", False), "ln_residual": lambda: _norm_case("ln", True),
         "rotary": lambda: _rotary_case(1), "rotary_batch_cos": lambda: _rotary_case(B),
         "swiglu": _swiglu_case}


def _placement(name, value, dim, params):
    """Activations on ``dim``; parameters replicated; cos / sin as a TP plan lays them out:
    along the sequence, along the batch when they have one, replicated otherwise."""
    from torch.distributed.tensor import Replicate, Shard

    if name in params:
        return Replicate()
    if name in ("cos", "sin"):
        if dim == 1 or (dim == 0 and value.shape[0] > 1):
            return Shard(dim)
        return Replicate()
    return Shard(dim)


def _run_case(mesh, case, dim, expect_local):
    from torch.distributed.tensor import Partial, Shard, distribute_tensor
    from torch.distributed.tensor.debug import CommDebugMode

    ours, ref, full, params = CASES[case]()
    device = mesh.device_type  # "cuda": the GPU variant (tests/gpu/parallel/test_sharding_gpu.py)
    full = {n: t.to(device).requires_grad_() if t is not None and n not in ("cos", "sin")
            else (t.to(device) if t is not None else None) for n, t in full.items()}
    dist = {n: None if t is None else
            distribute_tensor(t.detach(), mesh, [_placement(n, t, dim, params)])
            .requires_grad_(t.requires_grad) for n, t in full.items()}
    with CommDebugMode() as fwd:
        out = ours(*dist.values())
    outs = out if isinstance(out, tuple) else (out,)
    grads = [distribute_tensor(torch.randn(o.shape, device=device), mesh, o.placements)
             for o in outs]
    with CommDebugMode() as bwd:
        torch.autograd.backward(outs, grads)
    expected = ref(*full.values())
    expected = expected if isinstance(expected, tuple) else (expected,)
    torch.autograd.backward(expected, [g.full_tensor() for g in grads])
    tol = dict(rtol=1e-5, atol=1e-5) if device == "cpu" else dict(rtol=1e-4, atol=1e-4)
    for o, e in zip(outs, expected):
        torch.testing.assert_close(o.full_tensor(), e, **tol)
    for n, t in full.items():
        if t is not None and t.requires_grad:
            g = dist[n].grad
            if expect_local and n in params:  # summed over each rank's rows
                assert all(isinstance(p, Partial) for p in g.placements), (n, g.placements)
            torch.testing.assert_close(g.full_tensor(), t.grad, **tol)
    if expect_local:
        assert all(isinstance(p, Shard) for o in outs for p in o.placements), \
            [o.placements for o in outs]
        assert fwd.get_total_counts() == 0, fwd.get_comm_counts()
        assert bwd.get_total_counts() == 0, bwd.get_comm_counts()
    return fwd.get_total_counts(), bwd.get_total_counts()


def _cases(rank, world, cases, device="cpu"):
    """``device`` "cuda": the ops' own kernels on each rank's GPU (NCCL ranks)."""
    from torch.distributed.device_mesh import init_device_mesh

    if device == "cpu":
        for name, kernel in CPU_KERNELS.items():
            torch.library.register_kernel(f"custom_kernels::{name}", "cpu", kernel)
    mesh = init_device_mesh(device, (world,))
    return {(case, dim): _run_case(mesh, case, dim, local) for case, dim, local in cases}


def _spawn(tmp_path, cases):
    return on_ranks(tmp_path, _cases, cases)[0]


def test_norms_stay_local_on_sequence_and_batch_shards(tmp_path):
    cases = [(c, d, True) for c in ("rms", "rms_residual", "ln", "ln_residual") for d in (0, 1)]
    _spawn(tmp_path, cases)


def test_rotary_and_swiglu_stay_local_on_batch_sequence_and_heads(tmp_path):
    cases = [(c, d, True) for c in ("rotary", "rotary_batch_cos") for d in (0, 1, 2)]
    cases += [("swiglu", d, True) for d in (0, 1)]
    _spawn(tmp_path, cases)


def test_a_last_dimension_shard_is_gathered_and_still_right(tmp_path):
    """The normalized row, SwiGLU's halves and the rotated head need the whole last dimension:
    no local rule takes that shard, so DTensor redistributes (collectives, counted) and the
    result is unchanged."""
    counts = _spawn(tmp_path, [("rms_residual", 2, False), ("ln", 2, False),
                               ("swiglu", 2, False), ("rotary", 3, False)])
    assert all(fwd > 0 for fwd, _ in counts.values()), counts


def test_without_torch_distributed_tensor_loaded_the_rules_wait_for_it():
    """Registration is deferred until DTensor is imported (it costs about 0.4 s); a fresh
    interpreter that imports the ops first, then DTensor, has the rules."""
    import subprocess

    code = ("import sys, torch, custom_kernels.norms.norm_ops, custom_kernels.rotary, "
            "custom_kernels.swiglu\n"
            "assert 'torch.distributed.tensor' not in sys.modules\n"
            "from torch.distributed.tensor import DTensor\n"
            "funcs = DTensor._op_dispatcher.sharding_propagator.op_strategy_funcs\n"
            "from custom_kernels.parallel.sharding_rules import RULES\n"
            "missing = [n for n in RULES if getattr(torch.ops.custom_kernels, n).default "
            "not in funcs]\n"
            "assert not missing, missing\n")
    if not torch.distributed.is_available():
        pytest.skip("torch without torch.distributed")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
