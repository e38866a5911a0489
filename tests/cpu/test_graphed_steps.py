"""The parts of cutlass_ops.graphed_steps that need no GPU: signatures and what they refuse, the
holder's sightings and eviction, the loss and optimizer rules, and the eager path a refused call
takes (the same step as written by hand)."""

import copy

import pytest
import torch
from torch import nn

import cutlass_ops
from cutlass_ops import graphed_steps
from cutlass_ops.graphed_steps import CaptureRefused, Captured, Graphs, signature


class FakeCuda:
    """Stands for a CUDA tensor in signature tests: the fields a signature reads."""

    def __init__(self, shape, dtype=torch.bfloat16, requires_grad=False, ptr=0):
        self.shape, self.dtype, self.requires_grad, self._ptr = shape, dtype, requires_grad, ptr
        self.device = torch.device("cuda", 0)

    def stride(self):
        return (self.shape[-1], 1)

    def data_ptr(self):
        return self._ptr


@pytest.fixture
def fake_tensors(monkeypatch):
    """Signatures see FakeCuda objects as tensors."""
    monkeypatch.setattr(graphed_steps, "Tensor", FakeCuda)
    return FakeCuda


def test_a_signature_holds_shapes_dtypes_and_other_values(fake_tensors):
    a = signature((fake_tensors((2, 8)),), {"labels": fake_tensors((2, 8)), "flag": True})
    assert a == signature((fake_tensors((2, 8)),), {"labels": fake_tensors((2, 8)),
                                                    "flag": True})
    assert a != signature((fake_tensors((2, 16)),), {"labels": fake_tensors((2, 8)),
                                                     "flag": True})
    assert a != signature((fake_tensors((2, 8), torch.float16),),
                          {"labels": fake_tensors((2, 8)), "flag": True})
    assert a != signature((fake_tensors((2, 8)),), {"labels": fake_tensors((2, 8)),
                                                    "flag": False})
    assert a != signature((fake_tensors((2, 8), ptr=8),), {"labels": fake_tensors((2, 8)),
                                                           "flag": True})  # alignment


def test_a_signature_refuses_cpu_tensors_grad_inputs_and_unhashable_values(fake_tensors):
    with pytest.raises(CaptureRefused, match="requires grad"):
        signature((fake_tensors((2, 8), requires_grad=True),), {})
    with pytest.raises(CaptureRefused, match="neither a tensor nor hashable"):
        signature((fake_tensors((2, 8)),), {"options": {1, 2}})


def test_cpu_tensors_are_refused():
    with pytest.raises(CaptureRefused, match="CUDA graphs hold CUDA tensors only"):
        signature((torch.zeros(2),), {})


def test_the_holder_captures_on_the_second_sighting_and_drops_the_oldest():
    graphs = Graphs(max_graphs=2)
    assert not graphs.seen_before("a")
    assert graphs.seen_before("a")
    for key in ("a", "b", "c"):
        graphs.store(key, Captured(None, [], None))
    assert list(graphs.entries) == ["b", "c"]
    assert graphs.get("b") is not None
    graphs.store("d", Captured(None, [], None))
    assert list(graphs.entries) == ["b", "d"]  # "b" was used after "c"
    assert graphs.get("a") is None
    with pytest.raises(ValueError, match="at least 1"):
        Graphs(max_graphs=0)


def test_the_default_loss_is_the_outputs_loss_or_a_scalar():
    class Output:
        loss = torch.tensor(2.0)

    assert graphed_steps.default_loss(Output()) is Output.loss
    scalar = torch.tensor(3.0)
    assert graphed_steps.default_loss(scalar) is scalar
    with pytest.raises(CaptureRefused, match="no loss"):
        graphed_steps.default_loss(torch.ones(3))


def test_capturable_needs_every_group_to_say_so():
    a, b = nn.Parameter(torch.ones(2)), nn.Parameter(torch.ones(2))
    assert graphed_steps.capturable(torch.optim.AdamW([a, b], capturable=True))
    assert not graphed_steps.capturable(torch.optim.AdamW(
        [{"params": [a], "capturable": True}, {"params": [b], "capturable": False}]))
    assert not graphed_steps.capturable(torch.optim.SGD([a], lr=0.1))


def test_bad_options_are_refused():
    model = nn.Linear(4, 4)
    with pytest.raises(ValueError, match="on_refusal"):
        cutlass_ops.graphed_train_step(model, on_refusal="ignore")
    with pytest.raises(ValueError, match="at least 1"):
        cutlass_ops.graphed_forward(model, max_graphs=0)


class Mse(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x):
        return self.linear(x).square().mean()


def test_reset_all_drops_every_live_holder_s_graphs():
    """What a distributed program calls before destroy_process_group (NCCL waits for the graphs
    that captured its collectives); a holder no longer referenced is not kept alive for it."""
    import gc
    import weakref

    step = cutlass_ops.graphed_train_step(Mse())
    forward = cutlass_ops.graphed_forward(Mse())
    for holder in (step, forward):
        holder.graphs.store("key", Captured(None, [], None))
    dropped = weakref.ref(cutlass_ops.graphed_forward(Mse()))
    gc.collect()
    assert dropped() is None and {step, forward} <= set(graphed_steps._LIVE)
    graphed_steps.reset_all()
    assert not step.graphs.entries and not forward.graphs.entries


def test_a_refused_call_raises_by_default():
    step = cutlass_ops.graphed_train_step(Mse())
    with pytest.raises(CaptureRefused, match="CUDA tensors only"):
        step(torch.randn(4, 8))


def test_a_refused_call_runs_the_step_eagerly_on_request():
    """On the CPU every call is refused (CPU tensors): each one is the eager step, its gradients
    replacing the last ones and the optimizer stepping once, as the same step written by hand."""
    torch.manual_seed(0)
    model = Mse()
    reference = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    step = cutlass_ops.graphed_train_step(model, optimizer, on_refusal="eager")
    for _ in range(3):
        x = torch.randn(4, 8)
        loss = step(x)
        reference_optimizer.zero_grad(set_to_none=True)
        expected = reference(x)
        expected.backward()
        reference_optimizer.step()
        assert torch.equal(loss, expected.detach())
    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.equal(p, q) and torch.equal(p.grad, q.grad)


def test_a_refused_forward_runs_eagerly_without_grad():
    model = Mse()
    forward = cutlass_ops.graphed_forward(model, on_refusal="eager")
    x = torch.randn(4, 8)
    out = forward(x)
    assert not out.requires_grad
    assert torch.equal(out, model(x).detach())


@pytest.fixture
def world_of_one():
    """A gloo process group of one rank in this process (DDP, FSDP2 and DTensor need one)."""
    import os
    import socket

    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_distributed_models_are_refused_when_distributed_capture_is_off(world_of_one,
                                                                         monkeypatch):
    monkeypatch.setattr(graphed_steps, "CAPTURE_DISTRIBUTED", False)
    ddp = nn.parallel.DistributedDataParallel(Mse())
    assert "DistributedDataParallel model: graphed distributed steps are off" in \
        graphed_steps.distributed_refusal(ddp)
    assert graphed_steps.distributed_refusal(Mse()) is None


def test_the_first_distributed_capture_registers_the_exit_reset_and_says_so_once(monkeypatch):
    import atexit

    from custom_kernels.core import fallback

    registered, said = [], []
    monkeypatch.setattr(graphed_steps, "_exit_hook", [])
    monkeypatch.setattr(atexit, "register", lambda fn: registered.append(fn) or fn)
    monkeypatch.setattr(fallback, "log_once", lambda what, why: said.append(why))
    graphed_steps._hold_collectives()
    graphed_steps._hold_collectives()
    assert registered == [graphed_steps.reset_all]
    assert len(said) == 1 and "reset_all() before" in said[0]


def test_distributed_models_that_cannot_be_captured_are_refused_with_the_reason(world_of_one,
                                                                              monkeypatch):
    """With distributed capture on: on the CPU every distributed model is still refused (gloo, a
    CPU mesh); what NCCL allows (DDP, TP on a CUDA mesh) is graphed in
    tests/gpu/parallel/test_graphed_parallel_gpu.py."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, distribute_tensor

    monkeypatch.setattr(graphed_steps, "CAPTURE_DISTRIBUTED", True)
    ddp = nn.parallel.DistributedDataParallel(Mse())
    assert "over gloo" in graphed_steps.distributed_refusal(ddp)
    unused = nn.parallel.DistributedDataParallel(Mse(), find_unused_parameters=True)
    assert "find_unused_parameters" in graphed_steps.distributed_refusal(unused)
    mesh = init_device_mesh("cpu", (1,))
    sharded = Mse()
    fully_shard(sharded, mesh=mesh)
    assert "FSDP" in graphed_steps.distributed_refusal(sharded)
    tensor_parallel = Mse()
    tensor_parallel.linear.weight = nn.Parameter(distribute_tensor(
        tensor_parallel.linear.weight.detach(), mesh, [Replicate()]))
    assert "on a cpu mesh" in graphed_steps.distributed_refusal(tensor_parallel)
    assert graphed_steps.distributed_refusal(Mse()) is None
    with pytest.raises(CaptureRefused, match="DistributedDataParallel"):
        cutlass_ops.graphed_train_step(ddp)


def test_ddp_waits_for_its_warm_up_and_refuses_no_sync(world_of_one):
    """The capture rule, without a capture: a DDP step may be captured only after
    DDP_WARMUP_STEPS eager ones, never inside no_sync."""
    ddp = nn.parallel.DistributedDataParallel(Mse())
    ready = graphed_steps._ddp_ready
    assert ready(ddp, graphed_steps.DDP_WARMUP_STEPS - 1) == "warming up"
    assert ready(ddp, graphed_steps.DDP_WARMUP_STEPS) is None
    with ddp.no_sync():
        assert ready(ddp, graphed_steps.DDP_WARMUP_STEPS) == "inside no_sync"
    assert ready(Mse(), 0) is None


def test_a_refused_distributed_model_runs_eagerly_on_request(world_of_one):
    torch.manual_seed(0)
    model = Mse()
    reference = copy.deepcopy(model)
    step = cutlass_ops.graphed_train_step(nn.parallel.DistributedDataParallel(model),
                                          on_refusal="eager")
    x = torch.randn(4, 8)
    loss = step(x)
    expected = reference(x)
    expected.backward()
    assert torch.equal(loss, expected.detach())
    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.equal(p.grad, q.grad)
