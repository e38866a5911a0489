"""Running a function on gloo ranks on the CPU (or NCCL ranks on GPUs), for the tests of
distributed pieces: each rank
joins the process group, calls ``work(rank, world, *args)`` and saves what it returns (what
``torch.save`` writes); the test gets every rank's result, rank 0's first. One spawn costs
seconds: a test runs all its cases in one call."""

from __future__ import annotations

import os
import socket

import torch


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank, world, port, out, work, args, backend="gloo"):
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, rank=rank, world_size=world)
    try:
        torch.save(work(rank, world, *args), f"{out}.{rank}")
        dist.barrier()
    finally:
        dist.destroy_process_group()


def on_ranks(tmp_path, work, *args, world: int = 2, backend: str = "gloo") -> list:
    """``work(rank, world, *args)`` (a module-level function: it is pickled) on ``world`` gloo
    ranks (``backend="nccl"``: NCCL ranks, rank r on GPU r); the results, by rank."""
    out = str(tmp_path / "rank")
    torch.multiprocessing.spawn(_rank, args=(world, free_port(), out, work, args, backend),
                                nprocs=world, join=True)
    return [torch.load(f"{out}.{rank}") for rank in range(world)]
