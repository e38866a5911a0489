"""Stream-K against data-parallel on the shapes just below the bar (issue 3): the last wave of
256x128 / 128x256 tiles at 1024x14336x4096 is 39% full; stream-K spreads it."""
import itertools

from cutlass_ops.config import GemmConfig, GemmOperands
from tuning.choice import Choice

SHAPES = [(1024, 14336, 4096), (1024, 4096, 4096), (128, 14336, 4096), (4096, 14336, 4096)]


def choices():
    out = []
    for tile, cl in itertools.product(((128, 256, 64), (256, 128, 64), (128, 128, 64), (128, 192, 64)),
                                      ((1, 1, 1), (1, 2, 1), (2, 1, 1))):
        if (tile, cl) == ((128, 256, 64), (2, 1, 1)):
            continue
        out.append(Choice(GemmConfig(kernel_schedule="cooperative", tile=tile, cluster=cl,
                                     tile_scheduler="streamk")))
    out.append(Choice(GemmConfig(kernel_schedule="cooperative", tile=(128, 128, 64), cluster=(2, 1, 1))))
    out.append(Choice(GemmConfig(kernel_schedule="cooperative", tile=(256, 128, 64), cluster=(1, 2, 1))))
    return out


def items():
    ops = GemmOperands.make("bf16")
    return [(c.operands_for(ops), c.config) for c in choices()]
