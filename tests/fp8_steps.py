"""One training step of a tiny Llama converted with ``fp8=recipe``, in one process or per rank
under FSDP2 (``fully_shard`` on each decoder layer and the root, after ``convert``), for the FP8
conversion's distributed tests (tests/cpu/fp8/test_fp8_convert.py over gloo, tests/gpu over NCCL):
what a rank saves (the loss, the full gradients, the full state_dict, the FP8 layers) is compared
with the same step in one process."""

from __future__ import annotations

import os

import torch

VOCAB, BATCH, SEQ = 256, 2, 64  # 128 tokens: blockwise's wgrad needs no padding


def build(device: str, recipe: str):
    """The tiny Llama (k/v projections 128 wide: every recipe takes every projection),
    converted; the same weights in every process."""
    import transformers

    import cutlass_ops

    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=256, intermediate_size=512,
                                      num_hidden_layers=2, num_attention_heads=2,
                                      num_key_value_heads=1, vocab_size=VOCAB)
    model = transformers.LlamaForCausalLM(config).to(device=device, dtype=torch.bfloat16)
    report = cutlass_ops.convert(model, fp8=recipe)
    return model, sorted(report.fp8)


def batch(device: str) -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1)) \
        .to(device)


def step(model, ids):
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    grads = {}
    for name, p in model.named_parameters():
        if p.grad is not None:
            g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            grads[name] = g.detach().float().cpu().clone()
    return loss.detach().float().cpu(), grads


def rank_main(rank: int, world: int, port: int, device_type: str, recipe: str,
              out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.fsdp import fully_shard

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    device = "cpu" if device_type == "cpu" else f"cuda:{rank}"
    if device_type == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group("gloo" if device_type == "cpu" else "nccl", rank=rank,
                            world_size=world)
    model, fp8 = build(device, recipe)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    loss, grads = step(model, batch(device).chunk(world)[rank])
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
                                                                 cpu_offload=True))
    if rank == 0:
        torch.save({"loss": loss, "grads": grads, "state": state, "fp8": fp8}, out)
    dist.barrier()
    dist.destroy_process_group()


def run(world: int, device_type: str, recipe: str, out: str) -> dict:
    from distributed_steps import free_port

    torch.multiprocessing.spawn(rank_main, args=(world, free_port(), device_type, recipe, out),
                                nprocs=world, join=True)
    return torch.load(out, weights_only=False)


def single(device: str, recipe: str) -> dict:
    model, fp8 = build(device, recipe)
    state = {k: v.cpu().clone() for k, v in model.state_dict().items()}
    loss, grads = step(model, batch(device))
    return {"loss": loss, "grads": grads, "state": state, "fp8": fp8}
