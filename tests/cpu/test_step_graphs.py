"""cutlass_ops.step_graphs without a GPU: when a call may replay a graph, the holder's rules
(first sighting eager, second captured, weights invalidate, bounded, failures stay eager) and the
shared inputs' copies. The captures themselves: tests/gpu/test_step_graphs_gpu.py."""

import pytest
import torch

from cutlass_ops import module_state, step_graphs


def test_only_gradient_free_small_cuda_calls_are_eligible(monkeypatch):
    x = torch.randn(2, 1, 8)
    with torch.no_grad():
        assert not step_graphs.eligible(x)  # a CPU tensor
    assert not step_graphs.eligible(torch.randn(2, 1, 8, device="meta"))
    x = torch.randn(2, 1, 8, device="meta")
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: None)  # meta's index
    assert not step_graphs.eligible(x)  # gradients enabled
    with torch.no_grad():
        assert step_graphs.eligible(x)
        assert not step_graphs.eligible(torch.randn(2, step_graphs.MAX_TOKENS + 1, 8,
                                                    device="meta"))
        assert not step_graphs.eligible(torch.randn(step_graphs.MAX_ROWS + 1, 1, 8,
                                                    device="meta"))
        assert not step_graphs.eligible(torch.randn(0, 1, 8, device="meta"))
        assert not step_graphs.eligible(torch.randn(2, 8, device="meta"))
        monkeypatch.setenv("CUTLASS_OPS_STEP_GRAPHS", "0")
        assert not step_graphs.eligible(x)
        monkeypatch.delenv("CUTLASS_OPS_STEP_GRAPHS")
        monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
        assert not step_graphs.eligible(x)  # inside the caller's own capture


def test_signatures_part_on_layout_dtype_alignment_and_inference_mode():
    x = torch.randn(4, 1, 8)
    base = step_graphs.signature(x)
    assert step_graphs.signature(torch.randn(4, 1, 8)) == base
    assert step_graphs.signature(x.half()) != base
    assert step_graphs.signature(torch.randn(8, 1, 4).transpose(0, 2)) != base
    assert step_graphs.signature(torch.randn(4 * 8 + 1)[1:].view(4, 1, 8)) != base
    with torch.inference_mode():
        assert step_graphs.signature(x) != base


def test_holder_runs_eagerly_first_then_captures_and_keeps_a_bounded_set():
    holder = step_graphs.Holder()
    assert holder.lookup("a", (1,)) is None and not holder.should_capture("a")
    assert holder.lookup("a", (1,)) is None and holder.should_capture("a")
    assert holder.capture("a", lambda: "graphs of a") == "graphs of a"
    assert holder.lookup("a", (1,)) == "graphs of a"
    for key in range(step_graphs.MAX_GRAPHS):
        holder.store(key, f"graphs of {key}")
    assert holder.lookup("a", (1,)) is None  # the oldest went
    assert len(holder.graphs) == step_graphs.MAX_GRAPHS


def test_copies_of_a_holder_start_empty():
    import copy
    import pickle

    holder = step_graphs.Holder()
    holder.store("a", "graphs")
    assert not copy.deepcopy(holder).graphs
    assert not pickle.loads(pickle.dumps(holder)).graphs


def test_new_weights_drop_every_graph():
    holder = step_graphs.Holder()
    holder.lookup("a", (1, 2))
    holder.store("a", "graphs")
    assert holder.lookup("a", (1, 2)) == "graphs"
    assert holder.lookup("a", (1, 3)) is None
    assert not holder.should_capture("a")  # seen afresh: eager once more


def test_a_failed_capture_stays_eager_and_is_logged(warnings):
    holder = step_graphs.Holder()

    def broken():
        raise RuntimeError("operation not permitted when stream is capturing")

    assert holder.capture("a", broken) is None
    assert holder.lookup("a", ()) is step_graphs.EAGER
    assert warnings() == ["a decode step runs without CUDA graphs: capturing it failed: "
                          "RuntimeError: operation not permitted when stream is capturing"]


def test_shared_inputs_copy_once_per_tensor_and_version():
    shared = step_graphs.SharedInputs()
    cos, sin = torch.randn(1, 1, 4), torch.randn(1, 1, 4)
    buffers = shared.get("rotary", (cos, sin))
    assert buffers[0] is not cos and torch.equal(buffers[0], cos)
    buffers[0].zero_()  # not copied again for the same tensors at the same version
    assert shared.get("rotary", (cos, sin))[0] is buffers[0]
    assert not torch.equal(buffers[0], cos)
    cos.mul_(2)  # a new version: copied
    assert torch.equal(shared.get("rotary", (cos, sin))[0], cos)
    other = torch.randn(1, 1, 4)
    assert torch.equal(shared.get("rotary", (other, sin))[0], other)  # a new tensor: copied
    assert shared.get("rotary", (other, sin))[0] is buffers[0]  # into the same buffer
    wide = torch.randn(2, 1, 4)
    assert shared.get("rotary", (wide, wide))[0] is not buffers[0]  # another signature


@pytest.mark.parametrize("grad", [False, True])
def test_a_fused_layer_on_the_cpu_never_captures(grad):
    transformers = pytest.importorskip("transformers")
    from cutlass_ops import decoder_blocks

    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=96,
                                      num_attention_heads=4, num_key_value_heads=2,
                                      num_hidden_layers=2, vocab_size=101)
    model = transformers.LlamaForCausalLM(config).eval()
    for layer in model.model.layers:
        assert decoder_blocks.fuse(layer, require_gpu=False) is None
    ids = torch.randint(0, 101, (2, 1))
    with torch.set_grad_enabled(grad):
        model(ids)
        model(ids)
    assert all(module_state.get(layer, step_graphs.Holder) is None for layer in model.model.layers)


def test_paused_turns_graphs_off_inside(monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: None)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    x = torch.randn(2, 1, 8, device="meta")
    with torch.no_grad():
        with step_graphs.paused():
            with step_graphs.paused():
                assert not step_graphs.eligible(x)
            assert not step_graphs.eligible(x)
        assert step_graphs.eligible(x)


def test_inference_tensors_are_copied_every_time():
    shared = step_graphs.SharedInputs()
    with torch.inference_mode():
        cos = torch.randn(1, 1, 4)
        buffers = shared.get("rotary", (cos,))
        buffers[0].zero_()
        assert torch.equal(shared.get("rotary", (cos,))[0], cos)


def test_cublas_workspaces_are_dropped_before_and_after_a_capture(monkeypatch):
    """So that a graph's matmuls bake in a workspace from its own pool, and no later capture
    bakes in that one (it goes with the graph); even when the captured code raises."""
    from cutlass_ops.step_graphs import own_cublas_workspaces

    calls = []
    monkeypatch.setattr(torch._C, "_cuda_clearCublasWorkspaces", lambda: calls.append("clear"),
                        raising=False)
    with own_cublas_workspaces():
        calls.append("capture")
    assert calls == ["clear", "capture", "clear"]
    with pytest.raises(RuntimeError), own_cublas_workspaces():
        raise RuntimeError("a capture that fails")
    assert calls[-1] == "clear" and len(calls) == 5
