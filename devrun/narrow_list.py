"""Unswapped narrow-N tiles for the small-M shapes (issue 3): with the weight on the N side a
16- or 32-wide tile puts 128 to 900 CTAs on the weight, where swap-A/B's 64-row tiles leave half
the SMs idle at N=4096. Beside them, the current winners as the yardstick."""
import itertools

from cutlass_ops.config import GemmConfig, GemmOperands
from tuning.choice import Choice

SHAPES = [(m, n, k) for m in (16, 128) for n, k in ((4096, 4096), (14336, 4096), (4096, 14336))]


def choices():
    out = []
    for tn, tk, cl in itertools.product((16, 32, 64), (64, 128, 256), ((1, 1, 1), (1, 2, 1))):
        out.append(Choice(GemmConfig(kernel_schedule="pingpong", tile=(64, tn, tk), cluster=cl)))
    for tn, tk, cl in itertools.product((16, 32, 64), (64, 128), ((1, 1, 1), (1, 2, 1))):
        out.append(Choice(GemmConfig(kernel_schedule="cooperative", tile=(128, tn, tk), cluster=cl)))
    for tn in (32, 64):
        out.append(Choice(GemmConfig(kernel_schedule="pingpong", tile=(64, tn, 128), cluster=(2, 1, 1))))
    for tile, cl, sched in (((64, 16, 128), (1, 2, 1), "pingpong"), ((64, 16, 128), (4, 1, 1), "pingpong"),
                            ((64, 32, 128), (1, 1, 1), "pingpong"), ((64, 64, 64), (1, 1, 1), "pingpong"),
                            ((128, 128, 64), (4, 1, 1), "cooperative")):
        out.append(Choice(GemmConfig(kernel_schedule=sched, tile=tile, cluster=cl), True))
    return out


def items():
    ops = GemmOperands.make("bf16")
    return [(c.operands_for(ops), c.config) for c in choices()]
