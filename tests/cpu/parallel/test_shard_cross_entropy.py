"""custom_kernels.parallel.shard_cross_entropy's torch form (what runs off CUDA and for float64,
and the GPU tests' second opinion): the statistics of each rank's slice of the vocabulary,
combined as vocab_parallel_loss combines them after its gather, give F.cross_entropy's loss on
the whole row, and each slice's gradient given the global log-sum-exp is that slice of the
whole row's gradient; with ignored rows, label smoothing, a soft-cap and a row scale."""

import pytest
import torch

from custom_kernels.cross_entropy import chunk_reference
from custom_kernels.parallel import shard_cross_entropy as shard_ce


def sliced(vocab, parts):
    """Uneven slices [start, end) tiling [0, vocab)."""
    cuts = [0] + sorted(torch.randperm(vocab - 1)[:parts - 1].add(1).tolist()) + [vocab]
    return list(zip(cuts[:-1], cuts[1:]))


def combined(stats, smoothing, vocab):
    """vocab_parallel_loss._global_stats's arithmetic on the ranks' statistics [world, 3, R]."""
    lse = torch.logsumexp(stats[:, 0], dim=0)
    loss = (1 - smoothing) * (lse - stats[:, 1].sum(0))
    if smoothing:
        loss = loss + smoothing * (lse - stats[:, 2].sum(0) / vocab)
    return lse, loss


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("smoothing,softcap", [(0.0, None), (0.1, None), (0.0, 30.0),
                                               (0.2, 5.0)])
def test_slices_combine_to_the_whole_rows_loss_and_gradient(dtype, smoothing, softcap):
    torch.manual_seed(7)
    rows, vocab, ignore = 9, 301, -100
    logits = (torch.randn(rows, vocab) * 4).to(dtype)
    labels = torch.randint(0, vocab, (rows,))
    labels[[2, 5]] = ignore
    row_scale = torch.rand(rows) + 0.5
    want_loss, want_grad = chunk_reference(logits, labels, ignore, smoothing, softcap, row_scale)
    slices = sliced(vocab, 3)
    stats = torch.stack([shard_ce.shard_stats(logits[:, a:b].clone(), labels, vocab_start=a,
                                              ignore_index=ignore, softcap=softcap)
                         for a, b in slices])
    assert stats.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert (stats[:, :, [2, 5]] == 0).all()  # ignored rows: nothing gathered
    lse, loss = combined(stats, smoothing, vocab)
    loss = torch.where(labels != ignore, loss, 0.0)
    tol = dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(loss.float(), want_loss.float(), **tol)
    grads = []
    for a, b in slices:
        chunk = logits[:, a:b].clone()
        out = shard_ce.shard_grad_(chunk, labels, lse.float(), vocab_start=a, vocab_total=vocab,
                                   ignore_index=ignore, smoothing=smoothing, softcap=softcap,
                                   row_scale=row_scale)
        assert out is chunk  # in place
        grads.append(chunk)
    grad = torch.cat(grads, dim=1)
    want = want_grad.to(dtype)
    bf16 = dict(rtol=1.6e-2, atol=1e-4) if dtype == torch.bfloat16 else tol
    torch.testing.assert_close(grad.float(), want.float(), **bf16)
    assert (grad[[2, 5]] == 0).all()


def test_no_rows_and_a_label_in_no_slice():
    """Zero rows give empty statistics; a label outside the slice picks nothing there."""
    empty = shard_ce.shard_stats(torch.zeros(0, 8), torch.zeros(0, dtype=torch.long),
                                 vocab_start=0)
    assert empty.shape == (3, 0)
    logits = torch.randn(2, 8)
    stats = shard_ce.shard_stats(logits, torch.tensor([3, 20]), vocab_start=16)
    assert stats[1, 0] == 0 and stats[1, 1] == logits[1, 4]
    torch.testing.assert_close(stats[0], torch.logsumexp(logits, -1))


def test_the_torch_form_leaves_its_inputs_alone():
    """The torch form returns new tensors: float32 logits (which need no conversion) are not
    worked on in place (a test comparing it with the kernel would see the kernel's input
    changed)."""
    logits, labels = torch.randn(3, 8), torch.tensor([1, 2, -100])
    before = logits.clone()
    shard_ce._torch_stats(logits, labels, 0, -100, None)
    shard_ce._torch_grad(logits, labels, torch.zeros(3), 0, 8, -100, 0.1, None, None)
    assert torch.equal(logits, before)
