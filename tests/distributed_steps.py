"""One training step of a converted tiny Hugging Face Llama per rank, under DDP or FSDP2
(``fully_shard`` on each decoder layer and the root), for the distributed tests: each rank
takes its slice of one batch, and what a rank saves (the loss averaged over ranks, the full
gradients, the clipped norm, the full state_dict) is compared with the same step in one process
on the whole batch. CPU ranks talk over gloo, CUDA ranks over NCCL (one GPU per rank)."""

from __future__ import annotations

import os
import socket

import torch

VOCAB, BATCH, SEQ = 256, 4, 32


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def build(device: str, dtype: torch.dtype):
    """The tiny Llama, converted; the same weights in every process."""
    import transformers

    import cutlass_ops

    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=128, intermediate_size=256,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=VOCAB)
    model = transformers.LlamaForCausalLM(config).to(device=device, dtype=dtype)
    report = cutlass_ops.convert(model)
    return model, [d.name for d in report.decisions if d.converted]


def batch(device: str) -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1)) \
        .to(device)


def step(model, ids):
    """Loss and backward; the gradients by parameter name before any clipping."""
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    grads = {}
    for name, p in model.named_parameters():
        if p.grad is not None:
            g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            grads[name.replace("module.", "")] = g.detach().float().cpu().clone()
    return loss.detach(), grads


def rank_main(rank: int, world: int, port: int, mode: str, device_type: str, dtype_name: str,
              out: str) -> None:
    import torch.distributed as dist

    from custom_kernels import clip_grad
    from custom_kernels.parallel import clip_grad_distributed

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    device = "cpu" if device_type == "cpu" else f"cuda:{rank}"
    if device_type == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group("gloo" if device_type == "cpu" else "nccl", rank=rank,
                            world_size=world)
    model, converted = build(device, getattr(torch, dtype_name))
    if mode == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
    else:
        model = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[rank] if device_type == "cuda" else None)
    ids = batch(device).chunk(world)[rank]
    loss, grads = step(model, ids)
    dist.all_reduce(loss)
    loss /= world
    if mode == "fsdp2":  # sharded DTensor gradients: our local norm and one all-reduce
        norm = clip_grad_distributed.clip_grad_norm_(model.parameters(), 1.0).full_tensor()
        from torch.distributed.checkpoint.state_dict import (StateDictOptions,
                                                             get_model_state_dict)

        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
                                                                     cpu_offload=True))
    else:  # DDP's gradients are whole on every rank: the one-device clip
        norm = clip_grad.clip_grad_norm_(model.parameters(), 1.0)
        state = {k.replace("module.", ""): v.cpu() for k, v in model.state_dict().items()}
    if rank == 0:
        torch.save({"loss": loss.float().cpu(), "grads": grads, "norm": norm.float().cpu(),
                    "state": state, "converted": converted}, out)
    dist.barrier()
    dist.destroy_process_group()


def run(mode: str, world: int, device_type: str, dtype_name: str, out: str) -> dict:
    """``rank_main`` on ``world`` spawned ranks; rank 0's record."""
    torch.multiprocessing.spawn(rank_main, args=(world, free_port(), mode, device_type,
                                                 dtype_name, out), nprocs=world, join=True)
    return torch.load(out, weights_only=False)


def single(device: str, dtype: torch.dtype) -> dict:
    """The same step in this process, on the whole batch, clipped by torch."""
    model, converted = build(device, dtype)
    state = {k: v.cpu().clone() for k, v in model.state_dict().items()}
    loss, grads = step(model, batch(device))
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    return {"loss": loss.float().cpu(), "grads": grads, "norm": norm.float().cpu(),
            "state": state, "converted": converted}
