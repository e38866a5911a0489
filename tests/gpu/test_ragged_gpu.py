"""custom_kernels.segment_sum / segment_mean on an sm90 GPU against a float64 reference and
torch.segment_reduce: skewed and uniform lengths, empty segments, long segments combined with
atomics, both offset dtypes, vector and scalar paths, strided rows, CUDA graph replays."""

import pytest
import torch

from custom_kernels import ragged
from custom_kernels.core.errors import UnsupportedInputError

pytestmark = pytest.mark.gpu

EPS = {torch.float32: 2 ** -23, torch.float16: 2 ** -10, torch.bfloat16: 2 ** -7}


def offsets_of(lengths, dtype=torch.int64):
    bounds = [0]
    for n in lengths:
        bounds.append(bounds[-1] + n)
    return torch.tensor(bounds, dtype=dtype, device="cuda")


def skewed(segments, seed, longest=20000):
    gen = torch.Generator().manual_seed(seed)
    lengths = (torch.randn(segments, generator=gen) * 1.5 + 3.0).exp().long().clamp(max=longest)
    lengths[torch.randperm(segments, generator=gen)[:max(1, segments // 10)]] = 0  # empties
    lengths[segments // 2] = longest  # one very long segment
    return lengths.tolist()


def assert_matches(out, values, offsets, mean=False):
    ref = ragged.reference_segment_sum(values, offsets, mean)
    lengths = offsets.diff().clamp(min=0).double().view(-1, *[1] * (values.dim() - 1))
    # fp32 accumulation of L terms of magnitude ~1, then one rounding to the dtype
    accumulation = 2 ** -21 * (lengths + 1)
    if mean:
        accumulation = accumulation / lengths.clamp(min=1)
    bound = 4 * EPS[out.dtype] * ref.abs() + accumulation
    err = (out.double() - ref).abs()
    assert out.dtype == values.dtype and out.shape == ref.shape
    assert torch.isfinite(out).all()
    assert (err <= bound).all(), f"max error {float((err - bound).max())} above the bound"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("d", [1, 7, 64, 256, 1000, 4096])
@pytest.mark.parametrize("lengths", ["skewed", "uniform"])
def test_segment_sum(dtype, d, lengths):
    counts = skewed(300, seed=d) if lengths == "skewed" else [50] * 300
    offsets = offsets_of(counts)
    values = torch.randn(offsets[-1].item(), d, device="cuda").to(dtype)
    assert_matches(ragged.segment_sum(values, offsets), values, offsets)


@pytest.mark.parametrize("offset_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("mean", [False, True])
def test_offsets_and_mean(offset_dtype, mean):
    offsets = offsets_of(skewed(1000, seed=3), offset_dtype)
    values = torch.randn(offsets[-1].item(), 128, device="cuda", dtype=torch.bfloat16)
    out = ragged.segment_sum(values, offsets, mean=mean)
    assert_matches(out, values, offsets, mean)
    torch.testing.assert_close(
        out.float(), torch.segment_reduce(values.float(), "mean" if mean else "sum",
                                          offsets=offsets, axis=0).nan_to_num(0.0),
        rtol=2e-2, atol=2e-2 * (offsets.diff().max().item() ** 0.5))


def test_one_segment_and_all_long():
    for counts in ([300_000], [100_000] * 3, [1] * 5 + [200_000]):
        offsets = offsets_of(counts)
        values = torch.randn(offsets[-1].item(), 256, device="cuda", dtype=torch.bfloat16)
        assert_matches(ragged.segment_sum(values, offsets), values, offsets)


def test_empty_cases():
    values = torch.randn(10, 8, device="cuda")
    out = ragged.segment_sum(values, offsets_of([0, 0, 0]))  # rows outside every segment
    assert out.shape == (3, 8) and not out.any()
    out = ragged.segment_sum(values[:0], offsets_of([0, 0]))
    assert out.shape == (2, 8) and not out.any()
    assert ragged.segment_sum(values, offsets_of([])).shape == (0, 8)
    poisoned = torch.full((4, 8), float("nan"), device="cuda")
    poisoned[1:3] = 1.0
    out = ragged.segment_sum(poisoned[1:3], offsets_of([0, 2, 0]))
    assert torch.equal(out, torch.tensor([[0.0] * 8, [2.0] * 8, [0.0] * 8], device="cuda"))


def test_strided_rows_and_trailing_dims():
    offsets = offsets_of(skewed(200, seed=5))
    rows = offsets[-1].item()
    for pad in (8, 1):  # 16-byte aligned rows (vector path) and odd strides (scalar path)
        wide = torch.randn(rows, 256 + pad, device="cuda", dtype=torch.bfloat16)
        values = wide[:, :256]
        assert_matches(ragged.segment_sum(values, offsets), values, offsets)
    cube = torch.randn(rows, 4, 8, device="cuda")
    out = ragged.segment_sum(cube, offsets)
    assert out.shape == (200, 4, 8)
    assert_matches(out, cube, offsets)


def test_offsets_not_from_zero_and_out_of_range_are_clamped():
    values = torch.randn(100, 16, device="cuda")
    offsets = torch.tensor([10, 20, 20, 60, 250], device="cuda")
    out = ragged.segment_sum(values, offsets)
    torch.testing.assert_close(out[0], values[10:20].sum(0))
    torch.testing.assert_close(out[3], values[60:100].sum(0))


def test_repeated_calls_and_growing_shapes():
    for segments in (10, 5000, 50, 20000):
        offsets = offsets_of(skewed(segments, seed=segments, longest=5000))
        values = torch.randn(offsets[-1].item(), 96, device="cuda", dtype=torch.float16)
        for _ in range(2):  # the kernel leaves its accumulator and counters zeroed
            assert_matches(ragged.segment_sum(values, offsets), values, offsets)


def test_errors():
    values = torch.randn(4, 2, device="cuda")
    with pytest.raises(UnsupportedInputError, match="int32 or int64"):
        ragged.segment_sum(values, torch.tensor([0.0, 4.0], device="cuda"))
    with pytest.raises(UnsupportedInputError, match="offsets on"):
        ragged.segment_sum(values, torch.tensor([0, 4]))


def test_cuda_graph_replays():
    offsets = offsets_of(skewed(500, seed=9))
    values = torch.randn(offsets[-1].item(), 512, device="cuda", dtype=torch.bfloat16)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        ragged.segment_sum(values, offsets)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ragged.segment_sum(values, offsets)
    for _ in range(3):  # accumulator, counts and queue must be zero again after each replay
        values.copy_(torch.randn_like(values))
        graph.replay()
        torch.cuda.synchronize()
        assert_matches(out, values, offsets)
