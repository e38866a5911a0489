"""Graphed steps of distributed models on 2 GPUs (marker gpu; NCCL ranks): the NCCL collectives
captured with the rest. A tensor-parallel converted model (``parallelize``) and a DDP-wrapped
converted model, each stepped by ``graphed_train_step`` (TP also with ``graphed_forward``)
beside a twin stepped eagerly on the same data: the losses, every gradient and, after
optimizer steps, every parameter equal bit for bit (the same kernels and collectives in the
same order; a replay changes no arithmetic). DDP is captured only after its warm-up."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
# The sharded model and the two-GPU marks of the TP test beside this one (it puts the shared
# helpers' folders on the path).
from test_tensor_parallel_gpu import GPU_CONFIG, pytestmark  # noqa: E402, F401

import distributed_steps  # noqa: E402
from gloo_ranks import on_ranks  # noqa: E402
from test_tensor_parallel import _model  # noqa: E402

STEPS = 3


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def _differences(a: dict, b: dict) -> dict:
    """Each name whose tensors differ, with the largest absolute difference."""
    return {name: float((_local(a[name]).float() - _local(b[name]).float()).abs().max())
            for name in a if not torch.equal(_local(a[name]), _local(b[name]))}


def _grads(model) -> dict:
    return {n: _local(p.grad).detach().clone() for n, p in model.named_parameters()
            if p.grad is not None}


def _params(model) -> dict:
    return {n: _local(p).detach().clone() for n, p in model.named_parameters()}


def _adamw(model):
    # Not foreach: a parallelized model's parameters mix DTensors (the sharded ones) and plain
    # tensors, and DTensor refuses such a list in _foreach_mul_ (seen on an H200).
    return torch.optim.AdamW(model.parameters(), lr=1e-3, capturable=True, foreach=False)


def _guarded(rank, world, work):
    """``work(rank, world)`` on a rank that prints its stack and exits after 120 s (a capture
    or replay that hangs then fails the test, naming where), its graphs dropped before the
    process group is destroyed (NCCL waits for them: pytorch#115388)."""
    import faulthandler

    from cutlass_ops import graphed_steps

    faulthandler.dump_traceback_later(120, exit=True)
    try:
        return work(rank, world)
    finally:
        graphed_steps.reset_all()
        faulthandler.cancel_dump_traceback_later()



def _eager_step(model, optimizer, **batch):
    model.zero_grad(set_to_none=True)
    loss = model(**batch).loss
    loss.backward()
    if optimizer is not None:
        optimizer.step()
    return loss.detach()


def _tensor_parallel(rank, world):
    """Losses, gradients and parameters of the graphed TP model against its eager twin, over
    ``STEPS`` steps without and with a captured AdamW; graphed prefill logits."""
    import cutlass_ops
    from torch.distributed.device_mesh import init_device_mesh

    from cutlass_ops import graphed_steps
    from cutlass_ops.parallel import tensor_parallel

    graphed_steps.CAPTURE_DISTRIBUTED = True  # this rank's process: what the test verifies

    mesh = init_device_mesh("cuda", (world,))
    ids = torch.randint(0, GPU_CONFIG["vocab_size"], (2, 64),
                        generator=torch.Generator().manual_seed(1)).cuda()
    out = {}
    for with_optimizer in (False, True):
        eager = tensor_parallel.parallelize(_model("cuda", GPU_CONFIG), mesh)
        graphed = tensor_parallel.parallelize(_model("cuda", GPU_CONFIG), mesh)
        eager_opt = _adamw(eager) if with_optimizer else None
        step = cutlass_ops.graphed_train_step(graphed, _adamw(graphed) if with_optimizer
                                              else None)
        losses = []
        for _ in range(STEPS):
            expected = _eager_step(eager, eager_opt, input_ids=ids, labels=ids)
            got = step(input_ids=ids, labels=ids)
            losses.append(torch.equal(_local(got), _local(expected)))
        out[with_optimizer] = {"losses_equal": losses, "captured": len(step.graphs.entries),
                               "grads": _differences(_grads(graphed), _grads(eager)),
                               "params": _differences(_params(graphed), _params(eager))}
    forward = cutlass_ops.graphed_forward(graphed)
    for _ in range(STEPS):
        logits = forward(input_ids=ids).logits
    with torch.no_grad():
        expected = graphed(input_ids=ids).logits
    out["prefill_equal"] = torch.equal(_local(logits), _local(expected))
    out["prefill_captured"] = len(forward.graphs.entries)
    return out


def test_a_tensor_parallel_step_replays_equal_to_its_eager_twin(tmp_path):
    results = on_ranks(tmp_path, _guarded, _tensor_parallel, world=2, backend="nccl")
    for rank, got in enumerate(results):
        for with_optimizer in (False, True):
            r = got[with_optimizer]
            assert r["captured"] == 1, (rank, with_optimizer)
            assert all(r["losses_equal"]), (rank, with_optimizer, r["losses_equal"])
            assert r["grads"] == {}, (rank, with_optimizer, r["grads"])
            assert r["params"] == {}, (rank, with_optimizer, r["params"])
        assert got["prefill_captured"] == 1 and got["prefill_equal"], rank


def _data_parallel(rank, world):
    """A DDP model stepped by graphed_train_step with a captured AdamW, against its eager twin
    on the same rank's batch: when the capture came, the losses, the reduced gradients and the
    parameters after every step."""
    import cutlass_ops
    from cutlass_ops import graphed_steps

    graphed_steps.CAPTURE_DISTRIBUTED = True  # this rank's process: what the test verifies
    ids = distributed_steps.batch("cuda").chunk(world)[rank]
    # torch's notes on CUDA graphs with DDP: build it, and warm it up, on a side stream (the
    # first GPU run, on the default stream, failed inside the capture).
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    twins = []
    with torch.cuda.stream(side):
        for _ in range(2):
            model, _ = distributed_steps.build("cuda", torch.bfloat16)
            twins.append(torch.nn.parallel.DistributedDataParallel(model, device_ids=[rank]))
    eager, graphed = twins
    eager_opt = _adamw(eager)
    step = cutlass_ops.graphed_train_step(graphed, _adamw(graphed))
    losses, captured_at = [], None
    with torch.cuda.stream(side):
        for i in range(graphed_steps.DDP_WARMUP_STEPS + STEPS):
            expected = _eager_step(eager, eager_opt, input_ids=ids, labels=ids)
            losses.append(torch.equal(step(input_ids=ids, labels=ids), expected))
            if captured_at is None and step.graphs.entries:
                captured_at = i
    torch.cuda.current_stream().wait_stream(side)
    return {"losses_equal": losses, "captured_at": captured_at,
            "grads": _differences(_grads(graphed), _grads(eager)),
            "params": _differences(_params(graphed), _params(eager))}


def test_a_ddp_step_is_captured_after_its_warm_up_and_replays_equal(tmp_path):
    from cutlass_ops import graphed_steps

    results = on_ranks(tmp_path, _guarded, _data_parallel, world=2, backend="nccl")
    for rank, got in enumerate(results):
        assert got["captured_at"] == graphed_steps.DDP_WARMUP_STEPS, (rank, got["captured_at"])
        assert all(got["losses_equal"]), (rank, got["losses_equal"])
        assert got["grads"] == {}, (rank, got["grads"])
        assert got["params"] == {}, (rank, got["params"])
