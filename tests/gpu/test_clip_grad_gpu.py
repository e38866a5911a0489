"""custom_kernels.clip_grad_norm_ on an sm90 GPU against torch.nn.utils.clip_grad_norm_ (the
foreach path) and a float64 reference: 1, 10, 1000 and 5000 tensors of mixed sizes and dtypes,
empty tensors, inf and NaN, norm types 2 and inf, error_if_nonfinite, CUDA graph replays, the
two-kernel fallback, no host sync."""

import math
import random

import pytest
import torch

from custom_kernels import clip_grad as cg

pytestmark = pytest.mark.gpu

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
RTOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
ATOL = {torch.float32: 1e-7, torch.float16: 1e-5, torch.bfloat16: 1e-5}


def sizes_for(count, rng):
    if count <= 10:
        pool = [0, 1, 7, 1000, 4099, 65543, 1 << 20, (1 << 22) + 5]
    elif count <= 1000:
        pool = [0, 1, 3, 17, 256, 1000, 4099, 30001]
    else:
        pool = [0, 1, 5, 64, 333, 1024, 2048]
    return [rng.choice(pool) for _ in range(count)]


def make_grads(count, mode, seed=0):
    """Random gradients (never zeros); mode: one dtype name, or "mixed"."""
    rng = random.Random(seed)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    grads = []
    for n in sizes_for(count, rng):
        dtype = rng.choice(DTYPES) if mode == "mixed" else getattr(torch, mode)
        # an odd element offset for some: addresses that are not 16-byte aligned
        base = torch.randn(n + 1, device="cuda", generator=gen).to(dtype)
        grads.append(base[1:] if rng.random() < 0.3 else base[:n].clone())
    return grads


def as_params(grads):
    params = []
    for g in grads:
        p = torch.nn.Parameter(torch.empty_like(g))
        p.grad = g.clone()
        params.append(p)
    return params


def largest(grads):
    return max(grads, key=torch.Tensor.numel)


def assert_grads_close(ours, want, equal_nan=False):
    for a, b in zip(ours, want):
        torch.testing.assert_close(a.float(), b.float(), rtol=RTOL[a.dtype], atol=ATOL[a.dtype],
                                   equal_nan=equal_nan)


def check(grads, max_norm_factor, norm_type, **kwargs):
    """Clip copies of ``grads`` with ours and with torch; compare both with float64."""
    ref_norm, _ = cg.reference_clip_grad_norm(grads, 1.0, norm_type)
    max_norm = max_norm_factor * float(ref_norm)
    ref_norm, ref_grads = cg.reference_clip_grad_norm(grads, max_norm, norm_type)
    ours = [g.clone() for g in grads]
    norm = cg.clip_grad_norm_(ours, max_norm, norm_type, **kwargs)
    dtypes = {g.dtype for g in grads}
    out_dtype = cg.result_dtype([cg.DTYPE_CODES[d] for d in dtypes])
    assert norm.dtype == out_dtype and norm.shape == () and norm.is_cuda
    rel = abs(float(norm) - float(ref_norm)) / max(float(ref_norm), 1e-30)
    assert rel <= (1e-5 if out_dtype == torch.float32 else RTOL[out_dtype]), rel
    assert_grads_close(ours, [r.to(g.dtype) for r, g in zip(ref_grads, grads)])
    # torch (foreach): its inf norm refuses empty tensors, which contribute nothing anyway
    keep = [i for i, g in enumerate(grads) if g.numel() or norm_type != math.inf]
    params = as_params([grads[i] for i in keep])
    want = torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type)
    assert want.dtype == norm.dtype
    # torch rounds each tensor's norm to the tensor's dtype: exact only when all are fp32
    rtol = 1e-5 if dtypes == {torch.float32} else 1e-2
    torch.testing.assert_close(norm.float(), want.float(), rtol=rtol, atol=0)
    for i, p in zip(keep, params):
        torch.testing.assert_close(ours[i].float(), p.grad.float(), atol=ATOL[p.dtype],
                                   rtol=max(rtol, RTOL[p.dtype]))
    return norm


@pytest.mark.parametrize("count", [1, 10, 1000, 5000])
@pytest.mark.parametrize("mode", ["float32", "mixed", "bfloat16"])
@pytest.mark.parametrize("norm_type", [2.0, math.inf])
def test_matches_torch(count, mode, norm_type):
    check(make_grads(count, mode, seed=count), 0.3, norm_type)


@pytest.mark.parametrize("norm_type", [2.0, 1.0, math.inf])
def test_no_clipping_leaves_grads_bitwise(norm_type):
    grads = make_grads(10, "mixed", seed=3)
    before = [g.clone() for g in grads]
    check(grads, 2.0, norm_type)
    ours = [g.clone() for g in grads]
    cg.clip_grad_norm_(ours, 1e30, norm_type)
    for a, b in zip(ours, before):
        assert torch.equal(a, b)


def test_norm_type_1():
    check(make_grads(1000, "mixed", seed=5), 0.3, 1.0)


@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
@pytest.mark.parametrize("norm_type", [2.0, math.inf])
def test_nonfinite_scales_like_torch(bad, norm_type):
    grads = make_grads(10, "float32", seed=7)
    largest(grads).view(-1)[1] = bad
    ours = [g.clone() for g in grads]
    norm = cg.clip_grad_norm_(ours, 1.0, norm_type)
    params = as_params([g for g in grads if g.numel() or norm_type != math.inf])
    want = torch.nn.utils.clip_grad_norm_(params, 1.0, norm_type)
    torch.testing.assert_close(norm, want, equal_nan=True)
    assert_grads_close([g for g in ours if g.numel() or norm_type != math.inf],
                       [p.grad for p in params], equal_nan=True)


@pytest.mark.parametrize("cooperative", [True, False])
def test_error_if_nonfinite(cooperative):
    grads = make_grads(10, "mixed", seed=8)
    largest(grads).view(-1)[0] = math.inf
    before = [g.clone() for g in grads]
    with pytest.raises(RuntimeError, match="non-finite"):
        cg.clip_grad_norm_(grads, 1.0, error_if_nonfinite=True, cooperative=cooperative)
    for a, b in zip(grads, before):
        assert torch.equal(a, b)  # raised before anything was scaled
    finite = make_grads(10, "mixed", seed=9)
    check(finite, 0.5, 2.0, error_if_nonfinite=True, cooperative=cooperative)


@pytest.mark.parametrize("count", [10, 1000])
def test_two_kernel_fallback(count):
    grads = make_grads(count, "mixed", seed=11)
    start = cg.launches.copy()
    check(grads, 0.3, 2.0, cooperative=False)
    check(grads, 0.3, math.inf, cooperative=False)
    assert cg.launches["clip_grad_partials"] - start["clip_grad_partials"] == 2
    assert cg.launches["clip_grad_fused"] == start["clip_grad_fused"]


def test_one_launch_and_no_host_sync():
    grads = make_grads(1000, "mixed", seed=12)
    cg.clip_grad_norm_(grads, 1.0)  # warm-up: compile, plan, counters
    start = cg.launches.copy()
    torch.cuda.set_sync_debug_mode("error")
    try:
        cg.clip_grad_norm_(grads, 1.0)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert sum((cg.launches - start).values()) == 1
    assert cg.launches["clip_grad_fused"] - start["clip_grad_fused"] == 1


def test_deterministic():
    grads = make_grads(1000, "float32", seed=13)
    norms = [cg.clip_grad_norm_([g.clone() for g in grads], 1.0) for _ in range(5)]
    assert all(torch.equal(n, norms[0]) for n in norms)


def test_parameters_and_single_tensor():
    grads = make_grads(10, "mixed", seed=14)
    params = as_params(grads)
    frozen = torch.nn.Parameter(torch.ones(3, device="cuda"), requires_grad=False)
    norm = cg.clip_grad_norm_([*params, frozen], 0.1)
    want = torch.nn.utils.clip_grad_norm_(as_params(grads), 0.1)
    torch.testing.assert_close(norm.float(), want.float(), rtol=1e-2, atol=0)
    assert torch.equal(frozen, torch.ones(3, device="cuda"))
    single = torch.randn(1000, device="cuda")
    ref, _ = cg.reference_clip_grad_norm([single], 0.1)
    torch.testing.assert_close(cg.clip_grad_norm_(single, 0.1).double(), ref, rtol=1e-5, atol=0)


def test_only_empty_tensors_and_fallbacks():
    empty = [torch.empty(0, device="cuda"), torch.empty(0, 3, device="cuda")]
    assert float(cg.clip_grad_norm_(empty, 1.0)) == 0.0
    strided = torch.randn(64, 128, device="cuda")[:, ::2]  # non-contiguous: torch fallback
    params = as_params([strided])
    want = torch.nn.utils.clip_grad_norm_(params, 0.1)
    norm = cg.clip_grad_norm_([strided], 0.1)
    torch.testing.assert_close(norm, want)
    torch.testing.assert_close(strided, params[0].grad)
    doubles = [torch.randn(10, device="cuda", dtype=torch.float64)]
    torch.testing.assert_close(cg.clip_grad_norm_(doubles, 1e9), torch.linalg.norm(doubles[0]))


def test_gradients_on_a_gpu_and_off_it_raise():
    from custom_kernels.core.errors import UnsupportedInputError

    for grads in ([torch.randn(10, device="cuda"), torch.randn(10)],
                  [torch.randn(10), torch.randn(10, device="cuda")]):
        before = [g.clone() for g in grads]
        with pytest.raises(UnsupportedInputError, match="cpu, cuda:0"):
            cg.clip_grad_norm_(grads, 1e-3)
        assert all(torch.equal(g, b) for g, b in zip(grads, before))  # nothing was scaled


@pytest.mark.parametrize("cooperative", [True, False])
def test_cuda_graph_replays(cooperative):
    grads = make_grads(1000, "mixed", seed=15)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up, as torch's graph recipe does
        cg.clip_grad_norm_(grads, 0.5, cooperative=cooperative)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        norm = cg.clip_grad_norm_(grads, 0.5, cooperative=cooperative)
    gen = torch.Generator(device="cuda").manual_seed(100)
    for _ in range(3):  # the queue counters must be zero again after each replay
        fresh = [torch.randn(g.shape, device="cuda", generator=gen).to(g.dtype) for g in grads]
        for g, f in zip(grads, fresh):
            g.copy_(f)
        graph.replay()
        ref_norm, ref_grads = cg.reference_clip_grad_norm(fresh, 0.5)
        torch.testing.assert_close(norm.double(), ref_norm, rtol=1e-5, atol=0)
        assert_grads_close(grads, [r.to(f.dtype) for r, f in zip(ref_grads, fresh)])
    check(make_grads(1000, "mixed", seed=16), 0.3, 2.0)  # eager still fine afterwards


@pytest.mark.parametrize("norm_type", [2.0, 1.0, float("inf")])
def test_total_norm_scales_nothing_and_keeps_float32(norm_type):
    """The distributed clip's local step: our kernels' total in float32, the gradients as
    they were."""
    from custom_kernels.clip_grad import reference_clip_grad_norm, total_norm

    grads = [torch.randn(n, device="cuda").to(dtype) for n, dtype in
             ((5000, torch.bfloat16), (123, torch.float32), (0, torch.float16),
              (70000, torch.float16))]
    before = [g.clone() for g in grads]
    norm = total_norm(grads, norm_type, out_dtype=torch.float32)
    assert norm.dtype == torch.float32
    assert all(torch.equal(a, b) for a, b in zip(grads, before))
    expected, _ = reference_clip_grad_norm(grads, 1.0, norm_type)
    torch.testing.assert_close(norm.double(), expected, rtol=1e-5, atol=1e-6)


def test_distributed_clip_on_one_gpu_with_nccl_matches_torch(tmp_path):
    """World size 1 with NCCL: the local kernels, the all-reduce and the scaling agree with
    torch.nn.utils.clip_grad_norm_."""
    import os

    import torch.distributed as dist

    from custom_kernels.parallel import clip_grad_distributed

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("nccl", rank=0, world_size=1,
                            init_method=f"file://{tmp_path / 'store'}")
    try:
        params = [torch.nn.Parameter(torch.zeros(n, device="cuda")) for n in (3000, 17, 4096)]
        for p in params:
            p.grad = torch.randn_like(p) * 3
        ours = [p.grad.clone() for p in params]
        norm = clip_grad_distributed.clip_grad_norm_(ours, 1.0)
        expected = torch.nn.utils.clip_grad_norm_(params, 1.0)
        torch.testing.assert_close(norm, expected, rtol=1e-5, atol=1e-6)
        for got, p in zip(ours, params):
            torch.testing.assert_close(got, p.grad)
    finally:
        dist.destroy_process_group()
