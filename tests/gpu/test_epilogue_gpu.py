"""Fused epilogues on the GPU: D = act(alpha * AB + bias) + beta * C from one kernel, against a
float32 torch reference; both orientations (swap-A/B moves the bias to the other extent);
batched; dispatch picking a fused kernel; the fused Linear module eagerly, compiled and in a CUDA
graph; and convert() fusing an MLP's activation."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import cutlass_ops
from cutlass_ops import GemmConfig, GemmOperands
from cutlass_ops.gemms import epilogues
from cutlass_ops.nn import Linear
from cutlass_ops.gemms.choice import swapped_operands

pytestmark = [pytest.mark.gpu, pytest.mark.nvcc]  # builds CUTLASS C++ kernels with nvcc

PINGPONG = GemmConfig(kernel_schedule="pingpong", tile=(128, 128, 64))
SMALL_M = GemmConfig(kernel_schedule="pingpong", tile=(64, 64, 128))  # for swapped runs
STREAM_K = GemmConfig(kernel_schedule="cooperative", tile=(128, 128, 64), cluster=(2, 1, 1),
                      tile_scheduler="streamk")

# (epilogue, config, swapped)
CASES = [
    ("bias,gelu_tanh,residual", PINGPONG, False),
    ("bias,gelu_tanh", PINGPONG, False),  # the MLP's up projection (tests below)
    ("bias,relu", PINGPONG, False),
    ("bias", PINGPONG, False),
    ("silu", PINGPONG, False),
    ("gelu", PINGPONG, False),
    ("bias,gelu_tanh,residual", SMALL_M, True),
    ("bias,silu", SMALL_M, True),
    ("bias,gelu,residual", STREAM_K, False),
]


def work():
    """(operands, config) of every kernel these tests run, for tests/gpu/prebuild.py."""
    out = []
    for epilogue, config, swapped in CASES:
        ops = GemmOperands.make("bf16", epilogue=epilogue)
        out.append((swapped_operands(ops) if swapped else ops, config))
    return out


@pytest.fixture(scope="module", autouse=True)
def built():
    from cutlass_ops.gemms.loader import prepare_many

    results = prepare_many(work())
    failed = {k[0].name + " " + k[1].build_name: str(v)[:300] for k, v in results.items()
              if isinstance(v, Exception)}
    assert not failed, failed


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def operands(m, n, k, batch=1, residual=True):
    torch.manual_seed(m + n + k)
    shape = (batch,) if batch > 1 else ()
    x = torch.randn(*shape, m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(*shape, n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    res = torch.randn(*shape, m, n, device="cuda", dtype=torch.bfloat16) if residual else None
    return x, w, bias, res


@pytest.mark.parametrize("epilogue,config,swapped", CASES)
def test_fused_gemm_matches_float32_reference(epilogue, config, swapped):
    spec = cutlass_ops.Epilogue.parse(epilogue)
    m, n, k = (48, 4096, 1024) if swapped else (512, 768, 1024)
    x, w, bias, res = operands(m, n, k, residual=spec.residual)
    bias = bias if spec.bias.value != "none" else None
    alpha = 0.75  # not 1, and unlike beta: a launcher that swapped them would fail
    beta = 0.5 if res is not None else 0.0
    want = epilogues.apply(x.float() @ w.float().t(), alpha=alpha,
                           bias=None if bias is None else bias.float(),
                           activation=spec.activation, c=None if res is None else res.float(),
                           beta=beta)
    out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
    if swapped:  # D^T = W X^T: the bias runs along the rows of D^T
        cutlass_ops.gemm(w, x.t(), None if res is None else res.t(), alpha=alpha, beta=beta,
                         bias=None if bias is None else bias.view(-1, 1),
                         activation=spec.activation, config=config, out=out.t())
    else:
        cutlass_ops.gemm(x, w.t(), res, alpha=alpha, beta=beta, bias=bias,
                         activation=spec.activation, config=config, out=out)
    assert rel(out, want) < 1e-2


def test_batched_fused_gemm_shares_one_bias():
    x, w, bias, res = operands(256, 512, 256, batch=3)
    out = cutlass_ops.gemm(x, w.transpose(1, 2), res, beta=1.0, bias=bias,
                           activation="gelu_tanh", config=PINGPONG)
    want = F.gelu(x.float() @ w.float().transpose(1, 2) + bias.float(), approximate="tanh") + \
        res.float()
    assert rel(out, want) < 1e-2


def test_bad_bias_is_refused_not_misread():
    x, w, bias, _ = operands(128, 256, 128, residual=False)
    with pytest.raises(cutlass_ops.UnsupportedInputError, match="bias has shape"):
        cutlass_ops.gemm(x, w.t(), bias=bias[:100], config=PINGPONG)
    with pytest.raises(cutlass_ops.UnsupportedInputError, match="dtype"):
        cutlass_ops.gemm(x, w.t(), bias=bias.float(), config=PINGPONG)


def test_dispatch_runs_a_built_fused_kernel_and_falls_back_unfused():
    from cutlass_ops.gemms import dispatch

    dispatch.reset()
    x, w, bias, res = operands(256, 768, 512)
    decision = cutlass_ops.explain(x, w.t(), bias=bias, activation="gelu_tanh", residual=res)
    assert decision.source in ("heuristic", "nearest", "exact"), decision
    for _ in range(3):  # first call plans, the next ones take the fast path
        y = cutlass_ops.matmul(x, w.t(), bias=bias, activation="gelu_tanh", residual=res,
                               alpha=0.5, beta=2.0)
        want = F.gelu(0.5 * (x.float() @ w.float().t()) + bias.float(),
                      approximate="tanh") + 2.0 * res.float()
        assert rel(y, want) < 1e-2
    # No kernel for a relu + residual epilogue: the plain GEMM, then torch.
    decision = cutlass_ops.explain(x, w.t(), bias=bias, activation="relu", residual=res)
    assert decision.source == "unfused", decision
    y = cutlass_ops.matmul(x, w.t(), bias=bias, activation="relu", residual=res)
    assert rel(y, F.relu(x.float() @ w.float().t() + bias.float()) + res.float()) < 1e-2


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(512, 768), nn.GELU(approximate="tanh"),
                         nn.Linear(768, 512)).cuda().to(torch.bfloat16)


def test_converted_mlp_fuses_the_activation_forward_and_backward():
    ref = mlp()
    ours = copy.deepcopy(ref)
    report = cutlass_ops.convert(ours)
    assert ours[0].activation == "gelu_tanh" and isinstance(ours[1], nn.Identity), str(report)
    x = torch.randn(256, 512, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        assert cutlass_ops.explain(x, ours[0].weight.t(), bias=ours[0].bias,
                                   activation="gelu_tanh").source != "unfused"
        assert rel(ours(x), ref(x)) < 2e-2
    for model in (ours, torch.compile(copy.deepcopy(ours), fullgraph=True)):
        xs = [x.clone().requires_grad_() for _ in range(2)]
        y0, y1 = ref(xs[0]), model(xs[1])
        y0.sum().backward()
        y1.sum().backward()
        assert rel(y1, y0) < 2e-2 and rel(xs[1].grad, xs[0].grad) < 3e-2


def test_fused_linear_replays_from_a_cuda_graph():
    layer = Linear.from_linear(mlp()[0], activation="gelu_tanh")
    x = torch.randn(256, 512, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        layer(x)  # resolves the kernel before capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = layer(x)
        x.copy_(torch.randn_like(x))
        graph.replay()
        torch.cuda.synchronize()
        want = F.gelu(F.linear(x.float(), layer.weight.float(), layer.bias.float()),
                      approximate="tanh")
    assert rel(y, want) < 2e-2


def test_opcheck_with_activation():
    layer = mlp()[0]
    x = torch.randn(64, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    torch.library.opcheck(cutlass_ops.ops.linear, (x, layer.weight, layer.bias, "gelu_tanh"))
