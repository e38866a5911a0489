"""An FP8 LM head inside the chunked loss (cutlass_ops.fp8.loss_head): the routed loss of a model
converted with ``fp8_lm_head=True`` runs the head's three products in FP8 (before, it read the
head's weight in bf16 and the option changed nothing in training); its loss and gradients follow
the FP8 Linear's own (the head called, then cross-entropy), within the quantization of a
different logit-gradient scale; a frozen head reads the layer's kept FP8 copy."""

import pytest
import torch

import cutlass_ops
from cutlass_ops.fp8 import Fp8Linear, gemm_steps
from cutlass_ops.fused_cross_entropy import linear_cross_entropy
from custom_kernels.core.errors import UnsupportedInputError
from custom_kernels.core.tolerances import relative_error
from fp8_reference import chunked_head_and_fp8_linear
from test_fp8_convert import tiny_llama

RECIPES = ["tensorwise", "rowwise", "blockwise"]


@pytest.fixture(autouse=True)
def quiet(warnings):
    yield


def _head(recipe):
    torch.manual_seed(1)
    return Fp8Linear(256, 384, bias=False, dtype=torch.bfloat16, recipe=recipe)


@pytest.mark.parametrize("recipe", RECIPES)
def test_the_chunked_fp8_head_follows_the_fp8_linear(recipe):
    head = _head(recipe)
    hidden = torch.randn(128, 256, dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, 384, (128,), generator=torch.Generator().manual_seed(2))
    labels[::7] = -100
    ours, reference, bf16 = chunked_head_and_fp8_linear(head, hidden, labels, chunk_rows=48)
    assert relative_error(ours[0], reference[0]) < 2e-3
    assert relative_error(ours[1], reference[1]) < 6e-2, recipe
    assert relative_error(ours[2], reference[2]) < 6e-2, recipe
    assert not torch.equal(ours[0], bf16)  # the products were FP8


def test_a_converted_model_s_training_loss_runs_the_fp8_head():
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(3))
    losses = {}
    for fp8_head in (False, True):
        model = tiny_llama()
        cutlass_ops.convert(model, fp8="rowwise", fp8_lm_head=fp8_head)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        losses[fp8_head] = loss.detach()
        assert model.lm_head.weight.grad is not None
    # The option changes the training loss now (it used to leave it bit for bit unchanged).
    assert not torch.equal(losses[False], losses[True])
    assert relative_error(losses[True], losses[False]) < 2e-2


def test_a_frozen_head_reads_its_kept_fp8_copy(monkeypatch):
    head = _head("rowwise")
    head.weight.requires_grad_(False)
    hidden = torch.randn(32, 256, dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, 384, (32,), generator=torch.Generator().manual_seed(4))
    quantized = []
    original = gemm_steps.quantize
    monkeypatch.setattr(gemm_steps, "quantize", lambda t, *a, **k: (
        quantized.append(tuple(t.shape)), original(t, *a, **k))[1])
    for _ in range(2):
        linear_cross_entropy(hidden, head.weight, labels,
                             products=head.loss_head_products()).backward()
    weights = [s for s in quantized if s == (384, 256)]
    # W once for the first forward (kept), then W^T for each call's hidden gradient.
    assert weights.count((384, 256)) == 3, quantized
    assert head.weight.grad is None and hidden.grad is not None


def test_products_that_are_not_head_products_are_refused():
    with pytest.raises(UnsupportedInputError, match="products must be a HeadProducts"):
        linear_cross_entropy(torch.randn(4, 256), torch.randn(384, 256),
                             torch.zeros(4, dtype=torch.long), products="fp8")
