"""The routing split without a GPU: the input rules and the reference's choice (the CPU path),
which the kernel is checked against in tests/gpu/moe/test_skew_dispatch_gpu.py."""

import pytest
import torch

from custom_kernels.moe import routing_split
from custom_kernels.core.errors import UnsupportedInputError


def ends(*sizes):
    return torch.tensor(sizes).cumsum(0).to(torch.int32)


@pytest.mark.parametrize("offs, skew, skewed", [
    (ends(128, 128, 128, 128), 2.0, False),  # even: largest = mean
    (ends(500, 4, 4, 4), 2.0, True),  # 500 rows against a mean of 128
    (ends(256, 0, 0, 0), 4.0, False),  # exactly skew x the mean is even (strictly greater)
    (ends(0, 0, 0, 0), 1.0, False),  # no rows at all
    (ends(7), 1.0, False),  # one group is its own mean
])
def test_the_split_hands_every_row_to_one_side(offs, skew, skewed):
    even, uneven = routing_split.split_by_skew(offs, skew)
    sizes = torch.diff(offs.long(), prepend=torch.zeros(1, dtype=torch.long))
    expected = bool(sizes.max() * offs.numel() > skew * int(offs[-1]))
    assert expected == skewed
    assert (uneven if expected else even).tolist() == offs.tolist()
    assert not (even if expected else uneven).any()
    assert even.dtype == uneven.dtype == torch.int32


def test_the_mean_counts_every_group():
    # 255 rows in one of four groups: 255 x 4 = 1020 < 4 x 256 = 1024, even at skew 4
    even, uneven = routing_split.split_by_skew(ends(255, 1, 0, 0), 4.0)
    assert even.tolist() == [255, 256, 256, 256] and not uneven.any()
    even, uneven = routing_split.split_by_skew(ends(255, 1, 0, 0), 3.9)
    assert uneven.tolist() == [255, 256, 256, 256] and not even.any()


def test_empty_offsets_split_into_empty_offsets():
    even, uneven = routing_split.split_by_skew(torch.zeros(0, dtype=torch.int32), 2.0)
    assert even.numel() == uneven.numel() == 0


@pytest.mark.parametrize("offs, skew, match", [
    (torch.tensor([1, 2]), 2.0, "int32"),
    (torch.zeros(2, 2, dtype=torch.int32), 2.0, "1-D"),
    (ends(1, 2), 0.5, "skew"),
    (ends(1, 2), float("nan"), "skew"),
    (ends(1, 2), "2", "skew"),
])
def test_bad_input_is_refused_by_name(offs, skew, match):
    with pytest.raises(UnsupportedInputError, match=match):
        routing_split.split_by_skew(offs, skew)
