"""cutlass_ops.grouped_mm on the GPU: every form and both gradients against the per-group
float32 reference, empty experts, one expert taking every token, misaligned operands refused by
name, CUDA-graph replay with new routing, and torch.compile(fullgraph=True)."""

import pytest
import torch

import cutlass_ops
from cutlass_ops.moe import grouped
from custom_kernels.core.errors import UnsupportedInputError
from custom_kernels.core.tolerances import relative_error

# grouped_mm without a tuned entry runs torch._grouped_mm: only the test of our C++ grouped
# kernel builds with nvcc (marked nvcc).
pytestmark = pytest.mark.gpu
BF16 = torch.bfloat16


def offsets(sizes):
    return torch.tensor(sizes, device="cuda").cumsum(0).to(torch.int32)


def rand(*shape, scale=1.0):
    return (torch.randn(*shape, device="cuda") * scale).to(BF16)


def close(out, expected, rows=None):
    if rows is not None:
        out, expected = out[:rows], expected[:rows]
    assert relative_error(out, expected) < 2e-2


@pytest.mark.parametrize("sizes", [[64, 0, 320, 128], [512, 0, 0, 0], [0, 0, 0, 0],
                                   [1, 7, 9, 495]])
def test_2d3d_forward_and_gradients(sizes):
    tokens = sum(sizes)
    x = rand(max(tokens, 1), 256, scale=1 / 16)[:tokens].requires_grad_()
    w = rand(4, 256, 512).requires_grad_()
    offs = offsets(sizes)
    y = cutlass_ops.grouped_mm(x, w, offs)
    close(y, grouped.reference(x.detach(), w.detach(), offs))
    dy = rand(*y.shape)
    y.backward(dy)
    ref = grouped.reference  # the gradients as grouped forms, checked against their loops
    close(x.grad, ref(dy, w.detach().transpose(1, 2), offs))
    close(w.grad, ref(x.detach().t(), dy, offs))
    for g, size in enumerate(sizes):  # an empty expert gets a zero weight gradient
        if size == 0:
            assert torch.count_nonzero(w.grad[g]) == 0


@pytest.mark.parametrize("form", ["2d2d", "3d2d", "3d3d"])
def test_other_forms_forward_and_gradients(form):
    sizes = [64, 0, 192, 256]
    offs = offsets(sizes)
    a, b = {"2d2d": (rand(128, 512, scale=1 / 16), rand(512, 256)),
            "3d2d": (rand(4, 128, 256, scale=1 / 16), rand(256, 512)),
            "3d3d": (rand(4, 128, 256, scale=1 / 16), rand(4, 256, 64))}[form]
    offs = None if form == "3d3d" else offs
    a.requires_grad_(), b.requires_grad_()
    out = cutlass_ops.grouped_mm(a, b, offs)
    close(out, grouped.reference(a.detach(), b.detach(), offs))
    if form == "2d2d":  # the empty group is zeros, not left unwritten
        assert torch.count_nonzero(out[1]) == 0
    grad = rand(*out.shape)
    out.backward(grad)
    close(a.grad, grouped.reference(grad, b.detach().transpose(-1, -2), offs))
    close(b.grad, grouped.reference(a.detach().transpose(-1, -2), grad, offs))


def test_misaligned_operands_are_refused_by_name():
    x = rand(64, 260)[:, :250]
    with pytest.raises(UnsupportedInputError, match="16-byte"):
        cutlass_ops.grouped_mm(x, rand(2, 250, 64), offsets([32, 32]))


def test_a_misaligned_address_is_refused_eagerly_and_compiled():
    x = rand(64 * 256 + 4)[4:].view(64, 256)  # bf16: 8 bytes past a 16-byte boundary
    w, offs = rand(2, 256, 64), offsets([32, 32])
    for call in (cutlass_ops.grouped_mm, torch.compile(cutlass_ops.grouped_mm, fullgraph=True)):
        with pytest.raises(Exception, match="16-byte"):
            call(x, w, offs)


def test_replays_in_a_cuda_graph_with_new_routing():
    x, w = rand(512, 256, scale=1 / 16), rand(4, 256, 256)
    offs = offsets([128, 128, 128, 128])
    cutlass_ops.grouped_mm(x, w, offs)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = cutlass_ops.grouped_mm(x, w, offs)
    offs.copy_(offsets([500, 4, 4, 4]))  # new routing, same buffers: no host sync anywhere
    graph.replay()
    torch.cuda.synchronize()
    close(y, grouped.reference(x, w, offs))


def test_compiles_with_fullgraph():
    x, w, offs = rand(512, 256, scale=1 / 16), rand(4, 256, 256), offsets([100, 0, 300, 112])
    compiled = torch.compile(cutlass_ops.grouped_mm, fullgraph=True)
    close(compiled(x, w, offs), grouped.reference(x, w, offs))


@pytest.mark.nvcc
@pytest.mark.parametrize("form", ["2d3d", "2d2d", "3d2d", "3d3d"])
def test_the_cutlass_grouped_kernel_computes_every_form(form):
    """The CUTLASS sm90 grouped kernel (csrc/grouped_launcher.cu, built on first use) on each
    form, with the layouts the backward passes produce, against the per-group reference."""
    from cutlass_ops.gemms.grouped import grouped_runtime

    sizes = [64, 0, 200, 248]
    offs = None if form == "3d3d" else offsets(sizes)
    if form == "2d3d":  # tokens x experts' nn.Linear weights ([E, N, K] seen as [E, K, N])
        a, b = rand(512, 256, scale=1 / 16), rand(4, 384, 256).transpose(1, 2)
    elif form == "2d2d":  # the weight gradient: x^T (column-major) x dy
        a, b = rand(512, 256, scale=1 / 16).t(), rand(512, 384)
    elif form == "3d2d":
        a, b = rand(4, 128, 256, scale=1 / 16), rand(256, 512)
    else:
        a, b = rand(4, 128, 256, scale=1 / 16), rand(4, 256, 384)
    expected = grouped.reference(a, b, offs)
    out = torch.full(expected.shape, float("nan"), device="cuda", dtype=BF16)
    config = grouped_runtime.config_for(a, b)
    grouped_runtime.run(config, form, a, b, offs, out)
    torch.cuda.synchronize()
    if form == "2d2d":  # the group with no K must be zeros, not left unwritten
        assert torch.count_nonzero(out[1]) == 0
    close(out, expected)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        grouped_runtime.run(config, form, a, b, offs, out)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    close(out, expected)


def test_a_grouped_entry_of_the_wrong_element_type_is_refused_at_lookup_and_at_launch(
        tmp_path, monkeypatch):
    """An imported entry naming an fp16 kernel for a bf16 key (issue 37): the store refuses it,
    grouped_mm runs torch._grouped_mm with the right result, and the launcher itself refuses
    an fp16 kernel for bf16 tensors before anything is built or launched."""
    from cutlass_ops.gemms.grouped import grouped_entries, grouped_runtime
    from cutlass_ops.gemms.grouped.grouped_build import GroupedConfig, GroupedProblem
    from custom_kernels.core.device import current_scope
    from custom_kernels.core.tuned_store import TuningCache

    monkeypatch.setenv("CUTLASS_OPS_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(grouped, "_tuned_by_signature", {})
    sizes = [64, 0, 320, 128]
    x, w, offs = rand(512, 256, scale=1 / 16), rand(4, 256, 512), offsets(sizes)
    wt = w.transpose(1, 2).contiguous().transpose(1, 2)  # an HF expert weight [N, K] as B
    problem = GroupedProblem.of("2d3d", x, wt, offs, "bf16", "t", "n")
    f16_kernel = GroupedConfig("f16", "t", "n")
    cache = TuningCache(current_scope(), grouped_entries.SCHEMA)
    report = cache.merge({problem.name: {"problem": problem.to_dict(), "prefer": "cutlass",
                                         "winner": f16_kernel.name, "winner_ms": 1e-3,
                                         "torch_ms": 1.0}})
    assert report.changed == 0 and "compiled for f16/t/n" in report.rejections[0].reason
    assert grouped_entries.tuned_config(problem) is None
    close(cutlass_ops.grouped_mm(x, wt, offs), grouped.reference(x, wt, offs))

    out = torch.empty(512, 512, device="cuda", dtype=BF16)
    with pytest.raises(UnsupportedInputError, match="compiled for f16 operands"):
        grouped_runtime.run(f16_kernel, "2d3d", x, wt, offs, out)
    with pytest.raises(UnsupportedInputError, match="compiled for layouts tt"):
        grouped_runtime.run(GroupedConfig("bf16", "t", "t"), "2d3d", x, wt, offs, out)
