"""linear_cross_entropy on the GPU against a float32 reference on the full logits: loss and every
gradient, with ignored tokens, an all-ignored chunk, label smoothing, soft-capping, vocabularies
that are not a multiple of a tile, rows that are not a multiple of the chunk; and a peak memory
that holds one chunk of logits, not all of them.

Then the fused chunk kernel itself (custom_kernels.cross_entropy.chunk_loss_and_grad) against
F.cross_entropy on the same logits upcast to float32, loss and in-place gradient by autograd:
vocabularies 32000 / 128256 / 151936 / 50257, the three dtypes, ignored rows and an all-ignored
chunk, smoothing, soft-cap, row_scale, the vector and scalar paths, strided and misaligned rows,
labels out of range, opcheck, CUDA graph capture."""

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


def test_a_label_out_of_range_makes_its_row_nan_without_a_host_sync():
    """On a GPU the labels are not read on the host (a sync every step): a label outside
    [0, V) that is not ignore_index makes its row's loss and gradient NaN, the other rows
    untouched; off a GPU the call refuses it (tests/cpu)."""
    h, w, labels = case(64, 64, 1000, torch.bfloat16)
    labels[3], labels[5] = 1000, -7
    h.requires_grad_(True)
    torch.cuda.set_sync_debug_mode("error")  # any host sync in the call raises
    try:
        losses = cutlass_ops.linear_cross_entropy(h, w, labels, reduction="none")
    finally:
        torch.cuda.set_sync_debug_mode("default")
    bad = torch.zeros(64, dtype=torch.bool, device="cuda")
    bad[[3, 5]] = True
    assert losses[bad].isnan().all() and not losses[~bad].isnan().any()
    good = labels.clone()
    good[bad] = -100
    expected = reference(h.detach().float(), w.float(), good, reduction="none")
    assert torch.allclose(losses[~bad], expected[~bad], rtol=2e-2, atol=2e-2)
    losses.nansum().backward()
    assert h.grad[bad].isnan().all() and not h.grad[~bad].isnan().any()
    assert cutlass_ops.linear_cross_entropy(h.detach(), w, labels).isnan()


# ---- the fused chunk kernel -------------------------------------------------------------------

from custom_kernels import cross_entropy as ce  # noqa: E402

# Gradient tolerance: one rounding to the dtype; fp32: ex2.approx and lse * log2e rounding.
GRAD_TOL = {torch.float32: 1e-5, torch.float16: 1.5e-3, torch.bfloat16: 6e-3}
DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def chunk_case(rows, vocab, dtype, seed=0, scale=4.0):
    g = torch.Generator("cuda").manual_seed(seed)
    logits = (scale * torch.randn(rows, vocab, device="cuda", generator=g)).to(dtype)
    labels = torch.randint(0, vocab, (rows,), device="cuda", generator=g)
    labels[::7] = -100
    return logits, labels


chunk_reference = ce.chunk_reference


def tolerances(dtype, softcap):
    """(loss, gradient) tolerances: fp16 / bf16 take tanh.approx (relative error 2^-11) under a
    soft-cap, against the exact tanh of the reference."""
    if softcap is None or dtype == torch.float32:
        return 2e-5, GRAD_TOL[dtype]
    return 2e-3, 1e-2


def subnormal_floor(dtype, width):
    """The error norm a row of ``width`` gradients gets from rounding into the dtype's
    subnormals alone (half their spacing each): float16 stores a row scaled far down (a small
    row_scale times the soft-cap's tanh') with no relative precision left."""
    info = torch.finfo(dtype)
    return width ** 0.5 * info.smallest_normal * info.eps / 2


def assert_step(logits, labels, losses, loss_ref, grad_ref, dtype, softcap=None):
    loss_tol, grad_tol = tolerances(dtype, softcap)
    assert losses.dtype == torch.float32 and losses.shape == labels.shape
    assert torch.allclose(losses, loss_ref, rtol=loss_tol, atol=loss_tol), \
        (losses - loss_ref).abs().max()
    assert logits.dtype == dtype
    assert relative_error(logits, grad_ref) < grad_tol, relative_error(logits, grad_ref)
    # Row by row too (the label entry, p - 1, dominates each row's norm), beyond what rounding
    # into subnormals costs a row whose gradients are that small.
    kept = labels != -100
    excess = ((logits.float() - grad_ref).norm(dim=1)[kept]
              - subnormal_floor(dtype, logits.shape[1]))
    worst = (excess / grad_ref.norm(dim=1)[kept].clamp_min(1e-30)).max().item()
    assert worst < 2 * grad_tol, worst


@pytest.mark.parametrize("vocab", [32000, 128256, 151936, 50257])
@pytest.mark.parametrize("dtype", DTYPES)
def test_kernel_loss_and_in_place_gradient(vocab, dtype):
    logits, labels = chunk_case(300, vocab, dtype)
    loss_ref, grad_ref = chunk_reference(logits, labels)
    ptr = logits.data_ptr()
    losses = ce.chunk_loss_and_grad(logits, labels)
    assert logits.data_ptr() == ptr
    assert_step(logits, labels, losses, loss_ref, grad_ref, dtype)
    ignored = labels == -100
    assert (losses[ignored] == 0).all() and (logits[ignored] == 0).all()


@pytest.mark.parametrize("vocab", [32000, 50257])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("smoothing, softcap, scaled", [
    (0.1, None, False), (0.0, 30.0, False), (0.1, 30.0, True), (0.0, None, True),
    (1.0, 5.0, False)])
def test_kernel_smoothing_softcap_and_row_scale(vocab, dtype, smoothing, softcap, scaled):
    logits, labels = chunk_case(97, vocab, dtype, seed=1, scale=softcap or 4.0)
    # Seeded: the scales (down to near zero) must not depend on which tests ran before.
    generator = torch.Generator("cuda").manual_seed(3)
    row_scale = torch.rand(97, device="cuda", generator=generator) * 3 if scaled else None
    loss_ref, grad_ref = chunk_reference(logits, labels, smoothing=smoothing, softcap=softcap,
                                         row_scale=row_scale)
    losses = ce.chunk_loss_and_grad(logits, labels, smoothing=smoothing, softcap=softcap,
                                    row_scale=row_scale)
    assert_step(logits, labels, losses, loss_ref, grad_ref, dtype, softcap)


def test_kernel_all_ignored_chunk_reads_nothing():
    """Ignored rows are written with zeros without being read: NaN logits there stay harmless."""
    logits = torch.full((64, 32000), float("nan"), device="cuda", dtype=torch.bfloat16)
    labels = torch.full((64,), -100, device="cuda")
    losses = ce.chunk_loss_and_grad(logits, labels, smoothing=0.1, softcap=30.0)
    assert (losses == 0).all() and (logits == 0).all()


def test_kernel_without_gradient_leaves_the_logits():
    logits, labels = chunk_case(50, 128256, torch.bfloat16)
    before = logits.clone()
    losses = ce.chunk_loss_and_grad(logits, labels, smoothing=0.1, write_grad=False)
    assert torch.equal(logits, before)
    assert torch.allclose(losses, chunk_reference(before, labels, smoothing=0.1)[0], rtol=2e-5,
                          atol=2e-5)


@pytest.mark.parametrize("vocab", [32000, 50257, 13])
@pytest.mark.parametrize("dtype", DTYPES)
def test_kernel_scalar_path_equals_the_vector_path(vocab, dtype):
    logits, labels = chunk_case(40, vocab, dtype, seed=2)
    loss_ref, grad_ref = chunk_reference(logits, labels, smoothing=0.1)
    results = []
    for vec in (True, False):
        work = logits.clone()
        losses = torch.empty(40, dtype=torch.float32, device="cuda")
        ce._launch(work, labels, None, losses, -100, 0.1, None, True, vec=vec)
        assert_step(work, labels, losses, loss_ref, grad_ref, dtype)
        results.append((losses, work))
    assert torch.allclose(results[0][0], results[1][0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("offset, width", [(0, 32000 + 8), (3, 32000 + 11), (1, 50257 + 2)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_kernel_strided_and_misaligned_rows_stay_in_bounds(offset, width, dtype):
    """Rows inside a wider buffer (any row stride, a base 1 to 7 elements past a 16-byte
    boundary): each row's head and tail take the scalar path; nothing outside is touched."""
    vocab = 50257 if width > 50257 else 32000
    buffer, labels = chunk_case(33, width + offset, dtype, seed=3)
    labels = torch.where(labels == -100, labels, labels % vocab)
    logits = buffer[:, offset:offset + vocab]
    outside = buffer.clone()
    loss_ref, grad_ref = chunk_reference(logits, labels, softcap=30.0)
    losses = ce.chunk_loss_and_grad(logits, labels, softcap=30.0)
    assert_step(logits, labels, losses, loss_ref, grad_ref, dtype, 30.0)
    mask = torch.ones_like(buffer, dtype=torch.bool)
    mask[:, offset:offset + vocab] = False
    assert torch.equal(buffer[mask], outside[mask])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_makes_rows_of_labels_out_of_range_nan(dtype):
    """Nothing read out of bounds, no host check: the row's loss and gradient are NaN, ignored
    rows 0, the other rows what they would be."""
    logits, labels = chunk_case(20, 32000, dtype)
    labels[0] = -100
    expected_logits = logits.clone()
    expected = ce.chunk_loss_and_grad(expected_logits, labels.clone())
    labels[1], labels[2], labels[3] = 32000, -5, 2 ** 40
    losses = ce.chunk_loss_and_grad(logits, labels)
    torch.cuda.synchronize()
    assert losses[0] == 0 and (logits[0] == 0).all()
    assert losses[1:4].isnan().all() and logits[1:4].isnan().all()
    assert torch.equal(losses[4:], expected[4:]) and torch.equal(logits[4:], expected_logits[4:])


def test_kernel_custom_ignore_index_and_many_rows_per_block():
    """More rows than the persistent grid: every block takes several rows."""
    logits, labels = chunk_case(2000, 32000, torch.bfloat16, seed=4)
    labels[labels == -100] = 17
    labels[100:300] = 17
    loss_ref, grad_ref = chunk_reference(logits, labels, ignore_index=17)
    losses = ce.chunk_loss_and_grad(logits, labels, ignore_index=17)
    assert_step(logits, labels, losses, loss_ref, grad_ref, torch.bfloat16)


def test_kernel_opcheck_and_cuda_graph():
    logits, labels = chunk_case(16, 1000, torch.bfloat16)
    row_scale = torch.rand(16, device="cuda")
    op = torch.ops.custom_kernels.cross_entropy_chunk.default
    torch.library.opcheck(op, (logits.clone(), labels, -100, 0.1, 30.0, row_scale, True))
    source, _ = chunk_case(16, 1000, torch.bfloat16)
    work = source.clone()
    ce.chunk_loss_and_grad(work, labels)  # compile and load before capturing
    graph = torch.cuda.CUDAGraph()
    work.copy_(source)
    with torch.cuda.graph(graph):
        losses = ce.chunk_loss_and_grad(work, labels)
    work.copy_(source)
    graph.replay()
    loss_ref, grad_ref = chunk_reference(source, labels)
    assert_step(work, labels, losses, loss_ref, grad_ref, torch.bfloat16)


# ---- linear_cross_entropy through the kernel ---------------------------------------------------

def test_float32_model_through_the_kernel_matches_float32():
    """float32 logits (the kernel's fp32 path, V = 50257: every row misaligned); a tuned
    CUTLASS GEMM runs float32 as tf32, hence the tolerance."""
    h, w, labels = case(700, 128, 50257, torch.float32)
    ours = cutlass_ops.linear_cross_entropy(h, w, labels, label_smoothing=0.1, chunk_rows=256)
    hf, wf = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    theirs = reference(hf, wf, labels, label_smoothing=0.1)
    assert abs(ours.item() - theirs.item()) <= 2e-3 * abs(theirs.item())
    ours.backward()
    theirs.backward()
    assert relative_error(h.grad, hf.grad) < 1e-2 and relative_error(w.grad, wf.grad) < 1e-2


def test_reduction_none_with_bias_through_the_kernel():
    h, w, labels = case(333, 128, 32000, torch.bfloat16)
    b = (torch.randn(32000, device="cuda") * 0.1).to(torch.bfloat16).requires_grad_()
    ours = cutlass_ops.linear_cross_entropy(h, w, labels, bias=b, reduction="none",
                                            logit_softcap=30.0, chunk_rows=100)
    hf, wf, bf = (t.detach().float().requires_grad_() for t in (h, w, b))
    logits = 30.0 * torch.tanh((hf @ wf.t() + bf) / 30.0)
    theirs = F.cross_entropy(logits, labels, reduction="none")
    assert relative_error(ours, theirs) < 1e-2
    weights = torch.rand(333, device="cuda")
    (ours * weights).sum().backward()
    (theirs * weights).sum().backward()
    for mine, ref in ((h.grad, hf.grad), (w.grad, wf.grad), (b.grad, bf.grad)):
        assert mine.dtype == torch.bfloat16 and relative_error(mine, ref) < 2e-2


def test_peak_memory_has_no_float32_chunk_nor_float32_weight_gradient():
    """Beyond the inputs: one bf16 chunk of logits (the kernel works in place), grad_weight in
    bf16 (accumulated in place) and grad_hidden; the final scaling is in place (no float32
    block); the float32 [V, H] accumulator and the float32 chunk copy are gone."""
    rows, hidden, vocab, chunk = 4096, 1024, 128256, 512
    h, w, labels = case(rows, hidden, vocab, torch.bfloat16)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    cutlass_ops.linear_cross_entropy(h, w, labels, chunk_rows=chunk).backward()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    expected = (chunk * vocab * 2 + vocab * hidden * 2 + rows * hidden * 2
                + vocab * hidden * 2)  # + the .grad the backward returns into
    assert extra < expected * 1.1 + (32 << 20), (extra, expected)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("offset, numel", [(0, 1 << 20), (1, 4099), (3, 7), (0, 0)])
def test_scale_kernel_is_float32_math_rounded_once(dtype, offset, numel):
    """One pass in place, against the float32 product rounded to the dtype: exact, for any
    start alignment and length (the head and tail elements taken one by one)."""
    base = torch.randn(offset + numel, device="cuda", dtype=dtype)
    t = base[offset:]
    scale = torch.tensor(1 / 3000, device="cuda")  # not a bf16 value: a bf16 scale would show
    expected = (t.float() * scale).to(dtype)
    before = base[:offset].clone()
    assert ce.scale_(t, scale) is t
    assert torch.equal(t, expected) and torch.equal(base[:offset], before)


def test_scale_kernel_replays_in_a_cuda_graph_and_strided_input_takes_torch():
    t = torch.randn(4096, 130, device="cuda", dtype=torch.bfloat16)
    scale = torch.tensor(0.5, device="cuda")
    graph = torch.cuda.CUDAGraph()
    ce.scale_(t.clone(), scale)  # load before the capture
    with torch.cuda.graph(graph):
        ce.scale_(t, scale)
    original = t.clone()
    scale.fill_(0.1)
    graph.replay()
    assert torch.equal(t, (original.float() * 0.1).to(torch.bfloat16))
    strided = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16)[:, ::2]
    expected = (strided.float() * scale).to(torch.bfloat16)
    assert torch.equal(ce.scale_(strided, scale), expected)
