"""The FP8 LM head inside the chunked loss on an sm90 GPU (cutlass_ops.fp8.loss_head): the
fused kernel and the FP8 GEMMs, at a Llama head's width, against the FP8 Linear called whole
then F.cross_entropy (the same products, the logit gradient quantized at another scale), and
away from the bf16 loss."""

import pytest
import torch

from cutlass_ops.fp8 import Fp8Linear
from custom_kernels.core.tolerances import relative_error
from fp8_reference import chunked_head_and_fp8_linear

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "blockwise"])
def test_the_chunked_fp8_head_follows_the_fp8_linear_on_the_gpu(recipe):
    torch.manual_seed(0)
    head = Fp8Linear(2048, 32000, bias=False, device="cuda", dtype=torch.bfloat16,
                     recipe=recipe)
    hidden = torch.randn(1024, 2048, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, 32000, (1024,), device="cuda")
    labels[::9] = -100
    ours, reference, bf16 = chunked_head_and_fp8_linear(head, hidden, labels, chunk_rows=384)
    assert relative_error(ours[0], reference[0]) < 2e-3
    assert relative_error(ours[1], reference[1]) < 6e-2
    assert relative_error(ours[2], reference[2]) < 6e-2
    assert not torch.equal(ours[0], bf16)
