"""Beyond one GPU: the tune on several local GPUs, and a converted model training under DDP and
FSDP2 (``fully_shard``), against the unconverted one.

Rows (BENCHMARKS.md schema):
- ``tune N GPUs vs 1``: ``cutlass-tune tune`` of the 16 LLM shapes (``--strategy``, quick by
  default) in a child process on an empty cache, once on one GPU and once with ``--gpus`` over
  N; unit 1/s, ``ratio`` = the 1-GPU wall time over the N-GPU one.
- ``ddp train converted vs unconverted`` and ``fsdp2 ...``: the e2e benchmark's Llama-3-8B-shaped
  model (``--layers``, random bf16 weights) on N ranks (one per GPU, NCCL), each rank a
  ``--tokens`` slice of one global batch: forward, backward and the clip of the gradients (DDP:
  ``custom_kernels.clip_grad_norm_``; FSDP2: ``clip_grad_distributed.clip_grad_norm_``; the
  unconverted model: torch's), the two models' steps interleaved; unit tokens/s over all ranks.
  ``detail`` has the loss (averaged over ranks) and the gradients' largest relative error
  against one GPU running the whole global batch, and the converted model's speedup on one GPU
  (rank 0's slice), which the distributed speedup is judged against.

    torchrun is not needed: python benchmarks/multigpu.py [--gpus 2] [--layers 4] [--tokens 4096]
        [--strategy quick] [--skip-tune]

Needs ``--gpus`` CUDA GPUs (``--gpus 1`` runs every code path at world size 1, as a smoke run;
its rows say so). Writes benchmarks/results/multigpu.json (multigpu_1gpu.json with ``--gpus 1``).
"""

from __future__ import annotations

import argparse
import copy
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from benchmarks.common import print_table, require_gpu, write_result  # noqa: E402
from benchmarks.e2e import SEQUENCES, llama  # noqa: E402
from benchmarks.gemm import LLM_SHAPES  # noqa: E402


def tune_wall_s(gpus: list[int], strategy: str) -> float:
    """``cutlass-tune tune`` of the 16 shapes on ``gpus`` with an empty cache, timed."""
    command = [sys.executable, "-m", "tuning.cli", "tune",
               *(f"{m}x{n}x{k}" for m, n, k in LLM_SHAPES), "--strategy", strategy,
               "--no-progress"]
    if len(gpus) > 1:
        command += ["--gpus", ",".join(map(str, gpus))]
    with tempfile.TemporaryDirectory(prefix="cutlass-ops-multigpu-") as cache:
        env = dict(os.environ, CUTLASS_OPS_CACHE_DIR=cache)  # cold: nothing built or tuned
        start = time.perf_counter()
        subprocess.run(command, check=True, env=env, stdout=subprocess.DEVNULL)
        return time.perf_counter() - start


def spawn(fn, world: int, *args) -> None:
    """``fn(rank, world, port, *args)`` on ``world`` processes (one GPU each)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.multiprocessing.spawn(fn, args=(world, port, *args), nprocs=world, join=True)


def global_batch(world: int, tokens: int) -> torch.Tensor:
    rows = SEQUENCES * world
    return torch.randint(0, 128256, (rows, tokens // SEQUENCES),
                         generator=torch.Generator().manual_seed(0))


def step_fn(model, ids, clip):
    def step():
        model.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        clip(model.parameters())
        return loss
    return step


def full_grads(model) -> dict:
    out = {}
    for name, p in model.named_parameters():
        if p.grad is not None:
            g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            out[name.replace("module.", "")] = g.detach().float().cpu()
    return out


def timed(steps: dict, reps: int) -> dict:
    """Median ms of each step, the steps interleaved repetition by repetition."""
    times = {name: [] for name in steps}
    for rep in range(reps + 1):
        for name, step in steps.items():
            torch.distributed.barrier()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(
                enable_timing=True)
            start.record()
            step()
            end.record()
            torch.cuda.synchronize()
            if rep:  # the first repetition warms up
                times[name].append(start.elapsed_time(end))
    return {name: sorted(t)[len(t) // 2] for name, t in times.items()}


def rank_main(rank: int, world: int, port: int, mode: str, layers: int, tokens: int,
              reps: int, out: str) -> None:
    import torch.distributed as dist

    import cutlass_ops
    from custom_kernels import clip_grad, clip_grad_distributed

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world)
    plain = llama(layers)
    ours = copy.deepcopy(plain)
    cutlass_ops.convert(ours)
    models = {"ours": ours, "unconverted": plain}
    if mode == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for model in models.values():
            for layer in model.model.layers:
                fully_shard(layer)
            fully_shard(model)
        clips = {"ours": lambda p: clip_grad_distributed.clip_grad_norm_(p, 1.0),
                 "unconverted": lambda p: torch.nn.utils.clip_grad_norm_(p, 1.0)}
    else:
        models = {k: torch.nn.parallel.DistributedDataParallel(m, device_ids=[rank])
                  for k, m in models.items()}
        clips = {"ours": lambda p: clip_grad.clip_grad_norm_(p, 1.0),
                 "unconverted": lambda p: torch.nn.utils.clip_grad_norm_(p, 1.0)}
    ids = global_batch(world, tokens).chunk(world)[rank].cuda()
    steps = {k: step_fn(models[k], ids, clips[k]) for k in models}
    record = {}
    for name, step in steps.items():  # one step for the checks, before any timing
        models[name].zero_grad(set_to_none=True)
        loss = models[name](input_ids=ids, labels=ids).loss
        loss.backward()
        loss = loss.detach().float()
        dist.all_reduce(loss)
        record[name] = {"loss": float(loss) / world, "grads": full_grads(models[name])}
        models[name].zero_grad(set_to_none=True)
    ms = timed(steps, reps)
    if rank == 0:
        torch.save({"ms": ms, "record": record}, out)
    dist.barrier()
    dist.destroy_process_group()


def one_gpu(layers: int, world: int, tokens: int, reps: int) -> dict:
    """One GPU: the whole global batch's loss and gradients (the checks' reference), and the
    converted model's speedup on one rank's slice."""
    import cutlass_ops
    from custom_kernels import clip_grad

    plain = llama(layers)
    ours = copy.deepcopy(plain)
    cutlass_ops.convert(ours)
    whole = global_batch(world, tokens).cuda()
    reference = {}
    for name, model in (("ours", ours), ("unconverted", plain)):
        loss = model(input_ids=whole, labels=whole).loss
        loss.backward()
        reference[name] = {"loss": float(loss.float()), "grads": full_grads(model)}
        model.zero_grad(set_to_none=True)
    part = whole.chunk(world)[0]
    from tuning.timing import do_bench_interleaved

    times = do_bench_interleaved(
        {"ours": step_fn(ours, part, lambda p: clip_grad.clip_grad_norm_(p, 1.0)),
         "unconverted": step_fn(plain, part, lambda p: torch.nn.utils.clip_grad_norm_(p, 1.0))},
        warmup=1, reps=reps, flush_l2=False)
    del ours, plain
    torch.cuda.empty_cache()
    return {"reference": reference,
            "speedup": times["unconverted"].median_ms / times["ours"].median_ms}


def worst_error(got: dict, expected: dict) -> float:
    from custom_kernels.core.tolerances import relative_error

    shared = got.keys() & expected.keys()
    return max((relative_error(got[k], expected[k]) for k in shared), default=float("nan"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", type=int, default=2)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=4096, help="tokens per rank")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--strategy", default="quick", choices=("quick", "default"))
    parser.add_argument("--skip-tune", action="store_true", help="only the training rows")
    args = parser.parse_args()
    require_gpu()
    if torch.cuda.device_count() < args.gpus:
        sys.exit(f"--gpus {args.gpus}: this machine has {torch.cuda.device_count()} GPU(s)")
    world, name = args.gpus, "multigpu" if args.gpus > 1 else "multigpu_1gpu"
    rows = []
    if world > 1 and not args.skip_tune:
        one = tune_wall_s([0], args.strategy)
        many = tune_wall_s(list(range(world)), args.strategy)
        rows.append({"case": f"tune {world} GPUs vs 1", "unit": "1/s",
                     "ours": round(1 / many, 5), "reference": round(1 / one, 5),
                     "reference_name": "1 GPU", "ratio": round(one / many, 4), "correct": True,
                     "detail": {"strategy": args.strategy, "shapes": len(LLM_SHAPES),
                                "one_gpu_s": round(one, 1), "gpus_s": round(many, 1)}})
        print(rows[-1]["case"], rows[-1]["ratio"], flush=True)
    single = one_gpu(args.layers, world, args.tokens, args.reps)
    for mode in ("ddp", "fsdp2"):
        with tempfile.TemporaryDirectory() as tmp:
            out = str(Path(tmp) / "rank0.pt")
            spawn(rank_main, world, mode, args.layers, args.tokens, args.reps, out)
            got = torch.load(out, weights_only=False)
        checks = {}
        for variant in ("ours", "unconverted"):
            expected = single["reference"][variant]
            checks[variant] = {
                "loss": got["record"][variant]["loss"], "one_gpu_loss": expected["loss"],
                "grad_max_relative_error": worst_error(got["record"][variant]["grads"],
                                                       expected["grads"])}
        correct = all(abs(c["loss"] - c["one_gpu_loss"]) <= 1e-2 * abs(c["one_gpu_loss"])
                      and c["grad_max_relative_error"] < 5e-2 for c in checks.values())
        ms = got["ms"]
        total_tokens = args.tokens * world
        speedup = ms["unconverted"] / ms["ours"]
        rows.append({"case": f"{mode} train converted vs unconverted, {world} GPU"
                             f"{'s' if world > 1 else ''}, {args.layers} layers",
                     "unit": "tokens/s", "ours": round(total_tokens / ms["ours"] * 1e3, 1),
                     "reference": round(total_tokens / ms["unconverted"] * 1e3, 1),
                     "reference_name": f"unconverted under {mode}", "ratio": round(speedup, 4),
                     "correct": correct,
                     "detail": {"ours_ms": ms["ours"], "reference_ms": ms["unconverted"],
                                "one_gpu_speedup": round(single["speedup"], 4),
                                "speedup_vs_one_gpu_speedup": round(
                                    speedup / single["speedup"], 4),
                                "checks": checks, "tokens_per_rank": args.tokens}})
        print(rows[-1]["case"], rows[-1]["ratio"], flush=True)
        write_result(name, rows, world_size=world)
    print_table(["case", "ours", "reference", "ratio", "correct"],
                [[r["case"], r["ours"], r["reference"], r["ratio"], r["correct"]]
                 for r in rows])
    write_result(name, rows, world_size=world)


if __name__ == "__main__":
    main()
