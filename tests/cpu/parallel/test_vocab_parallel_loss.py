"""cutlass_ops.parallel.vocab_parallel_loss on gloo ranks (CPU): the loss, hidden's gradient and each rank's
weight-shard gradient against ``F.cross_entropy`` on the unsharded head (float64 math; for bf16
on the same bf16 values), at world size 2 (equal shards) and 3 (uneven shards in a permuted
order, and a Shard(0) DTensor head); world size 1 against ``linear_cross_entropy``; the
collectives counted; the refusals, raised on every rank alike.
"""

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from gloo_ranks import on_ranks  # noqa: E402

from custom_kernels.core.errors import UnsupportedInputError  # noqa: E402

ROWS, H = (2, 7), 16
GRAD_SCALE = 0.7  # the incoming gradient of a scalar loss: the backward must scale by it
TOLERANCE = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (1e-2, 2e-2)}  # loss, gradients


def problem(vocab, extents, dtype, seed=0):
    """hidden, the full head, labels (every fifth row ignored, a label at the first and the last
    column of every shard) and the per-row incoming gradient of ``none``."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(*ROWS, H, generator=g).to(dtype)
    weight = (torch.randn(vocab, H, generator=g) * 2 / H ** 0.5).to(dtype)
    labels = torch.randint(0, vocab, ROWS, generator=g).view(-1)
    labels[::5] = -100
    picks = [c for start, size in extents for c in (start, start + size - 1)]
    slots = [i for i in range(labels.numel()) if i % 5][:len(picks)]
    labels[slots] = torch.tensor(picks)
    row_grad = torch.rand(ROWS, generator=g) + 0.5
    return hidden, weight, labels.view(ROWS), row_grad


def case_kwargs(case):
    keys = ("reduction", "num_items_in_batch", "chunk_rows", "label_smoothing", "logit_softcap")
    return {k: case[k] for k in keys if case.get(k) is not None}


def backward(loss, row_grad):
    (loss * row_grad).sum().backward() if loss.dim() else (loss * GRAD_SCALE).backward()


# ---------------------------------------------------------------------------------------------
# Workers (module level: they are pickled)
# ---------------------------------------------------------------------------------------------

def _sharded(rank, world, cases):
    """Each case on this rank: its shard of the head (a DTensor with ``dtensor``), the loss and
    the gradients of hidden and of the shard."""
    from cutlass_ops.parallel.vocab_parallel_loss import vocab_parallel_linear_cross_entropy

    out = []
    for case in cases:
        start, size = case["extents"][rank]
        hidden, weight, labels, row_grad = problem(case["vocab"], case["extents"], case["dtype"])
        hidden.requires_grad_()
        shard = weight[start:start + size].clone().requires_grad_()
        head, kw = shard, case_kwargs(case)
        if case.get("dtensor"):
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.tensor import DTensor, Shard

            mesh = init_device_mesh("cpu", (world,))
            head = DTensor.from_local(shard, mesh, [Shard(0)], shape=weight.shape,
                                      stride=weight.stride())
        elif case.get("explicit_start"):
            kw["vocab_start"] = start
        loss = vocab_parallel_linear_cross_entropy(hidden, head, labels, **kw)
        backward(loss, row_grad)
        out.append({"loss": loss.detach(), "grad_hidden": hidden.grad,
                    "grad_shard": shard.grad})
    return out


def _single(rank, world, cases):
    """World size 1: ours and linear_cross_entropy on the same inputs."""
    from cutlass_ops.fused_cross_entropy import linear_cross_entropy
    from cutlass_ops.parallel.vocab_parallel_loss import vocab_parallel_linear_cross_entropy

    out = []
    for case in cases:
        results = []
        for fn in (vocab_parallel_linear_cross_entropy, linear_cross_entropy):
            hidden, weight, labels, row_grad = problem(case["vocab"], [(0, case["vocab"])],
                                                       case["dtype"])
            hidden.requires_grad_()
            weight.requires_grad_()
            loss = fn(hidden, weight, labels, **case_kwargs(case))
            backward(loss, row_grad)
            results.append((loss.detach(), hidden.grad, weight.grad))
        out.append(results)
    return out


COLLECTIVES = ("all_gather_single", "all_gather_into_tensor", "all_gather", "all_reduce",
               "broadcast", "reduce_scatter_tensor", "reduce_scatter", "all_to_all_single",
               "all_to_all", "all_gather_object", "broadcast_object_list", "barrier", "reduce",
               "gather", "scatter", "send", "recv")


def _counted(rank, world, cases):
    """Every torch.distributed collective the loss calls, forward and backward apart, as
    (name, shape of its first tensor); and CommDebugMode's count of the c10d ops beneath."""
    import torch.distributed as dist
    from torch.distributed.tensor.debug import CommDebugMode

    from cutlass_ops.parallel.vocab_parallel_loss import vocab_parallel_linear_cross_entropy

    calls = []

    def counting(name, fn):
        def wrapper(*args, **kwargs):
            calls.append((name, tuple(args[0].shape) if torch.is_tensor(args[0]) else None))
            return fn(*args, **kwargs)
        return wrapper

    saved = {n: getattr(dist, n) for n in COLLECTIVES if hasattr(dist, n)}
    out = []
    try:
        for name, fn in saved.items():
            setattr(dist, name, counting(name, fn))
        for case in cases:
            hidden, weight, labels, row_grad = problem(case["vocab"], case["extents"],
                                                       torch.float32)
            hidden.requires_grad_(case["hidden_grad"])
            start, size = case["extents"][rank]
            shard = weight[start:start + size].clone().requires_grad_()
            kw = case_kwargs(case)
            if isinstance(kw.get("chunk_rows"), list):  # one a rank
                kw["chunk_rows"] = kw["chunk_rows"][rank]
            calls.clear()
            with CommDebugMode() as fwd_mode:
                loss = vocab_parallel_linear_cross_entropy(hidden, shard, labels, **kw)
            forward = list(calls)
            calls.clear()
            with CommDebugMode() as bwd_mode:
                backward(loss, row_grad)
            out.append({"forward": forward, "backward": list(calls),
                        "debug": (fwd_mode.get_total_counts(), bwd_mode.get_total_counts())})
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)
    return out


def _refusals(rank, world):
    """Each bad call's error message on this rank (None: it did not raise)."""
    import torch.distributed as dist

    from cutlass_ops.parallel.vocab_parallel_loss import vocab_parallel_linear_cross_entropy as loss_fn

    hidden, weight, labels, _ = problem(20, [(0, 10), (10, 10)], torch.float32)
    shard = weight[10 * rank:10 * rank + 10]
    out_of_range = labels.clone()
    out_of_range[0, 1] = 20
    negative = labels.clone()
    negative[1, 2] = -1
    differing = labels.clone()
    differing[0, 1] = rank
    alone = dist.new_group([0])  # every rank must call new_group; rank 1 is not a member
    calls = {
        "hidden size": lambda: loss_fn(hidden[..., :8], shard, labels),
        "labels shape": lambda: loss_fn(hidden, shard, labels[:, :3]),
        "one rank's shard": lambda: loss_fn(hidden, shard[:, :8] if rank else shard, labels),
        "label >= V": lambda: loss_fn(hidden, shard, out_of_range),
        "negative label": lambda: loss_fn(hidden, shard, negative),
        "overlapping shards": lambda: loss_fn(hidden, shard, labels, vocab_start=5 * rank),
        "a gap": lambda: loss_fn(hidden, shard, labels, vocab_start=12 * rank),
        "labels differ": lambda: loss_fn(hidden, shard, differing),
        "rows differ": lambda: loss_fn(hidden[:, :6 + rank], shard, labels[:, :6 + rank]),
        "dtypes": lambda: loss_fn(hidden, shard.double(), labels),
        "reduction": lambda: loss_fn(hidden, shard, labels, reduction="max"),
        "num_items with sum": lambda: loss_fn(hidden, shard, labels, reduction="sum",
                                              num_items_in_batch=3),
        "not a member": lambda: loss_fn(hidden, shard, labels, group=alone) if rank else None,
    }
    messages = {}
    for name, call in calls.items():
        try:
            call()
            messages[name] = None
        except UnsupportedInputError as e:
            messages[name] = str(e)
    # After all of them the ranks still agree: a good call works.
    messages["afterwards"] = float(loss_fn(hidden, shard, labels))
    return messages


# ---------------------------------------------------------------------------------------------
# References and tests
# ---------------------------------------------------------------------------------------------

def reference(case):
    """Loss, grad of hidden and grad of the full head by autograd on F.cross_entropy over the
    full logits in float64 (from the inputs' own values)."""
    hidden, weight, labels, row_grad = problem(case["vocab"], case["extents"], case["dtype"])
    hidden = hidden.double().requires_grad_()
    weight = weight.double().requires_grad_()
    logits = hidden @ weight.T
    if case.get("logit_softcap"):
        logits = case["logit_softcap"] * torch.tanh(logits / case["logit_softcap"])
    reduction = case["reduction"]
    loss = F.cross_entropy(logits.view(-1, case["vocab"]), labels.view(-1),
                           reduction="sum" if case.get("num_items_in_batch") else reduction,
                           label_smoothing=case.get("label_smoothing") or 0.0)
    if case.get("num_items_in_batch"):
        loss = loss / case["num_items_in_batch"]
    if reduction == "none":
        loss = loss.view(ROWS)
    backward(loss, row_grad)
    return loss.detach(), hidden.grad, weight.grad


def relative_error(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def check_against_reference(cases, results):
    for i, case in enumerate(cases):
        loss, grad_hidden, grad_weight = reference(case)
        loss_tol, grad_tol = TOLERANCE[case["dtype"]]
        per_rank = [r[i] for r in results]
        for r in per_rank:  # the same everywhere, bit for bit
            assert torch.equal(r["loss"], per_rank[0]["loss"]), case
            assert torch.equal(r["grad_hidden"], per_rank[0]["grad_hidden"]), case
        ours = per_rank[0]
        assert ours["grad_hidden"].dtype == case["dtype"], case
        assert relative_error(ours["loss"], loss) <= loss_tol, (case, ours["loss"], loss)
        assert relative_error(ours["grad_hidden"], grad_hidden) <= grad_tol, case
        for rank, (start, size) in enumerate(case["extents"]):
            shard_grad = per_rank[rank]["grad_shard"]
            assert shard_grad.dtype == case["dtype"] and shard_grad.shape == (size, H), case
            assert relative_error(shard_grad, grad_weight[start:start + size]) <= grad_tol, \
                (case, rank)


def sweep(vocab, extents, **extra):
    """mean / sum / none / num_items_in_batch, whole and chunked, float32 and bf16, and label
    smoothing with a softcap."""
    cases = []
    for dtype in (torch.float32, torch.bfloat16):
        for reduction, num_items in (("mean", None), ("sum", None), ("none", None),
                                     ("mean", 9)):
            for chunk in (None, 4):
                cases.append(dict(vocab=vocab, extents=extents, dtype=dtype, chunk_rows=chunk,
                                  reduction=reduction, num_items_in_batch=num_items, **extra))
        for reduction in ("mean", "none"):
            cases.append(dict(vocab=vocab, extents=extents, dtype=dtype, chunk_rows=3,
                              reduction=reduction, label_smoothing=0.1, logit_softcap=5.0,
                              **extra))
    return cases


def test_two_equal_shards_match_the_full_head(tmp_path):
    cases = sweep(64, [(0, 32), (32, 32)])
    check_against_reference(cases, on_ranks(tmp_path, _sharded, cases, world=2))


def test_three_uneven_shards_in_any_order_and_a_dtensor_head(tmp_path):
    """Rank 0 holds the last rows: vocab_start need not follow the ranks. The DTensor head is
    split as torch's Shard(0) splits 70 rows over 3 ranks: 24, 24, 22."""
    cases = sweep(70, [(40, 30), (0, 25), (25, 15)], explicit_start=True)
    cases += [dict(c, extents=[(0, 24), (24, 24), (48, 22)], explicit_start=False,
                   dtensor=True) for c in sweep(70, None)[::3]]
    check_against_reference(cases, on_ranks(tmp_path, _sharded, cases, world=3))


def test_world_size_one_equals_linear_cross_entropy(tmp_path):
    cases = sweep(50, None)
    for i, pair in enumerate(on_ranks(tmp_path, _single, cases, world=1)[0]):
        # The same float32 math in another order: bf16 gradients may differ by a rounding.
        tol = 1e-6 if cases[i]["dtype"] == torch.float32 else 1e-3
        for ours, theirs in zip(*pair):
            assert ours.dtype == theirs.dtype and ours.shape == theirs.shape, cases[i]
            assert relative_error(ours, theirs) <= tol, cases[i]


def test_one_gather_a_chunk_and_one_all_reduce_for_hidden(tmp_path):
    """14 rows in chunks of 4: the setup gather, then 4 gathers of [2 (3 with smoothing), rows]
    from each rank;
    the backward's one all-reduce of [14, H], none for a frozen hidden, none for the weight.
    Ranks asking for different chunks use the smallest (else their gathers would not match)."""
    base = dict(vocab=64, extents=[(0, 32), (32, 32)], chunk_rows=4, hidden_grad=True)
    cases = [dict(base, reduction="mean"), dict(base, reduction="none"),
             dict(base, reduction="sum", label_smoothing=0.1),
             dict(base, reduction="mean", hidden_grad=False),
             dict(base, reduction="mean", chunk_rows=None),
             dict(base, reduction="mean", chunk_rows=[4, 7])]  # the ranks agree on the smaller
    for rank_result in on_ranks(tmp_path, _counted, cases, world=2):
        for case, result in zip(cases, rank_result):
            stats = 3 if case.get("label_smoothing") else 2
            chunks = [4, 4, 4, 2] if case["chunk_rows"] else [14]
            setup = ("all_gather_single", (2 * 9,))
            assert result["forward"] == [setup] + [
                ("all_gather_single", (2 * stats, r)) for r in chunks], (case, result)
            assert result["backward"] == [("all_reduce", (14, H))] * case["hidden_grad"], \
                (case, result)
            fwd, bwd = result["debug"]  # the c10d ops beneath, counted by torch
            assert (fwd, bwd) == (1 + len(chunks), int(case["hidden_grad"])), (case, result)


def test_refusals_are_raised_on_every_rank(tmp_path):
    results = on_ranks(tmp_path, _refusals, world=2)
    expected = {
        "hidden size": "hidden's last dimension", "labels shape": "hidden's leading shape",
        "label >= V": "label 20 is outside [0, 20)",
        "negative label": "label -1 is outside", "overlapping shards": "do not tile",
        "a gap": "do not tile", "labels differ": "labels differ between ranks",
        "rows differ": "rows differ between ranks", "dtypes": "one floating dtype",
        "reduction": "reduction must be one of", "num_items with sum": "num_items_in_batch",
    }
    for rank, messages in enumerate(results):
        for name, fragment in expected.items():
            assert messages[name] is not None and fragment in messages[name], \
                (rank, name, messages[name])
        assert isinstance(messages["afterwards"], float)
    assert "not a member" in results[1]["not a member"]
    # Rank 1 alone passed a bad shard: it raises its reason, rank 0 names it (neither hangs).
    assert "hidden's last dimension" in results[1]["one rank's shard"]
    assert "rank(s) [1] refused" in results[0]["one rank's shard"]


def test_refuses_without_an_initialized_group(monkeypatch):
    import torch.distributed as dist

    from cutlass_ops.parallel.vocab_parallel_loss import vocab_parallel_linear_cross_entropy

    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    hidden, weight, labels, _ = problem(8, [(0, 8)], torch.float32)
    with pytest.raises(UnsupportedInputError, match="not initialized"):
        vocab_parallel_linear_cross_entropy(hidden, weight, labels)


def _captured_checks(rank, world):
    """What a call captured in a CUDA graph relies on, without a GPU: the plan an eager call
    remembered, the refusal without one, and the device-side label check's verdicts."""
    from cutlass_ops.parallel import vocab_parallel_loss as vpl

    hidden = torch.randn(6, 8)
    weight = torch.randn(5, 8)
    labels = torch.tensor([0, 3, 9, 1, -100, 7])
    vpl.vocab_parallel_linear_cross_entropy(hidden, weight, labels)
    key = vpl._plan_key(hidden, weight, labels, rank * 5, vpl.INT64_MAX, None, None, -100, 0.0,
                        None)
    keys = [k for k in vpl._AGREED if k[2:5] == (tuple(weight.shape), rank * 5, 6)]
    plan = vpl._AGREED[keys[0]]
    try:
        vpl._captured_plan(key[:-1] + ("another softcap",))
        unknown = None
    except RuntimeError as error:
        unknown = str(error)
    mine = labels.clone()
    if rank == 1:
        mine[0] = 2  # the ranks' labels differ
    return {"vocab": plan.vocab, "unknown": unknown,
            "same": float(vpl._poison(labels, plan)),
            "differ": float(vpl._poison(mine, plan)),
            "outside": float(vpl._poison(torch.tensor([0, 10, -100]), plan)),
            "ignored": float(vpl._poison(torch.tensor([-100, -100]), plan))}


def test_a_captured_call_reuses_the_eager_plan_and_checks_labels_on_the_device(tmp_path):
    import math

    for got in on_ranks(tmp_path, _captured_checks, world=2):
        assert got["vocab"] == 10
        assert "captured in a CUDA graph" in got["unknown"]
        assert got["same"] == 0.0 and got["ignored"] == 0.0
        assert math.isnan(got["differ"]) and math.isnan(got["outside"])
