"""linear_cross_entropy on the GPU against a float32 reference on the full logits: loss and every
gradient, with ignored tokens, an all-ignored chunk, label smoothing, soft-capping, vocabularies
that are not a multiple of a tile, rows that are not a multiple of the chunk; and a peak memory
that holds one chunk of logits, not all of them."""

import pytest
import torch
import torch.nn.functional as F

import cutlass_ops
from custom_kernels.core.tolerances import relative_error

pytestmark = pytest.mark.gpu


def case(rows, hidden, vocab, dtype, seed=0):
    g = torch.Generator("cuda").manual_seed(seed)
    h = torch.randn(rows, hidden, device="cuda", generator=g).to(dtype).requires_grad_()
    w = (torch.randn(vocab, hidden, device="cuda", generator=g) / hidden ** 0.5).to(dtype) \
        .requires_grad_()
    labels = torch.randint(0, vocab, (rows,), device="cuda", generator=g)
    labels[::9] = -100
    return h, w, labels


def reference(h, w, labels, softcap=None, **kw):
    logits = h.float() @ w.float().t()  # float32 throughout: the reference the loss is held to
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    return F.cross_entropy(logits, labels, **kw)


@pytest.mark.parametrize("vocab", [32000, 128256, 151936])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_loss_and_gradients_against_float32(vocab, dtype):
    h, w, labels = case(1000, 256, vocab, dtype)
    labels[:128] = -100  # the whole first chunk
    ours = cutlass_ops.linear_cross_entropy(h, w, labels, chunk_rows=128)
    hf, wf = h.detach().float().requires_grad_(), w.detach().float().requires_grad_()
    theirs = reference(hf, wf, labels)
    assert abs(ours.item() - theirs.item()) <= 1e-2 * abs(theirs.item())
    ours.backward()
    theirs.backward()
    assert relative_error(h.grad, hf.grad) < 2e-2 and relative_error(w.grad, wf.grad) < 2e-2


@pytest.mark.parametrize("smoothing, softcap", [(0.1, None), (0.0, 30.0), (0.1, 30.0)])
def test_smoothing_and_softcap(smoothing, softcap):
    h, w, labels = case(300, 128, 32000, torch.bfloat16)
    ours = cutlass_ops.linear_cross_entropy(h, w, labels, label_smoothing=smoothing,
                                            logit_softcap=softcap, chunk_rows=64)
    hf, wf = h.detach().float().requires_grad_(), w.detach().float().requires_grad_()
    theirs = reference(hf, wf, labels, softcap, label_smoothing=smoothing)
    assert abs(ours.item() - theirs.item()) <= 1e-2 * abs(theirs.item())
    ours.backward()
    theirs.backward()
    assert relative_error(h.grad, hf.grad) < 2e-2 and relative_error(w.grad, wf.grad) < 2e-2


def test_peak_memory_is_one_chunk_not_the_logits():
    h, w, labels = case(4096, 1024, 128256, torch.bfloat16)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    cutlass_ops.linear_cross_entropy(h, w, labels, chunk_rows=512).backward()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    full_logits_fp32 = 4096 * 128256 * 4
    assert extra < full_logits_fp32 / 2, extra


def test_bad_labels_are_refused_before_any_launch():
    from custom_kernels.core.errors import UnsupportedInputError

    h, w, labels = case(64, 64, 1000, torch.bfloat16)
    labels[3] = 1000
    with pytest.raises(UnsupportedInputError, match="outside"):
        cutlass_ops.linear_cross_entropy(h, w, labels)
