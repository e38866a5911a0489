"""Beyond one GPU: the tune on several GPUs, a converted model under DDP, FSDP2 and TP.

The converted model against the unconverted one, eager and compiled as torchtitan runs it.

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
- ``train`` section: the e2e benchmark's Llama-3-8B-shaped model (``--layers``, random bf16
  weights) on N ranks (one per GPU, NCCL). ``--tune-model`` (quick by default) first tunes the
  GEMMs the converted model runs at one rank's slice, as a user would before training.
  ``--modes`` picks the wrappers, each a process group of its own:
  - ``ddp`` and ``fsdp2``: each rank a ``--tokens`` slice of one global batch: forward, backward
    and the clip of the gradients (DDP: ``custom_kernels.clip_grad_norm_``; FSDP2:
    ``clip_grad_distributed.clip_grad_norm_``; the unconverted model: torch's), the models'
    steps interleaved; unit tokens/s over all ranks. Rows ``ddp train converted vs unconverted
    eager`` and ``fsdp2 train converted vs unconverted eager``; ``fsdp2 train converted vs fsdp2
    compiled``: the unconverted model with each decoder layer ``torch.compile``d, then
    ``fully_shard``ed layer by layer and at the root (torchtitan's order), the main peer.
    ``detail`` has the converted model's speedup on one GPU (rank 0's slice); with
    ``--profile``, ``detail.profile``: each side's step split into compute, collectives and
    the collectives no compute hides (``gpu_busy.breakdown``, rank 0's trace).
  - ``tp``: tensor parallelism of degree ``--gpus``, the converted model through
    ``cutlass_ops.parallel.tensor_parallel.parallelize`` (tokens/s per GPU; collectives of a train step
    counted; peak memory). ``tp train`` and ``tp prefill converted vs torchtitan-style``: the
    unconverted model under torch's Llama plan with the LM head sharded on the vocabulary
    (``ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)``), its loss (Hugging
    Face's, from the hidden states) and backward under ``loss_parallel()``, each decoder layer
    compiled after the plan (``TORCHTITAN_SETTINGS``, recorded in each row with the versions
    and graph breaks). No ``SequenceParallel`` on the norms: Hugging Face's LlamaModel derives
    positions, rotary cos/sin and the causal mask from the embedding output's length
    (``NO_SEQUENCE_PARALLEL``). ``tp ... converted vs unconverted eager``: torch's plan eager,
    logits gathered (Hugging Face's ``tp_plan="auto"``). With ``--graphed`` (opting in to
    ``graphed_steps.CAPTURE_DISTRIBUTED``, whose GPU tests have not passed yet), ``tp train`` and
    ``tp prefill converted graphed vs torchtitan-style``: the converted model's step through
    ``cutlass_ops.graphed_train_step`` (``graphed_forward``), its collectives captured with the
    rest; ``detail.graphed_equals_eager`` says whether a replay's loss and every gradient (the
    logits) equal the eager step's bit for bit.
  - ``fsdp2+tp``: the same over a 2 x (gpus / 2) mesh, FSDP2 (``fully_shard`` on the
    data-parallel dimension) over TP groups: ``fsdp2+tp train converted vs unconverted eager``.

  Checks (``check_step``, ``check_logits``): every model's step against the unconverted eager
  model's on the same mesh and inputs: the loss within ``LOSS_BOUND``, every gradient within the
  tolerance table's bf16 model bound, matched by name; a parameter with a gradient on one side
  and none (or zeros) on the other fails, named. A row is correct when both its sides pass
  (the peer's step too); its ``detail`` has the bounds and the measured errors (``loss_error``,
  ``worst_gradient_error``, ``worst_parameter``; prefill: ``logits_error``). The file keeps
  the rows of other GPU counts and modes it does not measure again, each with the run it came
  from (``detail["run"]``).

    torchrun is not needed: python benchmarks/multigpu.py [--gpus 2] [--layers 4] [--tokens 4096]
        [--strategy quick] [--tune-model quick] [--sections tune train]
        [--modes ddp fsdp2 tp fsdp2+tp]

Needs ``--gpus`` CUDA GPUs (``--gpus 1`` runs the train section's code paths at world size 1,
as a smoke run; its rows say so). Writes benchmarks/results/multigpu.json (multigpu_1gpu.json
with ``--gpus 1``).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import faulthandler
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
from benchmarks.gpu_busy import breakdown  # noqa: E402


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


def canonical(name: str) -> str:
    """A parameter's name without DDP's ``module.`` and torch.compile's ``_orig_mod.`` (a
    compiled decoder layer puts it mid-name): the same name on every side of a check."""
    name = name.replace("_orig_mod.", "")
    return name[len("module."):] if name.startswith("module.") else name


def full_grads(model, keep: bool = True) -> dict:
    """Every parameter's whole gradient (a sharded one gathered: every rank must call) on the
    host by canonical name, None where it got none; ``keep=False`` (ranks whose copy nobody
    checks): the gathers only, an empty dict."""
    out = {}
    for name, p in model.named_parameters():
        g = p.grad
        if g is not None and hasattr(g, "full_tensor"):
            g = g.full_tensor()
        if keep:
            out[canonical(name)] = None if g is None else g.detach().cpu()
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


def compile_layers(model) -> None:
    """torchtitan's per-block compile: each decoder layer ``torch.compile``d (default options) in
    place of itself (its parameter names gain ``_orig_mod.``, which ``canonical`` drops)."""
    import torch._dynamo

    if hasattr(torch._dynamo.config, "recompile_limit"):  # one graph per layer at worst
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    layers = model.model.layers
    for i, layer in enumerate(layers):
        layers[i] = torch.compile(layer)


def graph_breaks() -> int:
    from torch._dynamo.utils import counters

    return sum(counters["graph_break"].values())


def data_parallel_models(mode: str, rank: int, layers: int) -> tuple[dict, dict]:
    """The converted and unconverted models under ``mode`` (DDP or FSDP2, one ``fully_shard`` a
    decoder layer, then the root) and their clips; FSDP2 also the unconverted model with each
    layer compiled before it is sharded (torchtitan's order): ``compiled``."""
    import cutlass_ops
    from custom_kernels import clip_grad
    from custom_kernels.parallel import clip_grad_distributed

    plain = llama(layers)
    ours = copy.deepcopy(plain)
    cutlass_ops.convert(ours)
    models = {"ours": ours, "unconverted": plain}
    torch_clip = lambda p: torch.nn.utils.clip_grad_norm_(p, 1.0)  # noqa: E731
    if mode != "fsdp2":
        models = {k: torch.nn.parallel.DistributedDataParallel(m, device_ids=[rank])
                  for k, m in models.items()}
        return models, {"ours": lambda p: clip_grad.clip_grad_norm_(p, 1.0),
                        "unconverted": torch_clip}
    from torch.distributed.fsdp import fully_shard

    models["compiled"] = copy.deepcopy(plain)
    compile_layers(models["compiled"])
    for model in models.values():
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
    return models, {"ours": lambda p: clip_grad_distributed.clip_grad_norm_(p, 1.0),
                    "unconverted": torch_clip, "compiled": torch_clip}


def rank_main(rank: int, world: int, port: int, mode: str, layers: int, tokens: int,
              reps: int, out: str, profile: bool = False) -> None:
    """One rank of the DDP or FSDP2 run: one step of each model for the checks (rank 0 checks
    each against the unconverted model on the same mesh), then the steps timed interleaved;
    with ``profile``, then each model's steps under the profiler (``gpu_busy.breakdown``: every
    rank runs them, rank 0's trace is kept)."""
    import torch.distributed as dist
    from torch.distributed.tensor.debug import CommDebugMode

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world)
    models, clips = data_parallel_models(mode, rank, layers)
    ids = global_batch(world, tokens).chunk(world)[rank].cuda()
    steps = {k: step_fn(models[k], ids, clips[k]) for k in models}
    record, comms = {}, {}
    for name, model in models.items():  # one step for the checks, before any timing
        model.zero_grad(set_to_none=True)
        counted = CommDebugMode() if name != "compiled" else contextlib.nullcontext()
        with counted:  # the step's collectives (the clip's apart); not under torch.compile
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
        if name != "compiled":
            comms[name] = {str(k): v for k, v in counted.get_comm_counts().items()}
        loss = loss.detach().float()
        dist.all_reduce(loss)
        record[name] = {"loss": float(loss) / world, "grads": full_grads(model, rank == 0)}
        model.zero_grad(set_to_none=True)
    checks = ({k: check_step(record[k], record["unconverted"], "unconverted, same mesh")
               for k in models if k != "unconverted"} if rank == 0 else None)
    del record
    ms = timed(steps, reps)
    profiles = {name: breakdown(step) for name, step in steps.items()} if profile else None
    if rank == 0:
        torch.save({"ms": ms, "checks": checks, "comms": comms, "profiles": profiles,
                    "graph_breaks": graph_breaks()}, out)
    dist.barrier()
    dist.destroy_process_group()


def torch_tp_plan(model, mesh) -> None:
    """torch's Llama plan on the unconverted model (``cutlass_ops.parallel.tensor_parallel.llama_plan``:
    logits gathered, as Hugging Face's ``tp_plan="auto"``)."""
    from torch.distributed.tensor.parallel import parallelize_module

    from cutlass_ops.parallel.tensor_parallel import llama_plan

    parallelize_module(model, mesh, llama_plan(model))


# Why the torchtitan-style peer has no SequenceParallel on its norms (in each row's detail).
NO_SEQUENCE_PARALLEL = (
    "not applied: Hugging Face's LlamaModel takes the position ids, the rotary cos/sin and the "
    "causal mask from the embedding output's length, once for every layer, so a sequence-sharded "
    "residual stream (torchtitan's embedding RowwiseParallel(output_layouts=Shard(1)), "
    "SequenceParallel norms, o_proj/down_proj RowwiseParallel(output_layouts=Shard(1))) gives "
    "each rank positions 0..S/tp and a mask of its own length; the model would have to be "
    "called with position ids and a mask made for the whole sequence")
TORCHTITAN_SETTINGS = {
    "plan": "cutlass_ops.parallel.tensor_parallel.llama_plan (q, k, v, gate, up ColwiseParallel; o_proj, "
            "down_proj RowwiseParallel), lm_head ColwiseParallel(output_layouts=Shard(-1), "
            "use_local_output=False): logits sharded on the vocabulary",
    "loss": "cross_entropy on the DTensor logits (shifted labels, mean, as Hugging Face's) "
            "under loss_parallel(), backward too",
    "compile": "torch.compile(layer), default options, each decoder layer after the plan",
    "sequence_parallel": False, "sequence_parallel_why": NO_SEQUENCE_PARALLEL,
    "prefill": "model(input_ids=...), logits left sharded on the vocabulary (not gathered)"}


def torchtitan_style(model, mesh) -> None:
    """The unconverted model as torchtitan runs a Llama (``TORCHTITAN_SETTINGS``): torch's plan
    with the head sharded on the vocabulary, then each decoder layer compiled."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    from cutlass_ops.parallel.tensor_parallel import llama_plan

    plan = llama_plan(model)
    plan["lm_head"] = ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)
    parallelize_module(model, mesh, plan)
    compile_layers(model)


def vocab_parallel_loss(model, ids):
    """torchtitan's loss on a model whose logits are sharded on the vocabulary (call it, and the
    backward, under ``loss_parallel()``): Hugging Face's causal LM loss on the DTensor logits."""
    hidden = model.model(input_ids=ids).last_hidden_state
    logits = model.lm_head(hidden)
    labels = torch.nn.functional.pad(ids, (0, 1), value=-100)[:, 1:]
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(),
                                             ignore_index=-100)


def local(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def tp_step(model, ids, titan: bool):
    """A train step (forward and backward) of a TP model; ``titan``: ``vocab_parallel_loss``
    under ``loss_parallel()``, otherwise the model's own loss."""
    from torch.distributed.tensor.parallel import loss_parallel

    def step():
        model.zero_grad(set_to_none=True)
        with loss_parallel() if titan else contextlib.nullcontext():
            loss = (vocab_parallel_loss(model, ids) if titan else
                    model(input_ids=ids, labels=ids).loss)
            loss.backward()
        return loss
    return step


def tp_models(layers: int, mesh, dp: int) -> tuple[dict, int]:
    """The converted model through ``parallelize``, the unconverted one through torch's plan
    and, on a 1-D TP mesh (``dp`` 1), another through ``torchtitan_style``; ``dp`` > 1: FSDP2
    over them on the data-parallel dimension. With the number of layers ``convert`` fused."""
    import cutlass_ops
    from cutlass_ops.parallel import tensor_parallel

    plain = llama(layers)
    ours = copy.deepcopy(plain)
    titan = copy.deepcopy(plain) if dp == 1 else None
    report = cutlass_ops.convert(ours)
    tensor_parallel.parallelize(ours, mesh["tp"])
    torch_tp_plan(plain, mesh["tp"])
    models = {"ours": ours, "unconverted": plain}
    if titan is not None:
        torchtitan_style(titan, mesh["tp"])
        models["torchtitan"] = titan
    if dp > 1:
        from torch.distributed.fsdp import fully_shard

        for model in models.values():
            for layer in model.model.layers:
                fully_shard(layer, mesh=mesh["dp"])
            fully_shard(model, mesh=mesh["dp"])
    return models, len(report.converted)


def tp_record(models: dict, ids, mesh, dp: int, keep: bool) -> tuple[dict, dict, dict]:
    """One train step of each model (collectives counted, eager ones), its peak memory, loss,
    gradients and prefill logits, for the checks; ``keep``: this rank keeps the copies."""
    from torch.distributed.tensor.debug import CommDebugMode

    record, comms, peak = {}, {}, {}
    for name, model in models.items():
        model.zero_grad(set_to_none=True)
        torch.cuda.reset_peak_memory_stats()
        counted = CommDebugMode() if name != "torchtitan" else contextlib.nullcontext()
        with counted:  # not under torch.compile
            loss = tp_step(model, ids, name == "torchtitan")()
        peak[name] = torch.cuda.max_memory_allocated() / 2 ** 30
        if name != "torchtitan":
            comms[name] = {str(k): v for k, v in counted.get_comm_counts().items()}
        grads = full_grads(model, keep)
        model.zero_grad(set_to_none=True)
        with torch.no_grad():  # the whole prefill: the shape the timed prefill compiles for
            logits = local(model(input_ids=ids).logits)
        loss = local(loss.detach()).float()
        torch.distributed.all_reduce(loss, group=mesh["dp"].get_group())  # the dp ranks' mean
        record[name] = {"loss": float(loss) / dp, "grads": grads,
                        "logits": logits.cpu() if keep else None}
        del logits
    return record, comms, peak


def tp_checks(record: dict) -> tuple[dict, dict]:
    """Each model's train step and prefill logits against the unconverted model's (eager,
    torch's plan) on the same mesh."""
    plain = record["unconverted"]
    against = "unconverted eager under torch's plan, same mesh"
    return ({k: check_step(r, plain, against) for k, r in record.items() if k != "unconverted"},
            {k: check_logits(r["logits"], plain["logits"], against)
             for k, r in record.items() if k != "unconverted"})


def tp_rank_main(rank: int, world: int, port: int, layers: int, tokens: int, reps: int,
                 out: str, dp: int = 1, graphed_steps: bool = False,
                 overlap_blocks: int = 0) -> None:
    """Tensor parallelism of degree ``world // dp`` (``dp`` > 1: FSDP2 over ``dp`` groups of it,
    a 2-D mesh; no torchtitan-style model there): ``tp_models``, ``tokens`` a data-parallel
    rank, shared by its TP ranks. ``tp_record`` and ``tp_checks``, then train steps (forward
    and backward) and, without FSDP2, prefills timed interleaved. ``overlap_blocks`` > 0: the
    converted model's all-reduces overlapped with its GEMMs (``overlap_settings``)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from cutlass_ops.parallel import sharded_gemms

    for name, value in (overlap_settings(overlap_blocks) or {}).items():
        setattr(sharded_gemms, name, value)

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world)
    mesh = init_device_mesh("cuda", (dp, world // dp), mesh_dim_names=("dp", "tp"))
    models, converted = tp_models(layers, mesh, dp)
    ids = global_batch(dp, tokens).chunk(dp)[mesh["dp"].get_local_rank()].cuda()
    record, comms, peak = tp_record(models, ids, mesh, dp, keep=rank == 0)
    checks, logits = tp_checks(record) if rank == 0 else (None, None)
    plain = record["unconverted"] if rank == 0 else None
    del record
    steps = {k: tp_step(m, ids, k == "torchtitan") for k, m in models.items()}
    graphed, graphed_checks = graphed_tp(models["ours"], ids, plain) \
        if dp == 1 and graphed_steps else ({}, None)
    del plain
    ms = timed({**steps, **{k: v[0] for k, v in graphed.items()}}, reps)

    def prefill(model):
        def run():
            with torch.no_grad():
                model(input_ids=ids)
        return run

    prefills = {**{k: prefill(m) for k, m in models.items()},
                **{k: v[1] for k, v in graphed.items()}}
    prefill_ms = timed(prefills, reps) if dp == 1 else None
    if graphed:  # the graphs holding captured collectives, gone before the process group
        from cutlass_ops import graphed_steps as graphed_module

        graphed_module.reset_all()
    if rank == 0:
        torch.save({"ms": ms, "prefill_ms": prefill_ms, "checks": checks, "logits": logits,
                    "comms": comms, "peak_gb": peak, "converted": converted,
                    "graph_breaks": graph_breaks(), "graphed_checks": graphed_checks}, out)
    dist.barrier()
    dist.destroy_process_group()


def graphed_tp(model, ids, plain: dict | None) -> tuple[dict, dict | None]:
    """``{"ours graphed": (train step, prefill)}``: the converted TP model through
    ``graphed_train_step`` and ``graphed_forward`` (each captured by its second call here), and
    (on the rank holding ``plain``, the unconverted eager model's record) a replay's checks
    against it by the eager rows' bounds: ``{"captured", "train", "prefill"}``. Not bit for bit
    against our eager step: at this size the eager step itself is not reproducible bit for bit
    (two eager steps differed in every layer's gradients on an H200, a replay by as much)."""
    import cutlass_ops
    from cutlass_ops import graphed_steps

    graphed_steps.CAPTURE_DISTRIBUTED = True  # opted in by --graphed (not yet GPU-verified)
    # Should a rank hang (as destroy_process_group did with the graphs alive), each prints its
    # stack every 3 minutes from here on.
    faulthandler.dump_traceback_later(180, repeat=True)
    step = cutlass_ops.graphed_train_step(model)
    forward = cutlass_ops.graphed_forward(model)
    for _ in range(3):
        loss = local(step(input_ids=ids, labels=ids)).clone()
        with torch.no_grad():
            logits = local(forward(input_ids=ids).logits).clone()
    keep = plain is not None
    replayed = {"loss": float(loss.float()), "grads": full_grads(model, keep)}
    checks = None
    if keep:
        against = "unconverted eager under torch's plan, same mesh"
        checks = {"captured": len(step.graphs.entries) == 1 and len(forward.graphs.entries) == 1,
                  "train": check_step(replayed, plain, against),
                  "prefill": check_logits(logits.cpu(), plain["logits"], against)}
    del replayed, logits
    model.zero_grad(set_to_none=True)

    def prefill():
        with torch.no_grad():
            forward(input_ids=ids)
    return {"ours graphed": (lambda: step(input_ids=ids, labels=ids), prefill)}, checks


def overlap_settings(blocks: int) -> dict | None:
    """``cutlass_ops.parallel.sharded_gemms``' overlap switches for ``--tp-overlap BLOCKS`` (None
    for 0: off, the library's defaults)."""
    return {"ROW_BLOCKS": blocks, "OVERLAP_GRAD_X": True} if blocks > 0 else None


def tp_rows(world: int, args, dp: int = 1) -> list[dict]:
    """``tp train`` and ``tp prefill converted vs torchtitan-style`` (the main rows: the peer of
    ``torchtitan_style``) and ``... vs unconverted eager`` (torch's plan, logits gathered);
    ``dp`` > 1: ``fsdp2+tp train converted vs unconverted eager``, a ``dp`` x ``world // dp``
    mesh. Each checked against the unconverted eager model on the same mesh (loss, every
    gradient, the logits), the torchtitan-style model too: a row is correct when both its
    sides are."""
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "rank0.pt")
        spawn(tp_rank_main, world, args.layers, args.tokens, args.reps, out, dp,
              getattr(args, "graphed", False), getattr(args, "tp_overlap", 0))
        got = torch.load(out, weights_only=False)
    checks, logits = got["checks"], got["logits"]
    comm_total = {k: sum(v.values()) for k, v in got["comms"].items()}
    mode = "tp" if dp == 1 else "fsdp2+tp"
    common = {"tp_degree": world // dp, "fsdp2_degree": dp, "tokens_per_step": args.tokens * dp,
              "collectives_per_train_step": got["comms"], "collectives_total": comm_total,
              "peak_gb": got["peak_gb"], "converted_layers": got["converted"],
              "model_tune": args.model_tune_line,
              "overlap": overlap_settings(getattr(args, "tp_overlap", 0))}
    per_gpu = args.tokens * dp / world * 1e3
    kinds = [("train", got["ms"], checks,
              comm_total["ours"] <= comm_total["unconverted"])]  # none more than torch's plan
    if got["prefill_ms"] is not None:
        kinds.append(("prefill", got["prefill_ms"], logits, True))
    rows = []
    for kind, ms, check, collectives_ok in kinds:
        rows.append(tp_row(f"{mode} {kind} converted vs unconverted eager, {world} GPUs, "
                           f"{args.layers} layers", ms, "unconverted", per_gpu,
                           "unconverted eager under torch's TP plan (logits gathered)",
                           {"ours": check["ours"]},
                           {**common, "collectives_not_more_than_torch_plan": collectives_ok},
                           ok=collectives_ok))
        for ours in ("ours", "ours graphed"):
            if "torchtitan" not in ms or ours not in ms:
                continue
            graphed = ours == "ours graphed"
            replay = got.get("graphed_checks") if graphed else None
            rows.append(tp_row(
                f"{mode} {kind} converted{' graphed' if graphed else ''} vs torchtitan-style, "
                f"{world} GPUs, {args.layers} layers", ms, "torchtitan", per_gpu,
                "torchtitan-style: torch's plan, vocabulary-sharded head, loss_parallel, each "
                "layer compiled",
                {**check, "ours": replay[kind]} if replay else check,
                {**common, "peer": peer_settings(got["graph_breaks"]),
                 "weaker_references": {"unconverted eager under torch's TP plan":
                                       round(per_gpu / ms["unconverted"], 1)},
                 **({"graphed_captured": bool(replay and replay["captured"]),
                     "ours_eager_ms": ms["ours"]} if graphed else {})},
                ok=bool(replay and replay["captured"]) if graphed else True, ours=ours))
    return rows


def peer_settings(breaks: int) -> dict:
    import transformers

    return {**TORCHTITAN_SETTINGS, "graph_breaks": breaks, "torch": torch.__version__,
            "transformers": transformers.__version__}


PEER_RULE = ("ours within the bounds; a compiled peer computes the same step: its loss within "
             "the loss bound, no one-sided gradient, gradients and logits within twice the bf16 "
             "bound (torch.compile reorders bf16 sums: 0.056 on one q_proj at 4 layers, H200)")


def peer_agrees(check: dict) -> bool:
    """A compiled peer's check, by ``PEER_RULE``: what shows it measured the same step, without
    holding its bf16 reordering to the bound ours must meet."""
    if "logits_error" in check:
        return check["logits_error"] <= 2 * check["logits_bound"]  # NaN fails
    return (check["loss_error"] <= check["loss_bound"] and not check["one_sided_gradients"]
            and check["worst_gradient_error"] <= 2 * check["gradient_bound"])


def judged(checks: dict) -> bool:
    """A row's verdict over its models' checks: ours by its own bound, peers by ``PEER_RULE``."""
    return all(c["correct"] if k == "ours" else peer_agrees(c) for k, c in checks.items())


def ratio(ours: float, reference: float) -> float:
    """BENCHMARKS.md: ratio is ours / reference as written in the row."""
    return round(ours / reference, 4)


def tp_row(case: str, ms: dict, peer: str, per_gpu: float, peer_name: str, checks: dict,
           detail: dict, ok: bool = True, ours: str = "ours") -> dict:
    """One TP row (tokens/s per GPU): ``ms[ours]`` against ``ms[peer]``, correct when ``ok``
    and ``judged(checks)``."""
    ours_ms = ms[ours]
    ours, reference = round(per_gpu / ours_ms, 1), round(per_gpu / ms[peer], 1)
    row = {"case": case, "unit": "tokens/s per GPU", "ours": ours,
           "reference": reference, "reference_name": peer_name,
           "ratio": ratio(ours, reference),
           "correct": ok and judged(checks),
           "detail": {"ours_ms": ours_ms, "reference_ms": ms[peer],
                      **bounds(checks["ours"]), "checks": checks, "rule": PEER_RULE,
                      **detail}}
    print(row["case"], row["ratio"], row["correct"], flush=True)
    return row


def one_gpu(layers: int, world: int, tokens: int, reps: int) -> float | None:
    """The converted model's speedup on one GPU, rank 0's slice (what the distributed speedup is
    judged against); None where the two models do not fit in the GPU's memory."""
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


def _one_gpu(layers: int, world: int, tokens: int, reps: int) -> float:
    import cutlass_ops
    from custom_kernels import clip_grad
    from tuning.timing import do_bench_interleaved

    plain = llama(layers)
    ours = copy.deepcopy(plain)
    cutlass_ops.convert(ours)
    part = global_batch(world, tokens).chunk(world)[0].cuda()
    times = do_bench_interleaved(
        {"ours": step_fn(ours, part, lambda p: clip_grad.clip_grad_norm_(p, 1.0)),
         "unconverted": step_fn(plain, part, lambda p: torch.nn.utils.clip_grad_norm_(p, 1.0))},
        warmup=1, reps=reps, flush_l2=False)
    del ours, plain
    torch.cuda.empty_cache()
    return times["unconverted"].median_ms / times["ours"].median_ms


LOSS_BOUND = 1e-2  # relative: necessary, far from sufficient (benchmarks.model_checks says why)


def gradient_bound() -> float:
    """The tolerance table's bound for a bf16 model's gradients (each parameter's)."""
    from custom_kernels.core.tolerances import MODEL_GRADIENTS, relative_tolerance

    return relative_tolerance(torch.bfloat16, MODEL_GRADIENTS)


def check_step(got: dict, expected: dict, against: str) -> dict:
    """One train step (``{"loss", "grads"}``, grads by canonical name, None where a parameter got
    none) against another's on the same mesh and inputs: the loss within ``LOSS_BOUND`` and every
    gradient within ``gradient_bound``. A parameter with a gradient on one side and none (or
    zeros) on the other fails, named in ``one_sided_gradients``; so do names without a match.
    The row's detail: both bounds, the measured errors and the worst parameter."""
    from benchmarks import model_checks

    loss_error = abs(got["loss"] - expected["loss"]) / abs(expected["loss"])
    out = {"against": against, "loss": got["loss"], "reference_loss": expected["loss"],
           "loss_error": loss_error, "loss_bound": LOSS_BOUND,
           "gradient_bound": gradient_bound(),
           "one_sided_gradients": sorted(
               name for name in got["grads"].keys() & expected["grads"].keys()
               if (got["grads"][name] is None) != (expected["grads"][name] is None))}
    try:
        grads = model_checks.compare_gradients(got["grads"], expected["grads"], gradient_bound())
    except model_checks.ParameterMismatch as mismatch:
        return {**out, "worst_gradient_error": None, "worst_parameter": None,
                "mismatch": str(mismatch), "correct": False}
    return {**out, "worst_gradient_error": grads.worst_error,
            "worst_parameter": grads.worst_parameter, "failing_parameters": grads.failing,
            "parameters": grads.parameters,
            "correct": loss_error <= LOSS_BOUND and grads.ok and not out["one_sided_gradients"]}


BOUND_KEYS = ("loss_error", "loss_bound", "worst_gradient_error", "worst_parameter",
              "gradient_bound", "one_sided_gradients", "logits_error", "logits_bound")


def bounds(check: dict) -> dict:
    """A check's bounds and measured errors, for the top of a row's detail."""
    return {k: check[k] for k in BOUND_KEYS if k in check}


def check_logits(got: torch.Tensor, expected: torch.Tensor, against: str) -> dict:
    from custom_kernels.core.tolerances import MODEL_LOGITS, relative_error, relative_tolerance

    error, bound = relative_error(got, expected), relative_tolerance(torch.bfloat16, MODEL_LOGITS)
    return {"against": against, "logits_error": error, "logits_bound": bound,
            "correct": error <= bound}  # NaN fails


def train_rows(world: int, args) -> list[dict]:
    """The TP rows (``tp_rows``), then the DDP and FSDP2 rows (``args.modes``): each model's
    step timed on ``world`` ranks, checked against the unconverted model on the same mesh."""
    rows = tp_rows(world, args) if "tp" in args.modes else []
    if "fsdp2+tp" in args.modes:
        if world % 2:
            raise SystemExit("--modes fsdp2+tp: an even --gpus (a 2 x gpus/2 mesh)")
        rows += tp_rows(world, args, dp=2)
    modes = [m for m in args.modes if m not in ("tp", "fsdp2+tp")]
    single = one_gpu(args.layers, world, args.tokens, args.reps) if modes else None
    for mode in modes:
        with tempfile.TemporaryDirectory() as tmp:
            out = str(Path(tmp) / "rank0.pt")
            spawn(rank_main, world, mode, args.layers, args.tokens, args.reps, out,
                  args.profile)
            got = torch.load(out, weights_only=False)
        rows += data_parallel_rows(world, mode, got, single, args)
    return rows


def data_parallel_rows(world: int, mode: str, got: dict, single: float | None, args) -> list:
    """``{mode} train converted vs unconverted eager`` and, for FSDP2, ``... vs fsdp2
    compiled`` (each layer compiled, then sharded): tokens/s over all ranks; correct when the
    converted model's step (and the compiled one's) matches the unconverted model's."""
    ms, checks = got["ms"], got["checks"]
    total = args.tokens * world * 1e3
    size = f"{world} GPU{'s' if world > 1 else ''}, {args.layers} layers"
    peers = [("unconverted", f"unconverted eager, {size}", f"unconverted under {mode}")]
    if "compiled" in ms:
        peers.insert(0, ("compiled", f"fsdp2 compiled, {size}",
                         "unconverted under fsdp2, each layer torch.compile'd then sharded"))
    rows = []
    for peer, suffix, peer_name in peers:
        speedup = ms[peer] / ms["ours"]
        used = {k: checks[k] for k in ("ours", peer) if k in checks}
        ours, reference = round(total / ms["ours"], 1), round(total / ms[peer], 1)
        rows.append({"case": f"{mode} train converted vs {suffix}", "unit": "tokens/s",
                     "ours": ours, "reference": reference, "reference_name": peer_name,
                     "ratio": ratio(ours, reference), "correct": judged(used),
                     "detail": {"ours_ms": ms["ours"], "reference_ms": ms[peer],
                                **bounds(checks["ours"]), "checks": used, "rule": PEER_RULE,
                                "one_gpu_speedup": None if single is None else round(single, 4),
                                "tokens_per_rank": args.tokens,
                                "collectives_per_train_step": got.get("comms"),
                                "model_tune": args.model_tune_line}})
        if got.get("profiles"):  # --profile: where each side's step goes (rank 0's trace)
            rows[-1]["detail"]["profile"] = {k: got["profiles"][k] for k in ("ours", peer)}
        if peer == "compiled":
            rows[-1]["detail"].update(
                weaker_references={f"unconverted eager under {mode}":
                                   round(total / ms["unconverted"], 1)},
                peer={"compile": "torch.compile(layer), default options, each decoder layer, "
                                 "then fully_shard(layer), then fully_shard(model)",
                      "graph_breaks": got["graph_breaks"], "torch": torch.__version__})
        else:
            rows[-1]["detail"]["speedup_vs_one_gpu_speedup"] = (
                None if single is None else round(speedup / single, 4))
        print(rows[-1]["case"], rows[-1]["ratio"], rows[-1]["correct"], flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", type=int, default=2)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=4096, help="tokens per rank")
    parser.add_argument("--reps", type=int, default=20)  # BENCHMARKS.md: 20 at least
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
    parser.add_argument("--graphed", action="store_true",
                        help="tp: also the converted model through graphed_train_step / "
                        "graphed_forward (opts in to graphed_steps.CAPTURE_DISTRIBUTED)")
    parser.add_argument("--tp-overlap", type=int, default=0, metavar="BLOCKS",
                        help="tp: the converted model's all-reduces overlapped with its GEMMs "
                        "(row-parallel GEMMs in BLOCKS row blocks, input gradients' all-reduces "
                        "beside the weight gradients' GEMMs); 0: off (default, the library's)")
    parser.add_argument("--profile", action="store_true",
                        help="ddp, fsdp2: after the timing, each model's steps under the profiler;"
                        " the rows' detail.profile has each side's busy, compute, collective and"
                        " exposed-collective milliseconds a step (benchmarks/gpu_busy.breakdown)")
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
