"""Tuning on several GPUs, the parts a CPU can run: shape sharding, the workers' command lines
(which must give back the same problems), --gpus parsing, and rank 0 gathering every rank's
entries through torch.distributed (gloo, world size 2)."""

import os

import pytest
import torch

from cutlass_ops.gemms.config import GemmOperands, GemmProblem
from custom_kernels.core.device import named_spec
from tuning import multi_gpu

H100 = named_spec("H100")
LLM = [GemmProblem(GemmOperands.make("bf16"), m, n, k) for m in (16, 128, 1024, 4096, 16384)
       for n, k in ((4096, 4096), (14336, 4096), (4096, 14336))] + [
    GemmProblem(GemmOperands.make("bf16"), 8192, 8192, 8192)]


@pytest.mark.parametrize("parts", [1, 2, 3, 8])
def test_shards_cover_every_problem_once_balanced_and_deterministic(parts):
    shards = multi_gpu.shard(LLM, parts, H100)
    assert len(shards) == parts
    assert sorted(p.name for s in shards for p in s) == sorted(p.name for p in LLM)
    cost = [sum(multi_gpu.estimated_seconds(p, H100) for p in s) for s in shards]
    largest = max(multi_gpu.estimated_seconds(p, H100) for p in LLM)
    assert max(cost) - min(cost) <= largest  # greedy longest-first bound
    assert shards == multi_gpu.shard(LLM, parts, H100)
    for s in shards:  # each part keeps the given order
        assert s == sorted(s, key=LLM.index)


def test_gpu_lists_are_parsed_and_refused_by_name():
    assert multi_gpu.parse_gpus("all", 4) == [0, 1, 2, 3]
    assert multi_gpu.parse_gpus("1,3", 4) == [1, 3]
    for spec, words in (("0,4", "below the 4"), ("0,0", "once"), ("a,b", "device indices")):
        with pytest.raises(ValueError, match=words):
            multi_gpu.parse_gpus(spec, 4)
    with pytest.raises(ValueError, match="no CUDA GPU"):
        multi_gpu.parse_gpus("all", 0)
    with pytest.raises(ValueError, match="0 GPUs"):
        multi_gpu.shard(LLM, 0, H100)


def test_worker_commands_give_back_the_same_problems(tmp_path):
    """Each worker's argv, parsed by the CLI, makes exactly its part's problems (operands with
    layouts, out dtype, epilogues and batches included, mixed in one part), with its GPU alone
    visible: one worker per GPU, so that no two measure on one GPU at once."""
    from tuning.cli import _problems, build_parser

    mixed = LLM[:4] + [
        GemmProblem(GemmOperands.make("bf16", layout_a="row", layout_b="row"), 4096, 4096, 14336),
        GemmProblem(GemmOperands.make("f16", out_dtype="f32", epilogue="bias,gelu_tanh"),
                    1024, 4096, 4096),
        GemmProblem(GemmOperands.make("bf16"), 256, 512, 128, 4)]
    parts = multi_gpu.shard(mixed, 2, H100)
    commands = multi_gpu.worker_commands(parts, [2, 5], ["--strategy", "quick"], tmp_path)
    assert [env["CUDA_VISIBLE_DEVICES"] for _, env in commands] == ["2", "5"]
    for (argv, env), part in zip(commands, parts):
        assert argv[1:4] == ["-m", "tuning.cli", "tune"]
        args = build_parser().parse_args(argv[3:])
        assert args.strategy == "quick"
        assert [p.name for p in _problems(args)] == [p.name for p in part]
    assert any(len({p.operands for p in part}) > 1 for part in parts)


@pytest.mark.parametrize("text", [None, "{not json", "[1, 2]", '[{"m": 16}]'])
def test_a_bad_problems_file_is_refused_by_name(tmp_path, text):
    path = tmp_path / "gpu0-problems.json"
    if text is not None:
        path.write_text(text)
    with pytest.raises(ValueError, match="--problems-file .*gpu0-problems.json"):
        multi_gpu.read_problems_file(str(path))


def test_an_empty_part_gets_no_worker(tmp_path):
    commands = multi_gpu.worker_commands([LLM[:1], []], [0, 1], [], tmp_path)
    assert [env["CUDA_VISIBLE_DEVICES"] for _, env in commands] == ["0"]


def _gather_on_rank(rank: int, world: int, root: str, port: int, out: str) -> None:
    import torch.distributed as dist

    from cutlass_ops.gemms.config import GemmConfig
    from cutlass_ops.gemms.gemm_entries import gemm_cache
    from custom_kernels.core.tuned_store import CacheScope

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    scope = CacheScope("NVIDIA H100 80GB HBM3", 90, 132, "580.0", "13.0", "4.2.0.0", "test")
    cache = gemm_cache(scope, __import__("pathlib").Path(root) / f"rank{rank}")
    mine = multi_gpu.shard(LLM, world, H100)[rank]
    winner = {"config": GemmConfig().to_dict(), "swap_ab": False}
    for problem in mine:  # what this rank's tune would have stored
        cache.put(problem, {"winner": winner, "winner_ms": 1.0 + rank, "torch_ms": 2.0,
                            "complete": True})
    changed = multi_gpu.gather_entries(cache)
    if rank == 0:
        with open(out, "w") as f:
            f.write(f"{changed} {len(cache.entries())}")
    dist.barrier()
    dist.destroy_process_group()


def test_rank_zero_gathers_every_ranks_entries_over_gloo(tmp_path):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "result.txt"
    torch.multiprocessing.spawn(_gather_on_rank, args=(2, str(tmp_path), port, str(out)),
                                nprocs=2, join=True)
    changed, total = map(int, out.read_text().split())
    shares = multi_gpu.shard(LLM, 2, H100)
    assert changed == len(shares[1]) and total == len(LLM)
