"""Ragged segment reductions without a GPU: input validation, chunk sizing, the baselines against
the float64 reference on the CPU, a Python mirror of the kernel's warp-chunk walk (every row once,
crossing segments complete exactly once), and (marker compile) nvcc --cubin of ragged.cu."""

import random

import pytest
import torch

from custom_kernels import ragged
from custom_kernels.core.errors import UnsupportedInputError


def offsets_of(lengths, dtype=torch.int64):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=dtype)


def test_validation_messages():
    """The input rules hold on every device (CPU tensors here): what a GPU refuses is refused."""
    v = torch.ones(4, 2)
    with pytest.raises(UnsupportedInputError, match="int32 or int64"):
        ragged.segment_sum(v, torch.tensor([0.0, 4.0]))
    with pytest.raises(UnsupportedInputError, match="1-D"):
        ragged.segment_sum(v, torch.zeros(2, 2, dtype=torch.int64))
    with pytest.raises(UnsupportedInputError, match="1-D"):
        ragged.segment_sum(v, torch.zeros(0, dtype=torch.int64))
    with pytest.raises(UnsupportedInputError, match="float32, float16 or bfloat16"):
        ragged.segment_sum(torch.ones(4, 2, dtype=torch.int32), torch.tensor([0, 4]))
    with pytest.raises(UnsupportedInputError, match="offsets on meta"):
        ragged.segment_sum(v, torch.tensor([0, 4], device="meta"))


@pytest.mark.parametrize("seed", range(20))
def test_torch_fallback_matches_the_reference(seed):
    """Random segments, empty ones and offsets past either end (clamped) included."""
    gen = random.Random(seed)
    bounds = sorted(gen.randint(-2, 40) for _ in range(gen.randint(1, 9)))
    rows = gen.randint(0, 36)
    values = torch.randn(rows, *gen.choice([(), (3,), (2, 4)])).to(
        gen.choice([torch.float32, torch.bfloat16]))
    offsets = torch.tensor(bounds, dtype=gen.choice([torch.int32, torch.int64]))
    for mean in (False, True):
        got = ragged.torch_segment_sum(values, offsets, mean)
        want = ragged.reference_segment_sum(values, offsets, mean)
        assert got.dtype == values.dtype and got.shape == want.shape
        torch.testing.assert_close(got.double(), want, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("rows, tiles", [(1, 1), (1000, 2), (300_000, 2), (10 ** 8, 8)])
def test_chunk_rows(rows, tiles):
    r = ragged.chunk_rows(rows, tiles, grid=132 * 4)
    assert ragged.MIN_ROWS <= r <= ragged.MAX_ROWS and r % 4 == 0


def kernel_walk(bounds, rows, chunk, tiles):
    """Mirror of ragged.cu: for each warp chunk and tile, the pieces; returns (covered rows per
    segment and tile, direct writes, atomic arrivals per segment)."""
    S = len(bounds) - 1
    clamp = [min(max(b, 0), rows) for b in bounds]

    def find(r):
        lo, hi = 0, S
        while hi - lo > 1:
            mid = (lo + hi) >> 1
            if clamp[mid] <= r:
                lo = mid
            else:
                hi = mid
        return lo

    covered = {}
    direct, arrived = set(), {}
    for wc in range(-(-rows // chunk)):
        r0, r1 = wc * chunk, min(wc * chunk + chunk, rows)
        for ct in range(tiles):
            s = find(r0)
            while s < S:
                lo, hi = clamp[s], clamp[s + 1]
                if lo >= r1:
                    break
                pa, pb = max(lo, r0), min(hi, r1)
                if pb > pa:
                    covered.setdefault((s, ct), []).extend(range(pa, pb))
                    if lo >= r0 and hi <= r1:
                        direct.add((s, ct))
                    else:
                        expected = ((hi - 1) // chunk - lo // chunk + 1) * tiles
                        arrived.setdefault(s, [0, expected])[0] += 1
                s += 1
    return covered, direct, arrived


@pytest.mark.parametrize("seed", range(6))
def test_warp_chunks_cover_rows_and_complete_each_segment(seed):
    rng = random.Random(seed)
    lengths = [rng.choice([0, 0, 1, 2, 3, 5, 17, 64, 300]) for _ in range(rng.randint(1, 40))]
    if seed == 0:
        lengths = [1000] + lengths  # one long segment
    bounds = [0]
    for n in lengths:
        bounds.append(bounds[-1] + n)
    rows, chunk, tiles = bounds[-1], rng.choice([4, 8, 64]), rng.choice([1, 3])
    covered, direct, arrived = kernel_walk(bounds, rows, chunk, tiles)
    for s, n in enumerate(lengths):
        for ct in range(tiles):
            assert sorted(covered.get((s, ct), [])) == list(range(bounds[s], bounds[s] + n))
        if n:
            assert all((s, ct) in direct for ct in range(tiles)) or \
                arrived[s][0] == arrived[s][1], (s, n)  # the last arrival finalizes


def test_baselines_match_reference_on_cpu():
    torch.manual_seed(0)
    lengths = [3, 0, 10, 1, 0, 7]
    offsets = offsets_of(lengths)
    values = torch.randn(sum(lengths), 5)
    ref = ragged.reference_segment_sum(values, offsets)
    loop = ragged.segment_sum_loop(values, offsets.tolist())
    segment, position, longest = ragged.padding_index(offsets, values.shape[0])
    padded = ragged.segment_sum_padded(values, segment, position, longest, len(lengths))
    torch.testing.assert_close(loop.double(), ref)
    torch.testing.assert_close(padded.double(), ref)
    torch.testing.assert_close(
        torch.segment_reduce(values, "sum", offsets=offsets, axis=0).double(), ref)
    mean = ragged.reference_segment_sum(values, offsets, mean=True)
    assert torch.equal(mean[1], torch.zeros(5, dtype=torch.float64))
    torch.testing.assert_close(mean[2], values[3:13].double().mean(0))


@pytest.mark.compile
@pytest.mark.parametrize("dtype", [0, 1, 2])
@pytest.mark.parametrize("offset_bits", [32, 64])
@pytest.mark.parametrize("vec", [0, 1])
def test_ragged_cu_compiles(tmp_path, dtype, offset_bits, vec):
    from test_work_queue import nvcc_cubin

    cubin = nvcc_cubin(ragged.SOURCE, {"DTYPE": dtype, "OFFSET_BITS": offset_bits, "VEC": vec,
                                       "BLOCK": ragged.BLOCK}, tmp_path / "r.cubin")
    assert ragged.KERNEL.encode() in cubin
