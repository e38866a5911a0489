"""Explicit stage counts and the register epilogue for the compute-bound shapes below 1x
(issue 3): the winners' tiles with 3 to 5 stages instead of CUTLASS's fill-the-smem count."""
from cutlass_ops.config import GemmConfig, GemmOperands
from tuning.choice import Choice

SHAPES = [(1024, 14336, 4096), (4096, 14336, 4096), (1024, 4096, 4096), (4096, 4096, 4096)]


def choices():
    out = []
    for tile, cl, stages in (((256, 128, 64), (1, 2, 1), (0, 3)),
                             ((128, 256, 64), (1, 2, 1), (0, 3)),
                             ((128, 128, 64), (2, 1, 1), (0, 3, 4, 5))):
        for s in stages:
            out.append(Choice(GemmConfig(kernel_schedule="cooperative", tile=tile, cluster=cl,
                                         stages=s)))
    for tile, cl in (((256, 128, 64), (1, 2, 1)), ((128, 128, 64), (2, 1, 1)),
                     ((128, 256, 64), (1, 2, 1))):
        out.append(Choice(GemmConfig(kernel_schedule="cooperative", tile=tile, cluster=cl,
                                     epilogue_schedule="nosmem")))
    return out


def items():
    ops = GemmOperands.make("bf16")
    return [(c.operands_for(ops), c.config) for c in choices()]
