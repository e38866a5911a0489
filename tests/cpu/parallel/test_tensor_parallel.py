"""cutlass_ops.parallel.tensor_parallel on the CPU: two gloo ranks shard a fused Llama-style model
(fused on the CPU: the kernels' torch fallbacks) and train it, sharded by ``parallelize`` after
fusing, or by torch's Llama plan or Hugging Face's ``tp_plan="auto"`` (with accelerate) before
(the fused blocks adopt the plan's shards). The loss, every gradient (the
sharded ones gathered) and the logits without labels equal the same fused model's on one
process; the sharded state_dict loads back, the full one into an unsharded model; the ranks hold their own heads' q, k, v and their gate and up slice end to end (one
merged GEMM a rank); a step issues two all-reduces a layer forward and two backward, plus the
loss's two gathers forward and one all-reduce backward (CommDebugMode); the refusals."""

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from gloo_ranks import on_ranks  # noqa: E402

CONFIG = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4,
              num_key_value_heads=2, num_hidden_layers=2, vocab_size=102,
              max_position_embeddings=128, tie_word_embeddings=False)


def _unfused(device="cpu", config=CONFIG):
    """The tiny model (float32 on the CPU; bf16 on a GPU), norm weights off one."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**config))
    model = model.to(device, torch.float32 if device == "cpu" else torch.bfloat16)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model


def _model(device="cpu", config=CONFIG, mesh=None, checkpoint=None):
    """``_unfused`` fused (on the CPU: the kernels' torch fallbacks); with ``mesh``, sharded by
    torch's Llama plan first, or with ``checkpoint`` (``_unfused`` saved) loaded by Hugging
    Face's ``from_pretrained(tp_plan="auto")``: the fused blocks adopt either's shards."""
    import os

    import torch.distributed as dist

    from cutlass_ops import decoder_blocks, lm_loss
    from cutlass_ops.parallel import sharded_gemms

    if checkpoint is not None:
        rank, world = dist.get_rank(), dist.get_world_size()
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
        model = transformers.AutoModelForCausalLM.from_pretrained(
            checkpoint, tp_plan="auto", dtype=torch.float32 if device == "cpu" else
            torch.bfloat16)
    else:
        model = _unfused(device, config)
    if mesh is not None:
        _torch_plan(model, mesh)
    for layer in model.model.layers:
        why = decoder_blocks.fuse(layer, require_gpu=device != "cpu", adopt=sharded_gemms.adopt)
        assert why is None, why
    assert lm_loss.route(model) is None
    return model


def _torch_plan(model, mesh) -> None:
    from torch.distributed.tensor.parallel import parallelize_module

    from cutlass_ops.parallel.tensor_parallel import llama_plan

    parallelize_module(model, mesh, llama_plan(model))


def _grads(model) -> dict:
    return {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone()
            for n, p in model.named_parameters() if p.grad is not None}


def _train_and_infer(rank, world, device="cpu", config=CONFIG, how="parallelize",
                     checkpoint=None, overlap=False):
    """(what the sharded model gave, what the unsharded one gave) on this rank; ``device``
    "cuda": NCCL ranks, the ops' own kernels (tests/gpu/parallel/test_tensor_parallel_gpu.py); ``how``:
    "parallelize" (convert, then ``tensor_parallel.parallelize``), "torch_plan" (torch's
    plan, then the fused blocks adopt its shards) or "hf_tp_plan" (Hugging Face's
    ``tp_plan="auto"`` of ``checkpoint``, then the same); ``overlap``: the all-reduces
    overlapped with the GEMMs (``sharded_gemms.ROW_BLOCKS``, ``OVERLAP_GRAD_X``), the row-parallel
    GEMMs in 2 blocks of 12 rows."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.debug import CommDebugMode

    from cutlass_ops import fused_linear
    from cutlass_ops.parallel import sharded_gemms, tensor_parallel

    if overlap:
        sharded_gemms.ROW_BLOCKS, sharded_gemms.MIN_BLOCK_ROWS = 2, 12
        sharded_gemms.OVERLAP_GRAD_X = True

        def unoverlapped(*args):
            raise AssertionError("an input gradient took the all-reduce after both GEMMs")
        sharded_gemms._CopyToRanks.apply = unoverlapped  # this rank's process only

    ids = torch.randint(0, config["vocab_size"], (2, 12),
                        generator=torch.Generator().manual_seed(1)).to(device)
    reference = _model(device, config)
    loss = reference(input_ids=ids, labels=ids).loss
    loss.backward()
    expected = {"loss": loss.detach(), "grads": _grads(reference)}
    with torch.no_grad():
        expected["logits"] = reference(input_ids=ids).logits

    mesh = init_device_mesh(device, (world,))
    if how == "parallelize":
        model = tensor_parallel.parallelize(_model(device, config), mesh)
    elif how == "hf_tp_plan":
        model = _model(device, config, checkpoint=checkpoint)
    else:
        model = _model(device, config, mesh)
    attention, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    packed = [fused_linear.merged_view([p.weight.to_local() for p in group]) is not None
              for group in ((attention.q_proj, attention.k_proj, attention.v_proj),
                            (mlp.gate_proj, mlp.up_proj))]
    with CommDebugMode() as forward:
        loss = model(input_ids=ids, labels=ids).loss
    with CommDebugMode() as backward:
        loss.backward()
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    got = {"loss": loss.detach(), "grads": _grads(model), "logits": logits,
           "state": _state_round_trip(model, device, config),
           "packed": packed, "local_q_rows": attention.q_proj.weight.to_local().shape[0],
           "forward_comms": {str(k): v for k, v in forward.get_comm_counts().items()},
           "backward_comms": {str(k): v for k, v in backward.get_comm_counts().items()}}
    return got, expected


HOWS = ["parallelize", "torch_plan", pytest.param("hf_tp_plan", marks=pytest.mark.skipif(
    importlib.util.find_spec("accelerate") is None,
    reason="Hugging Face's tp_plan needs accelerate"))]


@pytest.mark.parametrize("how", HOWS)
def test_the_sharded_model_trains_and_infers_as_one_process(tmp_path, how):
    checkpoint = str(tmp_path / "checkpoint")
    _unfused().save_pretrained(checkpoint)  # Hugging Face's tp_plan loads a checkpoint
    # ``parallelize`` runs with the all-reduces overlapped (sharded_gemms' switches, off by
    # default: the plan-sharded cases run without), the row-parallel GEMMs in two blocks
    overlap = how == "parallelize"
    (got, expected), (got1, _) = on_ranks(tmp_path, _train_and_infer, "cpu", CONFIG, how,
                                          checkpoint, overlap)
    torch.testing.assert_close(got["loss"], expected["loss"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got1["loss"], got["loss"], rtol=0, atol=0)
    assert got["grads"].keys() == expected["grads"].keys()
    for name, grad in expected["grads"].items():
        torch.testing.assert_close(got["grads"][name], grad, rtol=1e-4, atol=1e-5, msg=name)
    torch.testing.assert_close(got["logits"], expected["logits"], rtol=1e-4, atol=1e-5)
    assert got["packed"] == [True, True] and got["local_q_rows"] == 32
    assert got["state"] == {"sharded_types": ["DTensor", "Tensor"], "reloaded": True,
                            "into_unsharded": True, "keys": True}
    layers = CONFIG["num_hidden_layers"]
    # forward: o_proj and down_proj a layer (one a block, overlapped), plus the loss's two
    # gathers (its setup, its one chunk); backward: the QKV and gate+up inputs a layer (each
    # beside its weight gradient's GEMM, overlapped), plus the loss's grad_hidden
    forward = dict(got["forward_comms"])
    if how == "hf_tp_plan":  # one DTensor all-reduce of Hugging Face's own plan, not ours
        assert forward.pop("c10d_functional.all_reduce", 0) <= 1, got["forward_comms"]
    blocks = 2 if overlap else 1
    assert forward == {"c10d.allreduce_": 2 * layers * blocks, "c10d._allgather_base_": 2}, \
        forward
    assert got["backward_comms"] == {"c10d.allreduce_": 2 * layers + 1}, got["backward_comms"]


def _state_round_trip(model, device, config) -> dict:
    """The sharded state_dict (DTensor entries) and the full one (``full_tensor``) of the
    sharded model, loaded back into it and into a fresh unsharded model."""
    from torch.distributed.tensor import DTensor

    sharded = {k: v.detach().clone() for k, v in model.state_dict().items()}
    full = {k: v.full_tensor() if isinstance(v, DTensor) else v.clone()
            for k, v in sharded.items()}
    before = {k: v.clone() for k, v in full.items()}
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    model.load_state_dict(sharded)  # the same tensors: back to what was saved
    fresh = _model(device, config)
    fresh.load_state_dict(full)
    return {"sharded_types": sorted({type(v).__name__ for v in sharded.values()}),
            "reloaded": all(torch.equal(v.full_tensor() if isinstance(v, DTensor) else v,
                                        before[k]) for k, v in model.state_dict().items()),
            "into_unsharded": all(torch.equal(v, before[k])
                                  for k, v in fresh.state_dict().items()),
            "keys": sorted(full) == sorted(fresh.state_dict())}


def test_refusals():
    from cutlass_ops.parallel import tensor_parallel

    plain = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**CONFIG))
    assert "not a fused block" in tensor_parallel.refusal(plain, 2)
    model = _model()
    assert tensor_parallel.refusal(model, 2) is None
    assert "heads do not split over 4" in tensor_parallel.refusal(model, 4)
    tied = _model()
    tied.lm_head.weight = tied.model.embed_tokens.weight
    assert "tied" in tensor_parallel.refusal(tied, 2)


def _plan_refusals(rank, world):
    """What fusing says of a layer a plan sharded otherwise (q_proj by columns), and what
    parallelize says of a 2-D mesh."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import RowwiseParallel, parallelize_module

    from cutlass_ops import decoder_blocks
    from cutlass_ops.parallel import sharded_gemms, tensor_parallel
    from custom_kernels.core.errors import UnsupportedInputError

    mesh = init_device_mesh("cpu", (world,))
    model = _unfused()
    plan = tensor_parallel.llama_plan(model)
    plan["model.layers.0.self_attn.q_proj"] = RowwiseParallel()
    parallelize_module(model, mesh, plan)
    layer = model.model.layers[0]
    why = decoder_blocks.fuse(layer, require_gpu=False, adopt=sharded_gemms.adopt)
    fused = decoder_blocks.is_fused(layer), decoder_blocks.is_fused(model.model.layers[1])
    try:
        tensor_parallel.parallelize(_model(), init_device_mesh("cpu", (1, world)))
        mesh_why = None
    except UnsupportedInputError as exc:
        mesh_why = str(exc)
    return why, fused, mesh_why


def test_a_plan_sharded_otherwise_is_refused(tmp_path):
    why, fused, mesh_why = on_ranks(tmp_path, _plan_refusals)[0]
    assert why is not None and "sharded otherwise" in why and "q_proj" in why
    assert fused == (False, False)  # refused, left as it was; the other layer was not fused
    assert mesh_why is not None and "1-D mesh" in mesh_why
