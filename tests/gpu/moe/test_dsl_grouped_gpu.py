"""The DSL path's grouped GEMMs on the GPU (skipped without ``cutlass-ops[dsl]``): QuACK's
variable-length kernels (128- and 256-row tiles, and the 64-row ones offered to short groups) on
the 2d3d (forward, dX) and 2d2d (dW) forms against the per-group float32 reference, with empty
groups, one group taking every row, both dtypes, the dynamic tile scheduler (on two streams, and
replayed in a CUDA graph with new routing), and a tuned DSL winner dispatched by
``cutlass_ops.grouped_mm``, also compiled with fullgraph."""

import pytest
import torch

import cutlass_ops
from cutlass_ops.moe import grouped
from cutlass_ops.gemms import dsl
from cutlass_ops.gemms.grouped import dsl_grouped, grouped_entries
from custom_kernels.core.tolerances import relative_error

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(dsl.unavailable() is not None, reason="no cutlass-ops[dsl]")]

CONFIGS = [dsl.DslConfig.from_name(n) for n in (
    "dsl-sm90-pingpong-t128x192-c2x1", "dsl-sm90-cooperative-t128x256-c1x1",
    "dsl-sm90-cooperative-t256x192-c2x1",
    # the short-group tiles (dsl_grouped.SHORT_GROUP_CONFIGS): 64 rows, K tiles of 128 and 64
    "dsl-sm90-pingpong-t64x128x128-c2x1", "dsl-sm90-pingpong-t64x64-c1x1",
    # the tuner's dynamic twins (dsl_grouped.dynamic_twins): tiles from an atomic counter
    "dsl-sm90-pingpong-t128x192-c2x1-dynamic", "dsl-sm90-pingpong-t64x128x128-c2x1-dynamic",
    "dsl-sm90-cooperative-t128x256-c1x1-dynamic")]
DYNAMIC = CONFIGS[5]
SIZES = [[64, 0, 200, 248], [0, 0, 512, 0], [1, 7, 9, 495], [128, 128, 128, 128]]


def offsets(sizes):
    return torch.tensor(sizes, device="cuda").cumsum(0).to(torch.int32)


def rand(*shape, dtype=torch.bfloat16, scale=1.0):
    return (torch.randn(*shape, device="cuda") * scale).to(dtype)


def operands(form, sizes, dtype, weight_layout="n"):
    tokens = sum(sizes)
    if form == "2d3d":  # tokens x the experts' [E, N, K] weights (n), or dX's [E, K, N] (t)
        b = rand(4, 384, 256, dtype=dtype).transpose(1, 2) if weight_layout == "n" \
            else rand(4, 256, 384, dtype=dtype)
        return rand(tokens, 256, dtype=dtype, scale=1 / 16), b
    # dW: x^T (column-major) times dy, grouped along the tokens
    return rand(tokens, 256, dtype=dtype, scale=1 / 16).t(), rand(tokens, 384, dtype=dtype)


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.name)
@pytest.mark.parametrize("sizes", SIZES, ids=str)
@pytest.mark.parametrize("form, weight_layout", [("2d3d", "n"), ("2d3d", "t"), ("2d2d", "-")])
def test_each_form_against_the_per_group_reference(config, sizes, form, weight_layout):
    a, b = operands(form, sizes, torch.bfloat16, weight_layout)
    offs = offsets(sizes)
    expected = grouped.reference(a, b, offs)
    out = torch.full(expected.shape, float("nan"), device="cuda", dtype=a.dtype)
    assert dsl_grouped.run(config, form, a, b, offs, out) is out
    assert relative_error(out, expected) < 2e-2  # NaN (a row or group left unwritten) fails


def test_fp16():
    a, b = operands("2d3d", [100, 0, 300, 112], torch.float16)
    offs = offsets([100, 0, 300, 112])
    out = torch.empty(512, 384, device="cuda", dtype=torch.float16)
    dsl_grouped.run(CONFIGS[0], "2d3d", a, b, offs, out)
    assert relative_error(out, grouped.reference(a, b, offs)) < 2e-2


@pytest.mark.parametrize("config", [CONFIGS[0], DYNAMIC], ids=lambda c: c.name)
def test_replays_in_a_cuda_graph_with_new_routing(config):
    """Replayed again and again: a dynamic scheduler's tile counter must start from zero on
    every replay (a stale one would leave tiles unwritten: NaN)."""
    a, b = operands("2d3d", [128] * 4, torch.bfloat16)
    offs = offsets([128] * 4)
    out = torch.empty(512, 384, device="cuda", dtype=torch.bfloat16)
    dsl_grouped.run(config, "2d3d", a, b, offs, out)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        dsl_grouped.run(config, "2d3d", a, b, offs, out)
    # Same buffers, new routing each replay: no host sync anywhere.
    for sizes in ([500, 0, 4, 8], [128] * 4, [1, 7, 9, 495]):
        offs.copy_(offsets(sizes))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert relative_error(out, grouped.reference(a, b, offs)) < 2e-2, sizes


def test_a_dynamic_kernel_on_two_streams_at_once():
    """Each call takes its own tile counter: two launches in flight do not share one."""
    a, b = operands("2d3d", [100, 0, 300, 112], torch.bfloat16)
    offs = offsets([100, 0, 300, 112])
    expected = grouped.reference(a, b, offs)
    outs = [torch.full(expected.shape, float("nan"), device="cuda", dtype=a.dtype)
            for _ in range(2)]
    streams = [torch.cuda.Stream() for _ in range(2)]
    torch.cuda.synchronize()
    for _ in range(5):
        for stream, out in zip(streams, outs):
            with torch.cuda.stream(stream):
                dsl_grouped.run(DYNAMIC, "2d3d", a, b, offs, out)
    torch.cuda.synchronize()
    assert all(relative_error(out, expected) < 2e-2 for out in outs)


@pytest.fixture
def dsl_winner(monkeypatch):
    """Every grouped problem tuned to the DSL's first config; counts its launches."""
    calls = []
    run = dsl_grouped.run
    monkeypatch.setattr(grouped_entries, "tuned_config", lambda problem, device=None: CONFIGS[0])
    monkeypatch.setattr(grouped, "_tuned_by_signature", {})

    def counted(*args):
        calls.append(args[1])
        return run(*args)

    monkeypatch.setattr(dsl_grouped, "run", counted)
    return calls


def test_grouped_mm_dispatches_a_dsl_winner_with_gradients(dsl_winner):
    sizes = [64, 0, 200, 248]
    x = rand(512, 256, scale=1 / 16).requires_grad_()
    w = rand(4, 384, 256).requires_grad_()
    offs = offsets(sizes)
    y = cutlass_ops.grouped_mm(x, w.transpose(1, 2), offs)
    assert relative_error(y, grouped.reference(x.detach(), w.detach().transpose(1, 2), offs)) \
        < 2e-2
    dy = rand(*y.shape)
    y.backward(dy)
    assert dsl_winner == ["2d3d", "2d3d", "2d2d"]  # forward, dX and dW all on the DSL path
    x_ref, w_ref = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    grouped.reference(x_ref, w_ref.transpose(1, 2), offs).backward(dy)
    assert relative_error(x.grad, x_ref.grad) < 2e-2
    assert relative_error(w.grad, w_ref.grad) < 2e-2  # the empty expert's gradient is zero


def test_compiles_with_fullgraph_on_a_dsl_winner(dsl_winner):
    x, w, offs = rand(512, 256, scale=1 / 16), rand(4, 256, 384), offsets([100, 0, 300, 112])
    compiled = torch.compile(cutlass_ops.grouped_mm, fullgraph=True)
    assert relative_error(compiled(x, w, offs), grouped.reference(x, w, offs)) < 2e-2
    assert dsl_winner == ["2d3d"]
