"""Tile-width sweep for the mid/large shapes below the bar (issue 3): cooperative 128xN and 256xN,
pingpong 64xN, with the clusters that matter, N over the wave-filling widths."""
import itertools

from cutlass_ops.config import GemmConfig, GemmOperands
from tuning.choice import Choice

SHAPES = [(1024, 14336, 4096), (16384, 14336, 4096), (128, 14336, 4096), (1024, 4096, 4096)]


def choices():
    out = []
    for tn, cl in itertools.product((112, 128, 160, 176, 192, 224, 256), ((1, 1, 1), (2, 1, 1), (1, 2, 1))):
        if (tn, cl) == (256, (2, 1, 1)):
            continue  # known not to compile with a TMA epilogue
        out.append(Choice(GemmConfig(kernel_schedule="cooperative", tile=(128, tn, 64), cluster=cl)))
    for tn, cl in itertools.product((96, 112), ((1, 1, 1), (1, 2, 1))):
        out.append(Choice(GemmConfig(kernel_schedule="cooperative", tile=(256, tn, 64), cluster=cl)))
    for tn, cl in itertools.product((176, 224), ((1, 1, 1), (2, 1, 1))):
        out.append(Choice(GemmConfig(kernel_schedule="pingpong", tile=(64, tn, 64), cluster=cl)))
    out.append(Choice(GemmConfig(kernel_schedule="cooperative", tile=(256, 128, 64), cluster=(1, 2, 1))))
    out.append(Choice(GemmConfig(kernel_schedule="cooperative", tile=(256, 128, 64), cluster=(2, 1, 1))))
    return out


def items():
    ops = GemmOperands.make("bf16")
    return [(c.operands_for(ops), c.config) for c in choices()]
