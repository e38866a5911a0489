"""FP8 experts on the GPU (cutlass_ops.fp8.fp8_experts; marker gpu): the forward and the input
gradient through the CUTLASS blockwise grouped kernel equal the float32 products of the operands
as the GPU quantizer quantized them, at Qwen3-30B-A3B's and Mixtral's expert shapes on a skewed
routing with an empty expert; the weight gradient is bf16 grouped_mm's; a call that trains nothing
reads the kept forward operand and gives the training forward's products bit for bit. (The first
tests passed on an H200 at 0dd6584; the kept operand's test was written after, not yet run.)"""

import pytest
import torch

from cutlass_ops.fp8 import fp8_experts
from custom_kernels.core.tolerances import relative_error
from custom_kernels.fp8.fp8_quant import quantize
from fp8_reference import kept_operand_sequence

pytestmark = pytest.mark.gpu

# (experts, N, K, routed rows): Qwen3-30B-A3B's gate+up and down, Mixtral's gate+up
SHAPES = [(128, 1536, 2048, 8192), (128, 2048, 768, 8192), (8, 28672, 4096, 4096)]


def _counts(experts, rows, generator):
    weights = 1.0 / torch.arange(1, experts + 1, dtype=torch.float64)
    counts = (weights / weights.sum() * rows).floor().long()
    counts[0] += rows - int(counts.sum())
    counts[experts // 2] += counts[1]
    counts[1] = 0  # an empty expert
    return counts


def _dequantized(t, granularity):
    q, scale = quantize(t.detach(), granularity)
    rows = 1 if granularity == "block_1x128" else 128
    return q.float() * scale.repeat_interleave(rows, 0).repeat_interleave(128, 1)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s[:3])))
def test_the_products_are_the_float32_products_of_the_quantized_operands(shape):
    experts, n, k, rows = shape
    generator = torch.Generator().manual_seed(n)
    counts = _counts(experts, rows, generator)
    offs = counts.cumsum(0).to(torch.int32).cuda()
    x = torch.randn(rows, k, generator=generator).bfloat16().cuda().requires_grad_()
    w = (torch.randn(experts, n, k, generator=generator) / k ** 0.5).bfloat16().cuda()
    w.requires_grad_()
    dy = torch.randn(rows, n, generator=generator).bfloat16().cuda()
    y = fp8_experts.fp8_routed_gemm(x, w, offs)
    y.backward(dy)
    w_q = _dequantized(w.reshape(experts * n, k), "block_128x128").view(experts, n, k)
    x_q, dy_q = _dequantized(x, "block_1x128"), _dequantized(dy, "block_1x128")
    starts = [0, *offs[:-1].tolist()]
    for e in range(experts):
        s, c = starts[e], int(counts[e])
        if c == 0:
            assert w.grad[e].abs().sum() == 0
            continue
        assert relative_error(y[s:s + c], x_q[s:s + c] @ w_q[e].t()) < 5e-3, e
        assert relative_error(x.grad[s:s + c], dy_q[s:s + c] @ w_q[e]) < 5e-3, e
        expected_dw = dy[s:s + c].float().t() @ x.detach()[s:s + c].float()
        assert relative_error(w.grad[e], expected_dw) < 5e-3, e


def test_a_cuda_graph_replays_the_forward_and_backward():
    experts, n, k, rows = 8, 512, 1024, 2048
    generator = torch.Generator().manual_seed(0)
    offs = _counts(experts, rows, generator).cumsum(0).to(torch.int32).cuda()
    x = torch.randn(rows, k, generator=generator).bfloat16().cuda().requires_grad_()
    w = (torch.randn(experts, n, k, generator=generator) / 32).bfloat16().cuda()
    w.requires_grad_()
    dy = torch.randn(rows, n, generator=generator).bfloat16().cuda()

    def step():
        x.grad = w.grad = None
        fp8_experts.fp8_routed_gemm(x, w, offs).backward(dy)
        return x.grad, w.grad

    eager = [t.clone() for t in step()]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # warm-up on the side stream, as torch's graph recipe wants
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    graph.replay()
    for got, want in zip(captured, eager):
        assert torch.equal(got, want)


def test_a_call_that_trains_nothing_reads_the_kept_operand_and_equals_the_training_forward():
    experts, n, k, rows = SHAPES[1]
    counts = _counts(experts, rows, torch.Generator().manual_seed(1))
    offs = counts.cumsum(0).to(torch.int32).cuda()
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(experts, n, k, device="cuda") / 20).bfloat16().requires_grad_()
    out, kept = kept_operand_sequence(x, w, offs)
    assert kept["kept_twice"]
    first = out["first"]
    assert torch.equal(first, out["trained"].detach()) and torch.equal(out["again"], first)
    assert kept["renewed"]
    assert relative_error(out["doubled"], 2 * first.float()) < 1e-2
