"""A converted model under torch.distributed on the CPU (gloo, two ranks): DDP and FSDP2
(``fully_shard``) train steps match the same step in one process on the whole batch (loss,
every gradient, the clipped norm through our distributed clip), and FSDP2's full state_dict
round trips with the same keys and values as the unconverted model's."""

import pytest
import torch

pytest.importorskip("transformers")

import distributed_steps  # noqa: E402


@pytest.fixture(scope="module")
def reference():
    return distributed_steps.single("cpu", torch.float32)


@pytest.mark.parametrize("mode", ["ddp", "fsdp2"])
def test_two_ranks_train_like_one_process(tmp_path, reference, mode):
    got = distributed_steps.run(mode, 2, "cpu", "float32", str(tmp_path / "rank0.pt"))
    assert got["converted"] == reference["converted"] and got["converted"]
    torch.testing.assert_close(got["loss"], reference["loss"], rtol=1e-5, atol=1e-5)
    assert got["grads"].keys() == reference["grads"].keys()
    for name, grad in reference["grads"].items():
        torch.testing.assert_close(got["grads"][name], grad, rtol=1e-4, atol=1e-5, msg=name)
    torch.testing.assert_close(got["norm"], reference["norm"], rtol=1e-5, atol=1e-6)
    assert got["state"].keys() == reference["state"].keys()
    for name, value in reference["state"].items():
        torch.testing.assert_close(got["state"][name], value, msg=name)


def test_the_converted_state_dict_keeps_the_unconverted_keys(reference):
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=128, intermediate_size=256,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=distributed_steps.VOCAB)
    plain = transformers.LlamaForCausalLM(config).state_dict()
    assert plain.keys() == reference["state"].keys()
