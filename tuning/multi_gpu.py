"""Tuning on several GPUs: the shapes shared out, one worker per GPU, the results in one cache.

``shard(problems, parts)`` splits the problems so that each part's estimated measuring time is
close to the others' (longest first onto the least loaded part: the estimate is our ranking
model's time of the problem on the GPU, times a fixed count of timed calls, plus a fixed cost
per problem). Kernels are not split: one kernel serves every shape it fits, and the artifact
cache's per-kernel locks let the workers' builds wait for each other instead of compiling twice.
More GPUs shorten the measuring, not the compiling: nvcc runs on the host's cores, which the
workers share (docs/measurements.md has the two-GPU figures).

``cutlass-tune tune --gpus all|0,1,...``: the parent process runs one ``cutlass-tune tune``
worker per GPU (``CUDA_VISIBLE_DEVICES`` naming that GPU) on its part, which it reads from a
file (problems of any operands, so that no two workers ever measure on one GPU at once); every
worker writes the one tuning cache of this machine (its writes are locked and merged per
entry), keyed per GPU model as always. Under torchrun (``RANK`` / ``WORLD_SIZE`` set), each rank tunes its part of the
shapes on ``LOCAL_RANK``'s GPU, then ``gather_entries`` gives rank 0 every rank's entries
through torch.distributed, merged into its cache (``custom_kernels.core.tuned_store``'s rule: a
complete entry with a better winner replaces), so that a cluster of identical machines tunes
once.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Sequence

from cutlass_ops.gemms import ranking
from cutlass_ops.gemms.choice import Choice
from cutlass_ops.gemms.config import GemmConfig, GemmProblem
from custom_kernels.core.device import DeviceSpec

TIMED_CALLS = 600  # a problem's measured calls, about: candidates x repetitions
PER_PROBLEM_S = 2.0  # set-up, verification and the final round's overhead


def estimated_seconds(problem: GemmProblem, device: DeviceSpec) -> float:
    """What measuring ``problem`` costs, roughly: a typical kernel's modelled time times the
    calls a tune times, plus the fixed cost."""
    typical = Choice(GemmConfig(kernel_schedule="cooperative", tile=(128, 256, 64),
                                cluster=(2, 1, 1)))
    return PER_PROBLEM_S + TIMED_CALLS * ranking.estimate_us(problem, typical, device) / 1e6


def shard(problems: Sequence[GemmProblem], parts: int, device: DeviceSpec) -> list[list]:
    """``parts`` lists covering ``problems`` once each, balanced by ``estimated_seconds``
    (deterministic: ties by name). Each list keeps the problems' given order."""
    if parts < 1:
        raise ValueError(f"cannot share problems among {parts} GPUs")
    order = sorted(range(len(problems)), key=lambda i: (
        -estimated_seconds(problems[i], device), problems[i].name))
    loads = [0.0] * parts
    chosen: list[list[int]] = [[] for _ in range(parts)]
    for i in order:
        part = min(range(parts), key=lambda p: (loads[p], p))
        loads[part] += estimated_seconds(problems[i], device)
        chosen[part].append(i)
    return [[problems[i] for i in sorted(indices)] for indices in chosen]


def parse_gpus(spec: str, available: int) -> list[int]:
    """``all`` or a comma list of device indices, each below ``available``."""
    if spec == "all":
        if available < 1:
            raise ValueError("--gpus all: torch sees no CUDA GPU")
        return list(range(available))
    try:
        devices = [int(part) for part in spec.split(",")]
    except ValueError:
        raise ValueError(f"--gpus takes 'all' or device indices like 0,1; got {spec!r}") from None
    bad = [d for d in devices if not 0 <= d < available]
    if bad or len(set(devices)) != len(devices):
        raise ValueError(f"--gpus {spec}: each index once, below the {available} GPUs torch "
                         "sees")
    return devices


def worker_commands(parts: list[list[GemmProblem]], devices: list[int], options: Sequence[str],
                    workdir: Path) -> list[tuple[list[str], dict]]:
    """(argv, environment) of one ``cutlass-tune tune`` worker per non-empty part, its GPU alone
    visible. A part's problems (of any operands: a model's forward and backward GEMMs mix
    layouts and epilogues) go in a file in ``workdir`` that the worker reads, so that one
    process per GPU builds its kernels together and measures alone on its GPU."""
    commands = []
    for part, device in zip(parts, devices):
        if not part:
            continue
        path = Path(workdir) / f"gpu{device}-problems.json"
        path.write_text(json.dumps([problem.to_dict() for problem in part]))
        argv = [sys.executable, "-m", "tuning.cli", "tune", "--problems-file", str(path),
                *options]
        commands.append((argv, {**os.environ, "CUDA_VISIBLE_DEVICES": str(device)}))
    return commands


def read_problems_file(path: str) -> list[GemmProblem]:
    """The problems ``worker_commands`` wrote for a worker; ValueError naming the file when it
    cannot be read or is not such a list."""
    try:
        return [GemmProblem.from_dict(data) for data in json.loads(Path(path).read_text())]
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as exc:
        raise ValueError(f"--problems-file {path}: not a list of GEMM problems written by "
                         f"--gpus ({type(exc).__name__}: {exc})") from exc


def run_workers(commands: list[tuple[list[str], dict]]) -> list[int]:
    """Starts every worker at once (one per GPU) and waits for them all; their exit codes."""
    processes = [subprocess.Popen(argv, env=env) for argv, env in commands]
    return [p.wait() for p in processes]


def tune_on_gpus(problems: Sequence[GemmProblem], devices: list[int],
                 options: Sequence[str]) -> tuple[list[list[GemmProblem]], list[int]]:
    """``problems`` shared among ``devices`` (``shard``, by the first device's estimate), one
    ``cutlass-tune tune`` worker per device with ``options``; the parts and the exit codes."""
    from custom_kernels.core.device import current_spec

    parts = shard(problems, len(devices), current_spec(devices[0]))
    with tempfile.TemporaryDirectory(prefix="cutlass-tune-gpus-") as workdir:
        codes = run_workers(worker_commands(parts, devices, options, Path(workdir)))
    return parts, codes


def rank_share(problems: Sequence[GemmProblem], device: DeviceSpec) -> list[GemmProblem]:
    """Under torchrun: this rank's part of the problems (``RANK`` of ``WORLD_SIZE``)."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    return shard(problems, world, device)[rank]


def gather_entries(cache) -> int:
    """Every rank's entries of ``cache``'s scope and family merged into rank 0's cache
    (torch.distributed, initialized by the caller; any backend). Returns what rank 0 added or
    improved (0 on the other ranks)."""
    import torch.distributed as dist

    # Stored forms travel (plain JSON data), and rank 0 reads them through the schema.
    mine = {key: entry.to_dict() for key, entry in cache.entries().items()}
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    if dist.get_rank() != 0:
        return 0
    return sum(cache.merge(entries, f"rank {rank}").changed
               for rank, entries in enumerate(everyone) if rank)


__all__ = ["shard", "parse_gpus", "worker_commands", "run_workers", "rank_share",
           "gather_entries", "estimated_seconds", "read_problems_file",
           "tune_on_gpus"]
