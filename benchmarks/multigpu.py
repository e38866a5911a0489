"""Beyond one GPU: the tune on several local GPUs, and a converted model training under DDP and
FSDP2 (``fully_shard``), against the unconverted one.

Rows (BENCHMARKS.md schema), in two sections (``--sections``, each a run of its own if need be;
a run adds its rows to those of the other section written by the same code):
- ``tune`` section, ``tune N GPUs vs 1``: ``cutlass-tune tune`` of the 16 LLM shapes
  (``--strategy``, quick by default; another strategy is named in the case) in a child process
  on an empty cache, once on one GPU and once with ``--gpus`` over N; unit 1/s, ``ratio`` = the
  1-GPU wall time over the N-GPU one. ``tune N GPUs vs 1, kernels built``: the two tunes again
  with the compiled kernels (C++ and CuTe DSL) of the first kept and its tuning results deleted
  (re-tuning after ``cutlass-tune clear``, on another GPU model of the same architecture, or on
  a machine sharing the artifact cache), where the GPUs' measuring is the work. ``detail`` has
  each tune's compile and measuring seconds as its workers reported them, and whether the DSL
  extra was installed (it adds CuTe DSL candidates, compiled in the measuring process).
- ``train`` section, ``ddp train converted vs unconverted`` and ``fsdp2 ...``: the e2e
  benchmark's Llama-3-8B-shaped model (``--layers``, random bf16 weights) on N ranks (one per
  GPU, NCCL), each rank a ``--tokens`` slice of one global batch: forward, backward and the clip
  of the gradients (DDP: ``custom_kernels.clip_grad_norm_``; FSDP2:
  ``clip_grad_distributed.clip_grad_norm_``; the unconverted model: torch's), the two models'
  steps interleaved; unit tokens/s over all ranks. ``--tune-model`` (quick by default) first
  tunes the GEMMs the converted model runs at that slice (forward, backward, the chunked loss
  head), as a user would before training. ``detail`` has the loss (averaged over ranks) and the
  gradients' largest relative error against one GPU running the whole global batch, and the
  converted model's speedup on one GPU (rank 0's slice), which the distributed speedup is
  judged against.

  Where the whole global batch does not fit on one GPU (16 layers on 4 GPUs, say), the rows are
  checked instead against the unconverted model on the same mesh (loss, every gradient).
  ``--modes`` picks the wrappers (``ddp``, ``fsdp2``). The file keeps the rows of other GPU
  counts and modes it does not measure again, each with the run it came from
  (``detail["run"]``). ``--modes tp``: tensor parallelism of degree ``--gpus``, the converted
  model through ``cutlass_ops.tensor_parallel.parallelize``, the unconverted one through torch's
  Llama plan; rows ``tp train`` and ``tp prefill converted vs unconverted`` (tokens/s per GPU,
  the collectives of a train step counted for both, peak memory; checked against the
  unconverted model on the same mesh). ``--modes fsdp2+tp``: the same over a 2 x (gpus / 2)
  mesh, FSDP2 (``fully_shard`` on the data-parallel dimension) over TP groups: ``fsdp2+tp train``.

    torchrun is not needed: python benchmarks/multigpu.py [--gpus 2] [--layers 4] [--tokens 4096]
        [--strategy quick] [--tune-model quick] [--sections tune train] [--modes ddp fsdp2]

Needs ``--gpus`` CUDA GPUs (``--gpus 1`` runs the train section's code paths at world size 1,
as a smoke run; its rows say so). Writes benchmarks/results/multigpu.json (multigpu_1gpu.json
with ``--gpus 1``).
"""

from __future__ import annotations

import argparse
import copy
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from benchmarks.common import print_table, require_gpu, write_result  # noqa: E402
from benchmarks.e2e import SEQUENCES, llama, train_problems  # noqa: E402
from benchmarks.gemm import LLM_SHAPES  # noqa: E402


SECTIONS = ("tune", "train")
# A tune's summary line, once per worker: "compiled 7 kernels, reused 0, build 61 s, measurement
# 12 s" (tuning.cli's text output).
SUMMARY = re.compile(r"compiled (\d+) kernels, reused (\d+), build (\d+) s, measurement (\d+) s")


def kept_rows(name: str, world: int, measured: tuple[str, ...]) -> list[dict]:
    """The file's rows that this run does not measure again (those whose case starts with one of
    ``measured`` at ``world`` GPUs are), each with the run it came from in its
    ``detail["run"]`` (GPU, versions, world size): several device calls, several kinds."""
    import json

    from benchmarks import common

    try:
        old = json.loads((common.RESULTS / f"{name}.json").read_text())
    except (OSError, ValueError):
        return []
    rows = []
    for row in old.get("rows", []):
        run = row.get("detail", {}).get("run") or {
            "gpu": old.get("gpu"), "versions": old.get("versions"),
            "world_size": old.get("world_size")}
        if run.get("world_size") == world and row["case"].startswith(measured):
            continue
        rows.append({**row, "detail": {**row.get("detail", {}), "run": run}})
    return rows


def tune_wall_s(gpus: list[int], strategy: str, cache: str) -> dict:
    """``cutlass-tune tune`` of the 16 shapes on ``gpus`` with ``cache`` as the cache root:
    its wall time, and each worker's compiled kernels and compile and measuring seconds."""
    command = [sys.executable, "-m", "tuning.cli", "tune",
               *(f"{m}x{n}x{k}" for m, n, k in LLM_SHAPES), "--strategy", strategy,
               "--no-progress"]
    if len(gpus) > 1:
        command += ["--gpus", ",".join(map(str, gpus))]
    env = dict(os.environ, CUTLASS_OPS_CACHE_DIR=cache)
    start = time.perf_counter()
    done = subprocess.run(command, check=True, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    workers = [dict(zip(("compiled", "reused", "build_s", "measure_s"), map(int, m)))
               for m in SUMMARY.findall(done.stdout)]
    return {"wall_s": round(wall, 1), "workers": workers,
            "untuned": untuned_shapes(cache)}


def untuned_shapes(cache: str) -> list[str]:
    """The shapes a finished tune left without an entry in ``cache`` (as ``cutlass-tune list``
    shows them): a tune that stored less than it was given is not a wall time to compare, so
    its row is not correct. An entry whose winner is torch.matmul counts: the tune decided."""
    import json

    listed = subprocess.run([sys.executable, "-m", "tuning.cli", "list", "--family", "gemm",
                             "--json"], check=True,
                            env=dict(os.environ, CUTLASS_OPS_CACHE_DIR=cache),
                            capture_output=True, text=True)
    tuned = {row.get("shape") for row in json.loads(listed.stdout)}
    return [shape for shape in (f"{m}x{n}x{k}" for m, n, k in LLM_SHAPES) if shape not in tuned]


def tune_row(world: int, strategy: str, state: str, single: dict, several: dict) -> dict:
    from cutlass_ops.gemms import dsl

    suffix = "" if strategy == "quick" else f", {strategy}"
    suffix += "" if state == "empty" else f", {state}"
    return {"case": f"tune {world} GPUs vs 1{suffix}", "unit": "1/s",
            "ours": round(1 / several["wall_s"], 5), "reference": round(1 / single["wall_s"], 5),
            "reference_name": "1 GPU", "ratio": round(single["wall_s"] / several["wall_s"], 4),
            # Correct only when both tunes it times stored an entry for every shape.
            "correct": not single["untuned"] and not several["untuned"],
            "detail": {"strategy": strategy, "dsl_extra": dsl.unavailable() is None,
                       "one_gpu_untuned": single["untuned"], "gpus_untuned": several["untuned"],
                       "shapes": len(LLM_SHAPES), "cache": state,
                       "one_gpu_s": single["wall_s"], "gpus_s": several["wall_s"],
                       "one_gpu_workers": single["workers"], "gpus_workers": several["workers"],
                       "cpu_cores": os.cpu_count()}}


def tune_rows(world: int, strategy: str, save) -> list[dict]:
    """The 16-shape tune on 1 GPU and on ``world``: with the kernels built (a one-GPU tune from
    an empty cache builds them, then each timed tune starts with the tuning results deleted),
    then from an empty cache on ``world`` GPUs, against that first one-GPU tune. ``save(rows)``
    after each row, so that a run cut short keeps what it measured."""
    from custom_kernels.core.version import __version__

    rows = []
    with tempfile.TemporaryDirectory(prefix="cutlass-ops-1gpu-") as one, \
            tempfile.TemporaryDirectory(prefix="cutlass-ops-ngpu-") as many:
        cold_single = tune_wall_s([0], strategy, one)
        built = []
        for gpus in ([0], list(range(world))):
            shutil.rmtree(Path(one) / __version__ / "tuning")  # the kernels stay built
            built.append(tune_wall_s(gpus, strategy, one))
        rows.append(tune_row(world, strategy, "kernels built", *built))
        save(rows)
        print(rows[-1]["case"], rows[-1]["ratio"], flush=True)
        rows.append(tune_row(world, strategy, "empty", cold_single,
                             tune_wall_s(list(range(world)), strategy, many)))
        save(rows)
        print(rows[-1]["case"], rows[-1]["ratio"], flush=True)
    return rows


def tune_model(layers: int, tokens: int, strategy: str, world: int) -> str:
    """Tunes the GEMMs the converted model runs on one rank's slice (forward, backward and the
    chunked loss head) into the cache, shared among the ``world`` GPUs as ``cutlass-tune tune
    --gpus`` shares them; a line saying what it cost."""
    from cutlass_ops.gemms import dispatch
    from tuning import multi_gpu

    problems = list(dict.fromkeys(train_problems(llama(layers, device="meta"), tokens)))
    start = time.perf_counter()
    parts, codes = multi_gpu.tune_on_gpus(problems, list(range(world)),
                                          ["--strategy", strategy, "--no-progress"])
    if any(codes):
        raise SystemExit(f"the model's tune failed: worker exit codes {codes}")
    dispatch.reset()
    return (f"{strategy}: {len(problems)} GEMMs on {world} GPU(s) "
            f"({', '.join(str(len(p)) for p in parts)} each) in "
            f"{time.perf_counter() - start:.0f} s")


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
    from torch.distributed.tensor.debug import CommDebugMode

    record, comms = {}, {}
    for name, step in steps.items():  # one step for the checks, before any timing
        models[name].zero_grad(set_to_none=True)
        with CommDebugMode() as counted:  # the step's collectives (the clip's apart)
            loss = models[name](input_ids=ids, labels=ids).loss
            loss.backward()
        comms[name] = {str(k): v for k, v in counted.get_comm_counts().items()}
        loss = loss.detach().float()
        dist.all_reduce(loss)
        record[name] = {"loss": float(loss) / world, "grads": full_grads(models[name])}
        models[name].zero_grad(set_to_none=True)
    ms = timed(steps, reps)
    if rank == 0:
        torch.save({"ms": ms, "record": record, "comms": comms}, out)
    dist.barrier()
    dist.destroy_process_group()


def torch_tp_plan(model, mesh) -> None:
    """torch's Llama plan on the unconverted model (``cutlass_ops.tensor_parallel.llama_plan``:
    logits gathered, as Hugging Face's ``tp_plan="auto"``)."""
    from torch.distributed.tensor.parallel import parallelize_module

    from cutlass_ops.tensor_parallel import llama_plan

    parallelize_module(model, mesh, llama_plan(model))


def tp_rank_main(rank: int, world: int, port: int, layers: int, tokens: int, reps: int,
                 out: str, dp: int = 1) -> None:
    """Tensor parallelism of degree ``world // dp`` (``dp`` > 1: FSDP2 over ``dp`` groups of it,
    a 2-D mesh): the converted model through ``cutlass_ops.tensor_parallel.parallelize``, the
    unconverted one through torch's plan, then ``fully_shard`` on the data-parallel dimension;
    ``tokens`` a data-parallel rank, shared by its TP ranks. Train steps (forward and backward)
    and, without FSDP2, prefills timed interleaved; collectives of one train step counted
    (CommDebugMode); peak memory of each; loss, gradients and logits recorded for the checks."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.debug import CommDebugMode

    import cutlass_ops
    from cutlass_ops import tensor_parallel

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world)
    mesh = init_device_mesh("cuda", (dp, world // dp), mesh_dim_names=("dp", "tp"))
    plain = llama(layers)
    ours = copy.deepcopy(plain)
    report = cutlass_ops.convert(ours)
    tensor_parallel.parallelize(ours, mesh["tp"])
    torch_tp_plan(plain, mesh["tp"])
    models = {"ours": ours, "unconverted": plain}
    if dp > 1:
        from torch.distributed.fsdp import fully_shard

        for model in models.values():
            for layer in model.model.layers:
                fully_shard(layer, mesh=mesh["dp"])
            fully_shard(model, mesh=mesh["dp"])
    dp_rank = mesh["dp"].get_local_rank()
    ids = global_batch(dp, tokens).chunk(dp)[dp_rank].cuda()
    no_clip = lambda params: None  # noqa: E731 (clipping is the same torch call on both sides)
    steps = {k: step_fn(m, ids, no_clip) for k, m in models.items()}
    record, comms, peak = {}, {}, {}
    for name, model in models.items():
        model.zero_grad(set_to_none=True)
        torch.cuda.reset_peak_memory_stats()
        with CommDebugMode() as counted:
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
        peak[name] = torch.cuda.max_memory_allocated() / 2 ** 30
        comms[name] = {str(k): v for k, v in counted.get_comm_counts().items()}
        with torch.no_grad():
            logits = model(input_ids=ids[:, :512]).logits.float().cpu()
        loss = loss.detach().float()
        dist.all_reduce(loss, group=mesh["dp"].get_group())  # the data-parallel ranks' mean
        record[name] = {"loss": float(loss) / dp, "grads": full_grads(model), "logits": logits}
        model.zero_grad(set_to_none=True)
    ms = timed(steps, reps)

    def prefill(model):
        def run():
            with torch.no_grad():
                model(input_ids=ids)
        return run

    prefill_ms = timed({k: prefill(m) for k, m in models.items()}, reps) if dp == 1 else None
    if rank == 0:
        torch.save({"ms": ms, "prefill_ms": prefill_ms, "record": record, "comms": comms,
                    "peak_gb": peak, "converted": len(report.converted)}, out)
    dist.barrier()
    dist.destroy_process_group()


def tp_rows(world: int, args, dp: int = 1) -> list[dict]:
    """``tp train`` and ``tp prefill converted vs unconverted`` (``dp`` > 1: ``fsdp2+tp
    train``, a ``dp`` x ``world // dp`` mesh): checked against the unconverted model on the same
    mesh (loss, every gradient, the logits)."""
    from custom_kernels.core.tolerances import relative_error

    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "rank0.pt")
        spawn(tp_rank_main, world, args.layers, args.tokens, args.reps, out, dp)
        got = torch.load(out, weights_only=False)
    checks = mesh_checks(got["record"])["ours"]
    logits_error = relative_error(got["record"]["ours"]["logits"],
                                  got["record"]["unconverted"]["logits"])
    train_ok = (abs(checks["loss"] - checks["unconverted_loss"]) <=
                1e-2 * abs(checks["unconverted_loss"])
                and checks["grad_max_relative_error_vs_unconverted"] < 5e-2)
    comm_total = {k: sum(v.values()) for k, v in got["comms"].items()}
    suffix = f"{world} GPUs, {args.layers} layers"
    mode = "tp" if dp == 1 else "fsdp2+tp"
    common = {"tp_degree": world // dp, "fsdp2_degree": dp, "tokens_per_step": args.tokens * dp,
              "collectives_per_train_step": got["comms"],
              "collectives_total": comm_total, "peak_gb": got["peak_gb"],
              "checked_against": "the unconverted model under torch's plan, same mesh",
              "model_tune": args.model_tune_line}
    rows = []
    kinds = [("train", got["ms"], train_ok and comm_total["ours"] <= comm_total["unconverted"],
              {"checks": checks})]
    if got["prefill_ms"] is not None:
        kinds.append(("prefill", got["prefill_ms"], logits_error < 5e-2,
                      {"logits_relative_error_vs_unconverted": logits_error}))
    for kind, ms, correct, extra in kinds:
        per_gpu = args.tokens * dp / world * 1e3
        rows.append({"case": f"{mode} {kind} converted vs unconverted, {suffix}",
                     "unit": "tokens/s per GPU", "ours": round(per_gpu / ms["ours"], 1),
                     "reference": round(per_gpu / ms["unconverted"], 1),
                     "reference_name": "unconverted under torch's TP plan",
                     "ratio": round(ms["unconverted"] / ms["ours"], 4), "correct": correct,
                     "detail": {"ours_ms": ms["ours"], "reference_ms": ms["unconverted"],
                                **common, **extra}})
        print(rows[-1]["case"], rows[-1]["ratio"], flush=True)
    return rows


def one_gpu(layers: int, world: int, tokens: int, reps: int) -> dict | None:
    """One GPU: the whole global batch's loss and gradients (the checks' reference), and the
    converted model's speedup on one rank's slice; None where that does not fit in the GPU's
    memory (the rows are then checked against the unconverted model on the same mesh)."""
    import gc

    try:
        return _one_gpu(layers, world, tokens, reps)
    except torch.OutOfMemoryError:
        pass
    # Out of the except block: the traceback's frames (the models) are gone, their memory can go
    # back before the ranks start on this GPU.
    gc.collect()
    torch.cuda.empty_cache()
    return None


def _one_gpu(layers: int, world: int, tokens: int, reps: int) -> dict:
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


def mesh_checks(record: dict) -> dict:
    """The converted model against the unconverted one on the same mesh (when the whole batch
    does not fit on one GPU): its loss and every gradient."""
    ours, plain = record["ours"], record["unconverted"]
    return {"ours": {"loss": ours["loss"], "unconverted_loss": plain["loss"],
                     "grad_max_relative_error_vs_unconverted": worst_error(ours["grads"],
                                                                           plain["grads"])}}


def train_rows(world: int, args) -> list[dict]:
    """The DDP and FSDP2 rows (``args.modes``): each model's step timed on ``world`` ranks,
    checked against one GPU running the whole global batch, or, where that does not fit,
    the converted model against the unconverted one on the same mesh."""
    rows = tp_rows(world, args) if "tp" in args.modes else []
    if "fsdp2+tp" in args.modes:
        if world % 2:
            raise SystemExit("--modes fsdp2+tp: an even --gpus (a 2 x gpus/2 mesh)")
        rows += tp_rows(world, args, dp=2)
    modes = [m for m in args.modes if m not in ("tp", "fsdp2+tp")]
    if not modes:
        return rows
    single = one_gpu(args.layers, world, args.tokens, args.reps)
    for mode in modes:
        with tempfile.TemporaryDirectory() as tmp:
            out = str(Path(tmp) / "rank0.pt")
            spawn(rank_main, world, mode, args.layers, args.tokens, args.reps, out)
            got = torch.load(out, weights_only=False)
        if single is None:
            checks = mesh_checks(got["record"])
            c = checks["ours"]
            correct = (abs(c["loss"] - c["unconverted_loss"]) <= 1e-2 * abs(c["unconverted_loss"])
                       and c["grad_max_relative_error_vs_unconverted"] < 5e-2)
        else:
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
                                "one_gpu_speedup": round(single["speedup"], 4)
                                if single else None,
                                "speedup_vs_one_gpu_speedup": round(
                                    speedup / single["speedup"], 4) if single else None,
                                "checked_against": "one GPU, whole batch" if single else
                                "the unconverted model on the same mesh (the whole batch "
                                "does not fit on one GPU)",
                                "checks": checks, "tokens_per_rank": args.tokens,
                                "collectives_per_train_step": got.get("comms"),
                                "model_tune": args.model_tune_line}})
        print(rows[-1]["case"], rows[-1]["ratio"], flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", type=int, default=2)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=4096, help="tokens per rank")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--strategy", default="quick", choices=("quick", "default"),
                        help="the tune section's strategy")
    parser.add_argument("--tune-model", default="quick", choices=("quick", "default", "none"),
                        help="tune the converted model's GEMMs before the train section")
    parser.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS))
    parser.add_argument("--modes", nargs="+", choices=("ddp", "fsdp2", "tp", "fsdp2+tp"),
                        default=["ddp", "fsdp2"],
                        help="the train section's wrappers: data parallel (ddp, fsdp2), tensor "
                        "parallel over all the GPUs (tp: train and prefill rows), FSDP2 over two "
                        "TP groups (fsdp2+tp, a 2 x gpus/2 mesh)")
    parser.add_argument("--name", help="the result file's name (default multigpu, or "
                        "multigpu_1gpu with --gpus 1)")
    args = parser.parse_args()
    require_gpu()
    if torch.cuda.device_count() < args.gpus:
        sys.exit(f"--gpus {args.gpus}: this machine has {torch.cuda.device_count()} GPU(s)")
    world = args.gpus
    name = args.name or ("multigpu" if world > 1 else "multigpu_1gpu")
    meta = {"world_size": world}
    measured = set(args.sections) if world > 1 else {"train"}
    # Rows this run does not measure again stay in the file, each with the run it came from.
    prefixes = (("tune ",) if "tune" in measured else ()) + (tuple(
        f"{m} train" for m in args.modes) + (("tp prefill",) if "tp" in args.modes else ())
        if "train" in measured else ())
    kept = kept_rows(name, world, prefixes)
    rows = []
    if "tune" in measured:
        rows += tune_rows(world, args.strategy, lambda done: write_result(name, kept + done,
                                                                          **meta))
    if "train" in measured:
        args.model_tune_line = (None if args.tune_model == "none" else
                                tune_model(args.layers, args.tokens, args.tune_model, world))
        print("model tune:", args.model_tune_line, flush=True)
        rows += train_rows(world, args)
        write_result(name, kept + rows, **meta)
    every = kept + rows
    print_table(["case", "ours", "reference", "ratio", "correct"],
                [[r["case"], r["ours"], r["reference"], r["ratio"], r["correct"]]
                 for r in every])


if __name__ == "__main__":
    main()
