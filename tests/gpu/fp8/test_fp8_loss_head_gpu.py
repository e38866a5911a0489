"""The FP8 LM head inside the chunked loss on an sm90 GPU (cutlass_ops.fp8.loss_head): the
fused kernel and the FP8 GEMMs, at a Llama head's width, against the FP8 Linear called whole
then F.cross_entropy (the same products, the logit gradient quantized at another scale), and
away from the bf16 loss."""

import pytest
import torch
import torch.nn.functional as F

from cutlass_ops.fp8 import Fp8Linear
from cutlass_ops.fused_cross_entropy import linear_cross_entropy
from custom_kernels.core.tolerances import relative_error

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "blockwise"])
def test_the_chunked_fp8_head_follows_the_fp8_linear_on_the_gpu(recipe):
    torch.manual_seed(0)
    head = Fp8Linear(2048, 32000, bias=False, device="cuda", dtype=torch.bfloat16,
                     recipe=recipe)
    hidden = torch.randn(1024, 2048, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, 32000, (1024,), device="cuda")
    labels[::9] = -100
    ours = linear_cross_entropy(hidden, head.weight, labels, chunk_rows=384,
                                products=head.loss_head_products())
    ours.backward()
    got = (ours.detach(), hidden.grad.clone(), head.weight.grad.clone())
    hidden.grad, head.weight.grad = None, None
    reference = F.cross_entropy(head(hidden).float(), labels, ignore_index=-100)
    reference.backward()
    assert relative_error(got[0], reference.detach()) < 2e-3
    assert relative_error(got[1], hidden.grad) < 6e-2
    assert relative_error(got[2], head.weight.grad) < 6e-2
    bf16 = linear_cross_entropy(hidden.detach(), head.weight.detach(), labels)
    assert not torch.equal(got[0], bf16)
