"""custom_kernels.parallel.shard_cross_entropy's kernels on one GPU against its torch form
(tests/cpu/parallel/test_shard_cross_entropy.py checks that form against F.cross_entropy): the
statistics and the in-place gradient of vocabulary slices in float32, float16 and bfloat16,
aligned and not (odd slice widths and a row stride of a wider head), with ignored rows, label
smoothing, a soft-cap and a row scale; no rows; and a CUDA-graph replay."""

import pytest
import torch

from custom_kernels.core.tolerances import relative_error
from custom_kernels.parallel import shard_cross_entropy as shard_ce

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                  reason="needs a CUDA GPU")]
# As tests/gpu/test_cross_entropy_gpu.py: one rounding to the dtype (fp32: ex2.approx); under a
# soft-cap fp16 / bf16 take tanh.approx (relative error 2^-11) against the torch form's tanh.
GRAD_TOL = {torch.float32: 1e-5, torch.float16: 1.5e-3, torch.bfloat16: 6e-3}


def tolerances(dtype, softcap):
    """(statistics, gradient) tolerances, relative errors of the whole tensors."""
    if softcap is None or dtype == torch.float32:
        return 2e-5, GRAD_TOL[dtype]
    return 2e-3, 1e-2


def inputs(dtype, rows, width, start, vocab, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    head = torch.randn(rows, width + 3, device="cuda", generator=g).mul_(6).to(dtype)
    logits = head[:, 1:1 + width]  # a row stride of the wider head, a misaligned first column
    labels = torch.randint(0, vocab, (rows,), device="cuda", generator=g)
    labels[::7] = -100
    labels[1::5] = start + torch.randint(0, width, labels[1::5].shape, device="cuda", generator=g)
    return logits, labels, torch.rand(rows, device="cuda", generator=g) + 0.5


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("width,start,vocab", [(64128, 64128, 128256), (16000, 0, 32000),
                                               (1001, 5000, 9001)])
@pytest.mark.parametrize("smoothing,softcap", [(0.0, None), (0.1, 30.0)])
def test_kernels_match_the_torch_form(dtype, width, start, vocab, smoothing, softcap):
    logits, labels, row_scale = inputs(dtype, 37, width, start, vocab, width + int(smoothing * 10))
    stats_tol, grad_tol = tolerances(dtype, softcap)
    stats = shard_ce.shard_stats(logits, labels, vocab_start=start, softcap=softcap)
    want = shard_ce._torch_stats(logits, labels, start, -100, softcap)
    assert stats.shape == want.shape and stats.dtype == torch.float32
    for k in range(3):  # lse, the target logit, the sum
        assert relative_error(stats[k], want[k]) < stats_tol, (k, relative_error(stats[k], want[k]))
    lse = stats[0] + torch.rand_like(stats[0])  # a global lse over more than this slice
    kwargs = dict(vocab_start=start, vocab_total=vocab, smoothing=smoothing, softcap=softcap,
                  row_scale=row_scale)
    want_grad = shard_ce._torch_grad(logits, labels, lse, start, vocab, -100, smoothing, softcap,
                                     row_scale).to(dtype)
    before = logits.clone()
    got = shard_ce.shard_grad_(logits, labels, lse, **kwargs)
    assert got.data_ptr() == logits.data_ptr() and not torch.equal(got, before)
    assert relative_error(got.float(), want_grad.float()) < grad_tol
    # The label entries (p - 1, about -1) dominate the norm: the softmax part on its own too.
    picked = labels - start
    rows = torch.nonzero((picked >= 0) & (picked < width))[:, 0]
    got, want_grad = got.float(), want_grad.float()
    got[rows, picked[rows]] = want_grad[rows, picked[rows]] = 0
    assert relative_error(got, want_grad) < grad_tol
    assert (got[labels == -100] == 0).all()


def test_no_rows_and_a_graph_replay():
    empty = torch.empty(0, 512, device="cuda", dtype=torch.bfloat16)
    no_labels = torch.empty(0, dtype=torch.long, device="cuda")
    assert shard_ce.shard_stats(empty, no_labels, vocab_start=0).shape == (3, 0)
    shard_ce.shard_grad_(empty, no_labels, torch.empty(0, device="cuda"), vocab_start=0,
                         vocab_total=512)
    logits, labels, _ = inputs(torch.bfloat16, 16, 4096, 4096, 8192, 3)
    static = logits.clone()
    lse = torch.full((16,), 12.0, device="cuda")
    shard_ce.shard_stats(static, labels, vocab_start=4096)  # loads the kernels outside capture
    shard_ce.shard_grad_(static.clone(), labels, lse, vocab_start=4096, vocab_total=8192)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        stats = shard_ce.shard_stats(static, labels, vocab_start=4096)
        shard_ce.shard_grad_(static, labels, lse, vocab_start=4096, vocab_total=8192)
    for _ in range(2):
        static.copy_(logits)
        graph.replay()
    torch.cuda.synchronize()
    assert relative_error(stats, shard_ce._torch_stats(logits, labels, 4096, -100, None)) < 2e-5
    want = shard_ce._torch_grad(logits, labels, lse, 4096, 8192, -100, 0.0, None, None)
    assert relative_error(static.float(), want) < GRAD_TOL[torch.bfloat16]
