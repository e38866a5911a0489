"""clip_grad_norm_ without a GPU: the task table, chunking, dtype promotion, which tensors are
gradients, the torch fallback (CPU tensors) against torch.nn.utils.clip_grad_norm_, a Python
mirror of the kernel's task walk, and (marker compile) nvcc --cubin of clip_grad.cu."""

import math
import random

import pytest
import torch

from custom_kernels import clip_grad as cg


def kernel_find(starts, n, e):
    """Table::find of clip_grad.cu: the last tensor whose range starts at or before e."""
    lo, hi = 0, n
    while hi - lo > 1:
        mid = (lo + hi) >> 1
        if starts[mid] <= e:
            lo = mid
        else:
            hi = mid
    return lo


def kernel_pieces(starts, n, total, chunk, t):
    """The (tensor, lo, hi) pieces task t visits, as the kernel's task() walks them."""
    a, b = t * chunk, min(t * chunk + chunk, total)
    i = kernel_find(starts, n, a)
    while i < n and starts[i] < b:
        lo, hi = max(starts[i], a) - starts[i], min(starts[i + 1], b) - starts[i]
        if hi > lo:
            yield i, lo, hi
        i += 1


@pytest.mark.parametrize("seed", range(5))
def test_tasks_cover_every_element_once(seed):
    rng = random.Random(seed)
    numels = [rng.choice([0, 0, 1, 7, 100, 2048, 5000, 70000]) for _ in range(rng.randint(1, 60))]
    values, total = cg.build_table([0] * len(numels), numels, [0] * len(numels))
    starts = values[:len(numels) + 1]
    if total == 0:
        return
    chunk = rng.choice([1, 3, 2048, 8192])
    seen = [bytearray(n) for n in numels]
    for t in range(-(-total // chunk)):
        for i, lo, hi in kernel_pieces(starts, len(numels), total, chunk, t):
            for k in range(lo, hi):
                assert not seen[i][k], (i, k)
                seen[i][k] = 1
    assert all(all(s) for s in seen)


def test_table_layout():
    values, total = cg.build_table([100, 200, 300], [5, 0, 7], [2, 0, 1])
    assert total == 12
    assert values == [0, 5, 5, 12, 100, 200, 300, 2, 0, 1]


@pytest.mark.parametrize("total", [0, 1, 5000, 41_000_000 // 4, 6_738_000_000])
def test_chunk_size(total):
    chunk = cg.chunk_size(total, 132)
    assert cg.MIN_CHUNK <= chunk <= cg.MAX_CHUNK and chunk % cg.ALIGN == 0
    if total > 1e9:  # Llama-7B: many tasks per block, within 2^32
        tasks = -(-total // chunk)
        assert tasks >= 132 * cg.ESTIMATED_BLOCKS_PER_SM * 8 and tasks < 2 ** 32


@pytest.mark.parametrize("dtypes, want", [
    ((torch.bfloat16,), torch.bfloat16), ((torch.float16,), torch.float16),
    ((torch.float32, torch.bfloat16), torch.float32), ((torch.bfloat16, torch.float16),
                                                       torch.float32)])
def test_result_dtype_is_torch_stack_promotion(dtypes, want):
    codes = [cg.DTYPE_CODES[d] for d in dtypes]
    assert cg.result_dtype(codes) == want
    norms = [torch.ones((), dtype=d) for d in dtypes]
    assert torch.stack(norms).dtype == want


def test_which_tensors_are_gradients():
    with_grad = torch.nn.Parameter(torch.ones(3))
    with_grad.grad = torch.full((3,), 2.0)
    no_grad = torch.nn.Parameter(torch.ones(3))
    frozen = torch.nn.Parameter(torch.ones(3), requires_grad=False)
    leaf = torch.ones(2, requires_grad=True)
    plain = torch.ones(4)
    grads = cg.gradients([with_grad, no_grad, frozen, leaf, plain])
    assert [g is x for g, x in zip(grads, [with_grad.grad, plain])] == [True, True]
    assert len(grads) == 2
    assert cg.gradients(plain)[0] is plain


def test_no_gradients_gives_zero_like_torch():
    assert torch.equal(cg.clip_grad_norm_([], 1.0), torch.nn.utils.clip_grad_norm_([], 1.0))


def _params(seed, sizes, dtype=torch.float32, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    params = []
    for n in sizes:
        p = torch.nn.Parameter(torch.empty(n, dtype=dtype))
        p.grad = torch.randn(n, generator=g).to(dtype) * scale
        params.append(p)
    return params


@pytest.mark.parametrize("norm_type", [2.0, 1.0, math.inf, 3.0])
@pytest.mark.parametrize("max_norm", [0.5, 1e6])
def test_cpu_falls_back_to_torch(norm_type, max_norm):
    # torch refuses the inf norm of an empty tensor (no identity); the GPU kernel takes it as 0
    sizes = [10, 300] if norm_type == math.inf else [10, 0, 300]
    ours, theirs = _params(0, sizes), _params(0, sizes)
    n1 = cg.clip_grad_norm_(ours, max_norm, norm_type)
    n2 = torch.nn.utils.clip_grad_norm_(theirs, max_norm, norm_type)
    torch.testing.assert_close(n1, n2)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a.grad, b.grad)


def test_cpu_fallback_error_if_nonfinite_leaves_grads():
    params = _params(1, [5, 5])
    params[1].grad[2] = math.inf
    before = [p.grad.clone() for p in params]
    with pytest.raises(RuntimeError, match="non-finite"):
        cg.clip_grad_norm_(params, 1.0, error_if_nonfinite=True)
    for p, b in zip(params, before):
        assert torch.equal(p.grad, b)


def test_reference_matches_torch_on_cpu():
    params = _params(2, [7, 1000, 3], dtype=torch.float64)
    grads = [p.grad.clone() for p in params]
    total, clipped = cg.reference_clip_grad_norm(grads, 1.0)
    want = torch.nn.utils.clip_grad_norm_(params, 1.0)
    torch.testing.assert_close(total, want)
    for c, p in zip(clipped, params):
        torch.testing.assert_close(c, p.grad)


@pytest.mark.compile
@pytest.mark.parametrize("norm_type", [2.0, 1.0, math.inf])
def test_clip_grad_cu_compiles(tmp_path, norm_type):
    from test_work_queue import nvcc_cubin

    cubin = nvcc_cubin(cg.SOURCE, cg._defines(cg.NORM_CODES[norm_type]), tmp_path / "c.cubin")
    for name in cg.KERNELS:
        assert name.encode() in cubin
