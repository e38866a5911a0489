"""linear_cross_entropy against torch.nn.functional.cross_entropy on the full float32 logits: the
loss and every gradient, on the CPU (the chunked computation is the same code on a GPU; its
GEMMs go through cutlass_ops.matmul, which runs torch's on CPU tensors), and the argument checks."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

import cutlass_ops
from custom_kernels.core.errors import UnsupportedInputError
from custom_kernels.cross_entropy import chunk_reference


def reference(hidden, weight, labels, bias=None, softcap=None, **kw):
    logits = F.linear(hidden, weight, bias).float()
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    return F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.view(-1), **kw)


def inputs(rows=37, hidden=48, vocab=1000, dtype=torch.float32, bias=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(rows, hidden, generator=g).to(dtype).requires_grad_()
    w = (torch.randn(vocab, hidden, generator=g) / hidden ** 0.5).to(dtype).requires_grad_()
    b = torch.randn(vocab, generator=g).to(dtype).requires_grad_() if bias else None
    labels = torch.randint(0, vocab, (rows,), generator=g)
    labels[::5] = -100
    return h, w, b, labels


def grads(loss, tensors):
    return torch.autograd.grad(loss.sum() if loss.dim() else loss,
                               [t for t in tensors if t is not None])


def close(a, b, tol):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item() <= tol


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.parametrize("softcap", [None, 30.0])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_cross_entropy_on_the_full_logits(reduction, smoothing, softcap, bias):
    h, w, b, labels = inputs(bias=bias)
    ours = cutlass_ops.linear_cross_entropy(h, w, labels, bias=b, reduction=reduction,
                                            label_smoothing=smoothing, logit_softcap=softcap,
                                            chunk_rows=8)  # 37 rows: chunks of 8, the last of 5
    theirs = reference(h, w, labels, b, softcap, reduction=reduction,
                       label_smoothing=smoothing)
    assert ours.shape == theirs.shape and ours.dtype == torch.float32
    assert torch.allclose(ours, theirs, rtol=1e-5, atol=1e-5)
    if reduction == "none":  # a per-row incoming gradient, as a weighted loss would give
        weights = torch.rand(ours.shape, generator=torch.Generator().manual_seed(1))
        ours, theirs = ours * weights, theirs * weights
    for mine, ref in zip(grads(ours, (h, w, b)), grads(theirs, (h, w, b))):
        assert close(mine, ref, 1e-5)


@pytest.mark.parametrize("vocab", [32000, 1000, 257])
def test_bfloat16_within_its_tolerance(vocab):
    h, w, _, labels = inputs(rows=64, hidden=64, vocab=vocab, dtype=torch.bfloat16)
    ours = cutlass_ops.linear_cross_entropy(h, w, labels, chunk_rows=24)
    theirs = reference(h, w, labels)
    assert abs(ours.item() - theirs.item()) <= 1e-2 * abs(theirs.item())
    for mine, ref in zip(grads(ours, (h, w)), grads(theirs, (h, w))):
        assert mine.dtype == torch.bfloat16 and close(mine, ref, 2e-2)


def test_three_dimensional_hidden_and_num_items_in_batch():
    h, w, _, labels = inputs(rows=24)
    h3 = h.detach().view(2, 12, -1).requires_grad_()
    ours = cutlass_ops.linear_cross_entropy(h3, w, labels.view(2, 12), num_items_in_batch=7)
    theirs = reference(h3, w, labels.view(2, 12), reduction="sum") / 7
    assert torch.allclose(ours, theirs, rtol=1e-5)
    none = cutlass_ops.linear_cross_entropy(h3, w, labels.view(2, 12), reduction="none")
    assert none.shape == (2, 12) and (none.view(-1)[labels == -100] == 0).all()


def test_a_chunk_of_ignored_rows_and_all_rows_ignored():
    h, w, _, labels = inputs(rows=20)
    labels[:10] = -100  # the whole first chunk
    ours = cutlass_ops.linear_cross_entropy(h, w, labels, chunk_rows=10)
    assert torch.allclose(ours, reference(h, w, labels), rtol=1e-5)
    (gh,) = torch.autograd.grad(ours, [h])
    assert (gh[:10] == 0).all() and gh[10:].abs().sum() > 0
    labels[:] = -100  # F.cross_entropy's mean over no rows: NaN, its gradients zero
    ours = cutlass_ops.linear_cross_entropy(h, w, labels)
    assert torch.isnan(ours) and torch.isnan(reference(h, w, labels))
    grads = torch.autograd.grad(ours, [h, w])
    expected = torch.autograd.grad(reference(h, w, labels), [h, w])
    assert all(torch.equal(g, e) and not g.any() for g, e in zip(grads, expected))
    assert cutlass_ops.linear_cross_entropy(h, w, labels, reduction="sum").item() == 0


def test_float16_gradients_are_divided_after_the_products_not_flushed_to_zero():
    """Divided by the count in the forward, a float16 gradient of a softmax over a large
    vocabulary (1 / V per logit) over thousands of rows falls below float16's smallest
    subnormal; float16 divides after the GEMMs instead (bfloat16 keeps float32's range)."""
    from cutlass_ops import fused_cross_entropy

    rows, vocab = 2048, 65536
    h = torch.ones(rows, 8, dtype=torch.float16, requires_grad=True)
    assert not fused_cross_entropy.divides_in_forward(h)
    assert fused_cross_entropy.divides_in_forward(h.detach().bfloat16())
    w = torch.zeros(vocab, 8, dtype=torch.float16, requires_grad=True)  # a uniform softmax
    labels = torch.zeros(rows, dtype=torch.long)
    (gw,) = torch.autograd.grad(
        cutlass_ops.linear_cross_entropy(h, w, labels, chunk_rows=256), [w])
    # d loss / d w[v] = mean over rows of (1 / V - [v == 0]) * h: 1 / V off label 0.
    torch.testing.assert_close(gw[1:].float(), torch.full_like(gw[1:], 1 / vocab).float(),
                               rtol=2e-2, atol=0)
    torch.testing.assert_close(gw[0].float(), torch.full((8,), 1 / vocab - 1.0), rtol=2e-3,
                               atol=0)


def test_gradients_follow_an_incoming_gradient_other_than_one():
    """The chunked loss divides each row's gradient by the count in its forward; the backward
    still scales by the incoming gradient (a loss weighted, or summed with others)."""
    for reduction, num_items in (("mean", None), ("mean", 7), ("sum", None)):
        h, w, _, labels = inputs(dtype=torch.float32)
        kw = {} if num_items is None else {"num_items_in_batch": num_items}
        ours = cutlass_ops.linear_cross_entropy(h, w, labels, reduction=reduction, **kw)
        ref_kw = {"reduction": "sum"} if num_items is not None else {"reduction": reduction}
        theirs = reference(h, w, labels, **ref_kw) / (num_items or 1)
        got = torch.autograd.grad(2.5 * ours, [h, w])
        want = torch.autograd.grad(2.5 * theirs, [h, w])
        for g, e in zip(got, want):
            torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-7)


def test_custom_ignore_index_and_int32_labels():
    h, w, _, labels = inputs()
    labels = torch.where(labels == -100, torch.tensor(7), labels).int()
    labels[::3] = 7
    ours = cutlass_ops.linear_cross_entropy(h, w, labels, ignore_index=7)
    assert torch.allclose(ours, reference(h, w, labels.long(), ignore_index=7), rtol=1e-5)


def test_default_chunk_fits_the_budget():
    from cutlass_ops.fused_cross_entropy import CHUNK_BYTES_CAP, default_chunk_rows

    rows = default_chunk_rows(4096 * 8, 128256, torch.device("cpu"))
    assert rows % 128 == 0 and rows * 128256 * 4 <= CHUNK_BYTES_CAP
    assert default_chunk_rows(5, 128256, torch.device("cpu")) == 5


@pytest.mark.parametrize("change, words", [
    (dict(labels=torch.full((37,), 1000)), "outside [0, 1000)"),
    (dict(labels=torch.full((37,), -5)), "outside [0, 1000)"),
    (dict(labels=torch.zeros(36, dtype=torch.long)), "leading shape"),
    (dict(labels=torch.zeros(37)), "int64"),
    (dict(weight=torch.randn(1000, 47)), "weight must be (vocab, hidden)"),
    (dict(weight=torch.randn(1000, 48, dtype=torch.float64)), "one floating dtype"),
    (dict(bias=torch.randn(999)), "bias must be"),
    (dict(reduction="avg"), "reduction must be"),
    (dict(label_smoothing=1.5), "label_smoothing"),
    (dict(logit_softcap=0.0), "logit_softcap"),
    (dict(num_items_in_batch=0), "num_items_in_batch"),
    (dict(reduction="sum", num_items_in_batch=4), "num_items_in_batch"),
    (dict(chunk_rows=-1), "chunk_rows"),
])
def test_bad_input_is_refused_by_name(change, words):
    h, w, _, labels = inputs()
    args = dict(hidden=h, weight=w, labels=labels) | change
    with pytest.raises(UnsupportedInputError, match=words.replace("(", r"\(").replace(")", r"\)")
                       .replace("[", r"\[")):
        cutlass_ops.linear_cross_entropy(args.pop("hidden"), args.pop("weight"),
                                         args.pop("labels"), **args)


def test_compiles_with_fullgraph_and_matches_eager():
    h, w, _, labels = inputs()
    compiled = torch.compile(
        lambda h, w, labels: cutlass_ops.linear_cross_entropy(h, w, labels, chunk_rows=8),
        fullgraph=True, backend="aot_eager")
    ours = compiled(h, w, labels)
    theirs = reference(h, w, labels)
    assert torch.allclose(ours, theirs, rtol=1e-5)
    for mine, ref in zip(grads(ours, (h, w)), grads(theirs, (h, w))):
        assert close(mine, ref, 1e-5)


def test_peak_memory_holds_one_chunk_of_logits():
    """The logits of all rows never exist at once: a chunk of 8 rows of a 32000 vocabulary
    allocates about 1 MB of float32 logits where the full 256 rows would need 33 MB."""
    h, w, _, labels = inputs(rows=256, hidden=32, vocab=32000)
    seen = []
    original = torch.Tensor.float

    def spy(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        if out.dim() == 2 and out.shape[-1] == 32000:
            seen.append(out.shape[0])
        return out

    torch.Tensor.float = spy
    try:
        cutlass_ops.linear_cross_entropy(h, w, labels, chunk_rows=8).backward()
    finally:
        torch.Tensor.float = original
    assert seen and max(seen) == 8



@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 40), vocab=st.integers(2, 300), chunk=st.integers(1, 50),
       reduction=st.sampled_from(["mean", "sum", "none"]), smoothing=st.sampled_from([0.0, 0.2]),
       softcap=st.sampled_from([None, 5.0]), ignored=st.floats(0.0, 0.9),
       seed=st.integers(0, 2 ** 16))
def test_any_shape_and_chunking_matches_the_full_logits(rows, vocab, chunk, reduction, smoothing,
                                                        softcap, ignored, seed):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(rows, 16, generator=g, dtype=torch.float64).float().requires_grad_()
    w = torch.randn(vocab, 16, generator=g).requires_grad_()
    labels = torch.randint(0, vocab, (rows,), generator=g)
    labels[torch.rand(rows, generator=g) < ignored] = -100
    labels[0] = 0  # at least one label counts: F.cross_entropy's mean over none is NaN
    kw = dict(reduction=reduction, label_smoothing=smoothing)
    ours = cutlass_ops.linear_cross_entropy(h, w, labels, logit_softcap=softcap, chunk_rows=chunk,
                                            **kw)
    theirs = reference(h, w, labels, None, softcap, **kw)
    assert torch.allclose(ours, theirs, rtol=1e-4, atol=1e-5)
    weights = torch.rand(ours.shape, generator=g) if reduction == "none" else 1.0
    for mine, ref in zip(grads(ours * weights, (h, w)), grads(theirs * weights, (h, w))):
        assert torch.allclose(mine, ref, rtol=1e-4, atol=1e-5)


# ---- the fused chunk step (custom_kernels.cross_entropy) on the CPU: its custom op runs the torch
# step there; the GPU tests hold the kernel to the same reference ----------------------------------




def chunk_inputs(rows=19, vocab=300, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = (3 * torch.randn(rows, vocab, generator=g)).to(dtype)
    labels = torch.randint(0, vocab, (rows,), generator=g)
    labels[::4] = -100
    return logits, labels


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.parametrize("softcap", [None, 2.0])
@pytest.mark.parametrize("scaled", [False, True])
def test_chunk_op_on_the_cpu_matches_cross_entropy(smoothing, softcap, scaled):
    from custom_kernels.cross_entropy import chunk_loss_and_grad

    logits, labels = chunk_inputs()
    row_scale = torch.rand(logits.shape[0], generator=torch.Generator().manual_seed(3)) \
        if scaled else None
    loss_ref, grad_ref = chunk_reference(logits, labels, smoothing=smoothing, softcap=softcap,
                                         row_scale=row_scale)
    data = logits.data_ptr()
    losses = chunk_loss_and_grad(logits, labels, smoothing=smoothing, softcap=softcap,
                                 row_scale=row_scale)
    assert losses.dtype == torch.float32 and losses.shape == labels.shape
    assert torch.allclose(losses, loss_ref, rtol=1e-5, atol=1e-6)
    assert logits.data_ptr() == data and torch.allclose(logits, grad_ref, rtol=1e-5, atol=1e-7)
    assert (logits[labels == -100] == 0).all() and (losses[labels == -100] == 0).all()


def test_chunk_op_without_grad_leaves_the_logits_and_takes_any_ignore_index():
    from custom_kernels.cross_entropy import chunk_loss_and_grad

    logits, labels = chunk_inputs(dtype=torch.bfloat16)
    labels = torch.where(labels == -100, 5, labels)
    before = logits.clone()
    losses = chunk_loss_and_grad(logits, labels, ignore_index=5, write_grad=False)
    assert torch.equal(logits, before)
    assert torch.allclose(losses, chunk_reference(before, labels, ignore_index=5)[0], rtol=1e-5)


def test_chunk_op_bfloat16_gradient_is_written_in_place_in_bfloat16():
    from custom_kernels.cross_entropy import chunk_loss_and_grad

    logits, labels = chunk_inputs(dtype=torch.bfloat16)
    loss_ref, grad_ref = chunk_reference(logits, labels, smoothing=0.1)
    losses = chunk_loss_and_grad(logits, labels, smoothing=0.1)
    assert logits.dtype == torch.bfloat16 and torch.allclose(losses, loss_ref, rtol=1e-5)
    assert torch.equal(logits, grad_ref.to(torch.bfloat16))


def test_chunk_op_makes_rows_of_labels_out_of_range_nan():
    """The kernel's rule, which the torch step shares: no read out of bounds, no host check;
    the row's loss and gradient are NaN, an ignored row's 0, the others untouched."""
    from custom_kernels.cross_entropy import chunk_loss_and_grad

    logits, labels = chunk_inputs()
    labels[0] = -100
    expected = chunk_loss_and_grad(logits.clone(), labels.clone())
    labels[1], labels[2] = 300, -7
    losses = chunk_loss_and_grad(logits, labels)
    assert losses[0] == 0 and (logits[0] == 0).all()
    assert losses[1:3].isnan().all() and logits[1:3].isnan().all()
    assert torch.equal(losses[3:], expected[3:]) and not logits[3:].isnan().any()


def test_chunk_op_passes_opcheck():
    logits, labels = chunk_inputs(rows=6, vocab=40)
    row_scale = torch.rand(6)
    op = torch.ops.custom_kernels.cross_entropy_chunk.default
    torch.library.opcheck(op, (logits, labels, -100, 0.1, 3.0, row_scale, True))
    torch.library.opcheck(op, (logits.clone(), labels, -100, 0.0, None, None, False))


@pytest.mark.parametrize("change, words", [
    (dict(logits=torch.zeros(4, 10, dtype=torch.float64)), "float32, float16 or bfloat16"),
    (dict(logits=torch.zeros(4, 10).t()), "rows"),
    (dict(logits=torch.zeros(4, 10)[:, ::2]), "contiguous last dimension"),
    (dict(labels=torch.zeros(4, dtype=torch.int32)), "int64"),
    (dict(labels=torch.zeros(3, dtype=torch.long)), "int64 of shape"),
    (dict(row_scale=torch.ones(4, dtype=torch.float64)), "row_scale"),
    (dict(smoothing=-0.1), "smoothing"),
    (dict(softcap=0.0), "softcap"),
])
def test_chunk_op_refuses_bad_input_by_name(change, words):
    from custom_kernels.cross_entropy import chunk_loss_and_grad

    args = dict(logits=torch.zeros(4, 10), labels=torch.zeros(4, dtype=torch.long)) | change
    with pytest.raises(UnsupportedInputError, match=words):
        chunk_loss_and_grad(args.pop("logits"), args.pop("labels"), **args)


def test_bfloat16_grad_weight_accumulated_in_bfloat16_stays_close_to_float32():
    """grad_weight is accumulated over 16 chunks in bf16 (one rounding per chunk, no float32
    [V, H] buffer): within bf16 tolerance of the float32 gradient, and returned in bf16."""
    h, w, b, labels = inputs(rows=256, hidden=64, vocab=2000, dtype=torch.bfloat16, bias=True)
    ours = cutlass_ops.linear_cross_entropy(h, w, labels, bias=b, chunk_rows=16,
                                            label_smoothing=0.1, logit_softcap=20.0)
    hf, wf, bf = (t.detach().float().requires_grad_() for t in (h, w, b))
    theirs = reference(hf, wf, labels, bf, 20.0, label_smoothing=0.1)
    assert abs(ours.item() - theirs.item()) <= 1e-2 * abs(theirs.item())
    mine = grads(ours, (h, w, b))
    for got, ref in zip(mine, grads(theirs, (hf, wf, bf))):
        assert got.dtype == torch.bfloat16 and close(got, ref, 2e-2)


def test_weight_gradient_accumulates_in_place_in_its_dtype(monkeypatch):
    """The first chunk's GEMM creates grad_weight in the weight's dtype; every later chunk adds
    into that same tensor (addmm_): one [V, H] buffer, never a float32 one."""
    from cutlass_ops import fused_cross_entropy as ce

    seen = []
    original = ce._accumulate

    def spy(grad_weight, grad_t, hidden_chunk):
        out = original(grad_weight, grad_t, hidden_chunk)
        seen.append((grad_weight is None or out is grad_weight, out.dtype, out.data_ptr()))
        return out

    monkeypatch.setattr(ce, "_accumulate", spy)
    h, w, _, labels = inputs(rows=40, dtype=torch.bfloat16)
    cutlass_ops.linear_cross_entropy(h, w, labels, chunk_rows=8).backward()
    assert len(seen) == 5 and all(same and dtype == torch.bfloat16 for same, dtype, _ in seen)
    assert len({ptr for *_, ptr in seen}) == 1


def test_a_frozen_head_gets_no_weight_gradient(monkeypatch):
    from cutlass_ops import fused_cross_entropy as ce

    monkeypatch.setattr(ce, "_accumulate", lambda *a: pytest.fail("grad_weight computed"))
    h, w, _, labels = inputs()
    w = w.detach()
    ours = cutlass_ops.linear_cross_entropy(h, w, labels, chunk_rows=8)
    (mine,) = grads(ours, (h,))
    (ref,) = grads(reference(h, w, labels), (h,))
    assert close(mine, ref, 1e-5)


def test_default_chunk_budgets_the_model_dtype():
    from cutlass_ops.fused_cross_entropy import CHUNK_BYTES_CAP, default_chunk_rows

    cpu = torch.device("cpu")
    rows = default_chunk_rows(4096 * 8, 128256, cpu, torch.bfloat16)
    assert rows % 128 == 0 and rows * 128256 * 2 <= CHUNK_BYTES_CAP
    assert (rows, default_chunk_rows(4096 * 8, 128256, cpu)) == (4096, 2048)  # 1 GiB cap


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_compiled_graph_calls_the_chunk_op(reduction):
    """Under torch.compile the chunk step is the custom op (its CPU implementation here), with
    bias, smoothing and the soft-cap, forward and backward."""
    from torch._dynamo.testing import CompileCounterWithBackend

    h, w, b, labels = inputs(bias=True)
    counter = CompileCounterWithBackend("aot_eager")
    kw = dict(reduction=reduction, label_smoothing=0.1)
    fn = torch.compile(lambda h, w, b, labels: cutlass_ops.linear_cross_entropy(
        h, w, labels, bias=b, logit_softcap=5.0, chunk_rows=8, **kw), fullgraph=True,
        backend=counter)
    ours = fn(h, w, b, labels)
    theirs = reference(h, w, labels, b, 5.0, **kw)
    assert torch.allclose(ours, theirs, rtol=1e-5, atol=1e-6)
    weights = torch.rand(ours.shape) if reduction == "none" else 1.0
    for mine, ref in zip(grads(ours * weights, (h, w, b)), grads(theirs * weights, (h, w, b))):
        assert close(mine, ref, 1e-5)
    graph = counter.graphs[0]  # the autograd.Function's forward is a subgraph of it
    assert any("cross_entropy_chunk" in m.code for m in graph.modules()
               if isinstance(m, torch.fx.GraphModule))


def test_chunk_kernel_grid_keeps_the_rows_in_flight_within_l2():
    """The persistent grid (pure arithmetic): an H100's 132 SMs and 50 MB of L2."""
    from custom_kernels.cross_entropy import block_size, grid_size

    assert grid_size(4096, 128256 * 2, 2, 132, 50 << 20) == 132  # 256 KB rows: one per SM
    assert grid_size(4096, 128256 * 4, 2, 132, 50 << 20) == 132  # never under one per SM
    assert grid_size(4096, 32000 * 2, 4, 132, 50 << 20) == 4 * 132  # 4 x 132 x 64 KB in L2
    assert grid_size(4096, 32000 * 2, 3, 132, 50 << 20) == 3 * 132  # the occupancy bounds it
    assert grid_size(5, 32000 * 2, 4, 132, 50 << 20) == 5
    assert (block_size(128256, 2), block_size(32000, 2), block_size(1000, 2)) == (1024, 512, 256)
    assert block_size(50257, 2, vec=False) == 1024


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_scale_off_cuda_is_float32_math_rounded_once(dtype, monkeypatch):
    """The torch path of ``scale_`` (off CUDA, strided, compiled): in place, the float32 product
    rounded once, in bounded blocks."""
    from custom_kernels import cross_entropy as ce

    monkeypatch.setattr(ce, "SCALE_TORCH_BLOCK", 1000)  # several blocks
    t = torch.randn(300, 70).to(dtype)
    scale = torch.tensor(1 / 3000)
    expected = (t.float() * scale).to(dtype)
    assert ce.scale_(t, scale) is t
    assert torch.equal(t, expected)
    strided = torch.randn(40, 10).to(dtype)[:, ::3]
    expected = (strided.float() * scale).to(dtype)
    assert torch.equal(ce.scale_(strided, scale), expected)
