"""The skew dispatch on the GPU: the routing split kernel against its reference (in a CUDA graph
too), every grouped kernel idle on all-empty groups (writes nothing), and a ``SkewDispatch`` of
two kernels correct on even, skewed and empty-group routings, switching kernels inside one CUDA
graph as the routing changes, and dispatched by ``cutlass_ops.grouped_mm`` with gradients (the
DSL kernels skip without ``cutlass-ops[dsl]``)."""

import pytest
import torch

import cutlass_ops
from custom_kernels.moe import routing_split
from custom_kernels.core.tolerances import relative_error
from cutlass_ops.moe import grouped
from cutlass_ops.gemms import dsl
from cutlass_ops.gemms.grouped import grouped_build, grouped_entries, grouped_runtime, skew_dispatch
from cutlass_ops.gemms.grouped.grouped_build import GroupedConfig
from cutlass_ops.gemms.grouped.skew_dispatch import SkewDispatch

# The split kernel is NVRTC's; the cases with our C++ grouped kernel (CPP) build it with nvcc.
pytestmark = pytest.mark.gpu
needs_dsl = pytest.mark.skipif(dsl.unavailable() is not None, reason="no cutlass-ops[dsl]")

CPP = GroupedConfig()  # cooperative 128x256, bf16, tokens x [E, N, K] weights
SHORT = "dsl-sm90-pingpong-t64x128x128-c2x1"
WIDE = "dsl-sm90-pingpong-t128x192-c2x1"
EVEN = [128, 128, 128, 128]
SKEWED = [480, 16, 16, 0]  # the largest group holds 3.75x the mean


def offsets(sizes):
    return torch.tensor(sizes, device="cuda").cumsum(0).to(torch.int32)


def rand(*shape, scale=1.0):
    return (torch.randn(*shape, device="cuda") * scale).to(torch.bfloat16)


def operands():
    """Tokens x four experts' nn.Linear weights ([E, N, K] seen as [E, K, N]), 512 rows."""
    return rand(512, 256, scale=1 / 16), rand(4, 384, 256).transpose(1, 2)


@pytest.mark.parametrize("groups", [1, 8, 256, 300, 1000])
@pytest.mark.parametrize("skew", [1.0, 1.7, 6.5])
def test_the_split_kernel_matches_its_reference(groups, skew):
    g = torch.Generator("cuda").manual_seed(groups)
    for sizes in (torch.full((groups,), 64, device="cuda"),
                  torch.randint(0, 512, (groups,), device="cuda", generator=g),
                  torch.zeros(groups, device="cuda", dtype=torch.long)):
        offs = sizes.cumsum(0).to(torch.int32)
        for got, want in zip(routing_split.split_by_skew(offs, skew),
                             routing_split.reference(offs, skew)):
            assert torch.equal(got, want)


def test_the_split_replays_in_a_cuda_graph_with_new_routing():
    offs = offsets(EVEN)
    routing_split.split_by_skew(offs, 2.0)  # loaded before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        even, uneven = routing_split.split_by_skew(offs, 2.0)
    for sizes, skewed in ((SKEWED, True), (EVEN, False)):
        offs.copy_(offsets(sizes))
        graph.replay()
        torch.cuda.synchronize()
        assert (uneven if skewed else even).tolist() == offs.tolist()
        assert not (even if skewed else uneven).any()


def test_the_split_launches_from_a_thread_whose_first_cuda_work_it_is():
    """As in autograd's worker thread when a backward starts with it (custom_kernels.launch binds
    the context: the driver API needs one current in the calling thread)."""
    import threading

    offs = offsets(SKEWED)
    routing_split.split_by_skew(offs, 2.0)  # compiled and loaded here
    result, errors = [], []

    def work():
        try:
            result.append(routing_split.split_by_skew(offs, 2.0))
            torch.cuda.synchronize()
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    assert not errors, errors
    assert result[0][1].tolist() == offs.tolist()


@pytest.mark.parametrize("config", [pytest.param(CPP, marks=pytest.mark.nvcc),
                                    pytest.param(SHORT, marks=needs_dsl),
                                    pytest.param(WIDE, marks=needs_dsl),
                                    pytest.param(WIDE + "-dynamic", marks=needs_dsl)],
                         ids=["cutlass", "dsl-short", "dsl-wide", "dsl-wide-dynamic"])
def test_a_kernel_on_all_empty_groups_writes_nothing(config):
    config = grouped_build.config_from_name(config) if isinstance(config, str) else config
    a, b = operands()
    out = torch.full((512, 384), 7.0, device="cuda", dtype=torch.bfloat16)
    grouped_runtime.launch(config, "2d3d", a, b, torch.zeros(4, device="cuda",
                                                             dtype=torch.int32), out)
    torch.cuda.synchronize()
    assert bool((out == 7.0).all())


def pairs():
    return [pytest.param(lambda: SkewDispatch(CPP, dsl.DslConfig.from_name(SHORT), 2.0),
                         marks=[needs_dsl, pytest.mark.nvcc], id="cutlass+dsl"),
            pytest.param(lambda: SkewDispatch(dsl.DslConfig.from_name(SHORT),
                                              dsl.DslConfig.from_name(WIDE), 2.0),
                         marks=needs_dsl, id="dsl+dsl"),
            pytest.param(lambda: SkewDispatch(dsl.DslConfig.from_name(SHORT + "-dynamic"),
                                              dsl.DslConfig.from_name(WIDE + "-dynamic"), 2.0),
                         marks=needs_dsl, id="dsl+dsl-dynamic")]


@pytest.mark.parametrize("make", pairs())
@pytest.mark.parametrize("sizes", [EVEN, SKEWED, [0, 0, 512, 0], [0, 0, 0, 0]], ids=str)
def test_a_skew_dispatch_computes_every_routing_once(make, sizes):
    config, (a, b) = make(), operands()
    offs = offsets(sizes)
    expected = grouped.reference(a, b, offs)
    out = torch.full(expected.shape, float("nan"), device="cuda", dtype=torch.bfloat16)
    grouped_runtime.launch(config, "2d3d", a, b, offs, out)
    torch.cuda.synchronize()
    rows = int(offs[-1])  # rows past the last group belong to no group: left as they were
    if rows:
        assert relative_error(out[:rows], expected[:rows]) < 2e-2  # NaN fails


@pytest.mark.parametrize("make", pairs())
def test_one_cuda_graph_switches_kernels_as_the_routing_changes(make, monkeypatch):
    config, (a, b) = make(), operands()
    ran = []
    real = grouped_runtime.launch

    def recorded(cfg, form, a, b, offs, out):  # which kernel got the rows, read after replay
        if not skew_dispatch.is_skew_dispatch(cfg):
            ran.append((cfg, offs))
        return real(cfg, form, a, b, offs, out)

    monkeypatch.setattr(grouped_runtime, "launch", recorded)
    offs = offsets(EVEN)
    out = torch.empty(512, 384, device="cuda", dtype=torch.bfloat16)
    recorded(config, "2d3d", a, b, offs, out)  # loads both kernels and the split
    ran.clear()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        recorded(config, "2d3d", a, b, offs, out)
    (first, first_offs), (second, second_offs) = ran
    assert (first, second) == (config.even, config.skewed)
    for sizes, busy in ((SKEWED, second_offs), (EVEN, first_offs), (SKEWED, second_offs)):
        offs.copy_(offsets(sizes))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert busy.tolist() == offs.tolist()  # the kernel for this routing had every row
        assert relative_error(out, grouped.reference(a, b, offs)) < 2e-2


@needs_dsl
@pytest.mark.nvcc  # the winner's even kernel is our C++ grouped kernel
def test_grouped_mm_dispatches_a_skew_dispatch_winner_with_gradients(monkeypatch):
    short = dsl.DslConfig.from_name(SHORT)
    forms = []
    real = skew_dispatch.launch

    def winner(problem, device=None):  # 2d3d keys (forward, dX) only, as the tuner stores them
        if problem.form != "2d3d":
            return None
        return SkewDispatch(GroupedConfig(layout_a=problem.layout_a,
                                          layout_b=problem.layout_b), short, 2.0)

    def counted(config, launch_one, form, *args):
        forms.append(form)
        return real(config, launch_one, form, *args)

    monkeypatch.setattr(grouped_entries, "tuned_config", winner)
    monkeypatch.setattr(grouped, "_tuned_by_signature", {})
    monkeypatch.setattr(skew_dispatch, "launch", counted)
    x = rand(512, 256, scale=1 / 16).requires_grad_()
    w = rand(4, 384, 256).requires_grad_()
    for sizes in (SKEWED, EVEN):
        offs = offsets(sizes)
        y = cutlass_ops.grouped_mm(x, w.transpose(1, 2), offs)
        dy = rand(*y.shape)
        y.backward(dy)
        x_ref, w_ref = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
        expected = grouped.reference(x_ref, w_ref.transpose(1, 2), offs)
        expected.backward(dy)
        assert relative_error(y, expected) < 2e-2
        assert relative_error(x.grad, x_ref.grad) < 2e-2
        assert relative_error(w.grad, w_ref.grad) < 2e-2  # dW (2d2d): torch._grouped_mm
        x.grad = w.grad = None
    assert forms == ["2d3d"] * 4  # forward and dX, for each routing
    compiled = torch.compile(cutlass_ops.grouped_mm, fullgraph=True)
    x, w, offs = x.detach(), w.detach().transpose(1, 2), offsets(SKEWED)
    assert relative_error(compiled(x, w, offs), grouped.reference(x, w, offs)) < 2e-2
    assert len(forms) == 5
