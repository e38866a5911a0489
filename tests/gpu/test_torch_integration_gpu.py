"""A small transformer block converted with cutlass_ops.convert matches torch in forward and
backward: eager, torch.compile(fullgraph=True), and replayed from captured CUDA graphs."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import cutlass_ops
from cutlass_ops import GemmConfig, GemmOperands
from cutlass_ops.nn import Linear

pytestmark = [pytest.mark.gpu, pytest.mark.nvcc]  # builds CUTLASS C++ kernels with nvcc

DIM, HEADS, BATCH, SEQ = 512, 8, 2, 128


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.qkv, self.proj = nn.Linear(DIM, 3 * DIM), nn.Linear(DIM, DIM)
        self.up, self.down = nn.Linear(DIM, 4 * DIM), nn.Linear(4 * DIM, DIM, bias=False)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).chunk(3, dim=-1)
        q, k, v = (z.reshape(b, t, HEADS, d // HEADS).transpose(1, 2) for z in (q, k, v))
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, t, d))
        return x + self.down(F.gelu(self.up(self.norm2(x)), approximate="tanh"))


@pytest.fixture(scope="module", autouse=True)
def built_kernels():
    """A few generic kernels for the forward (tn), dX (tt) and dW (nt) layouts, so that dispatch
    runs CUTLASS on these untuned shapes (its heuristic picks among built kernels)."""
    from cutlass_ops.gemms.loader import prepare_many

    configs = [GemmConfig(kernel_schedule="cooperative", tile=(128, 128, 64)),
               GemmConfig(kernel_schedule="pingpong", tile=(64, 128, 64))]
    items = [(GemmOperands.make("bf16", layout_a=la, layout_b=lb), c)
             for la, lb in (("row", "col"), ("row", "row"), ("col", "row")) for c in configs]
    results = prepare_many(items)
    assert not [r for r in results.values() if isinstance(r, Exception)]
    from cutlass_ops.gemms import dispatch

    dispatch.reset()


def models():
    torch.manual_seed(0)
    ref = Block().cuda().to(torch.bfloat16)
    ours = copy.deepcopy(ref)
    report = cutlass_ops.convert(ours)
    assert sorted(report.converted) == ["down", "norm1", "norm2", "proj", "qkv", "up"], \
        str(report)
    assert all(isinstance(getattr(ours, n), Linear) for n in ("down", "proj", "qkv", "up"))
    assert all(type(getattr(ours, n)) is cutlass_ops.nn.LayerNorm for n in ("norm1", "norm2"))
    return ref, ours


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def run(model, x):
    x = x.detach().requires_grad_()
    y = model(x)
    y.backward(torch.ones_like(y) / y.numel() ** 0.5)
    # torch.compile's wrapper names parameters "_orig_mod.<name>".
    grads = {n.removeprefix("_orig_mod."): p.grad.detach().clone()
             for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return y.detach(), x.grad.detach(), grads


def check(ref_out, our_out):
    (y0, gx0, g0), (y1, gx1, g1) = ref_out, our_out
    assert g1.keys() == g0.keys()
    assert rel(y1, y0) < 2e-2
    assert rel(gx1, gx0) < 3e-2
    for name in g0:
        assert rel(g1[name], g0[name]) < 3e-2, name


def x_input():
    return torch.randn(BATCH, SEQ, DIM, device="cuda", dtype=torch.bfloat16)


def test_eager_forward_backward_and_cutlass_runs():
    ref, ours = models()
    x = x_input()
    with torch.no_grad():  # as inside the op: with grad on, matmul itself would defer to torch
        decision = cutlass_ops.explain(x.reshape(-1, DIM), ours.qkv.weight.t())
    assert decision.choice is not None, decision.reason  # CUTLASS, not a fallback
    check(run(ref, x), run(ours, x))


def test_torch_compile_fullgraph():
    ref, ours = models()
    x = x_input()
    compiled = torch.compile(ours, fullgraph=True)
    check(run(ref, x), run(compiled, x))


def test_cuda_graph_replay():
    ref, ours = models()
    x = x_input().requires_grad_()
    graphed = torch.cuda.make_graphed_callables(ours, (x,))
    for _ in range(2):  # replays with new data in the same static buffers
        fresh = x_input()
        check(run(ref, fresh), run(graphed, fresh))


@pytest.mark.parametrize("name", ["mm", "bmm", "linear"])
def test_opcheck_on_the_gpu(name):
    kw = dict(device="cuda", dtype=torch.bfloat16, requires_grad=True)
    args = {"mm": (torch.randn(64, 128, **kw), torch.randn(128, 256, **kw)),
            "bmm": (torch.randn(2, 64, 128, **kw), torch.randn(2, 128, 256, **kw)),
            "linear": (torch.randn(4, 16, 128, **kw), torch.randn(256, 128, **kw),
                       torch.randn(256, **kw))}[name]
    torch.library.opcheck(getattr(cutlass_ops.ops, name), args)
