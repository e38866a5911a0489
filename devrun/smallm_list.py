"""Kernels for the small-M diagnostic (issue 3): swap pingpong / cooperative stream-K, plus a few
unswapped ones for M=128. Shared by the local prebuild and the GPU run."""
import itertools

from cutlass_ops.config import GemmConfig, GemmOperands, GemmProblem
from tuning.choice import Choice

SHAPES = [(m, n, k) for m in (16, 128) for n, k in ((4096, 4096), (14336, 4096), (4096, 14336))]


def choices():
    out = []
    for (tm, tn), tk, cl in itertools.product(((64, 16), (64, 32), (64, 64), (128, 16), (128, 32)),
                                              (64, 128), ((1, 1, 1), (2, 1, 1))):
        out.append(Choice(GemmConfig(kernel_schedule="pingpong", tile=(tm, tn, tk), cluster=cl), True))
    for (tm, tn), tk in itertools.product(((128, 16), (128, 32), (128, 64)), (64, 128)):
        out.append(Choice(GemmConfig(kernel_schedule="cooperative", tile=(tm, tn, tk),
                                     tile_scheduler="streamk"), True))
    for tn in (16, 32, 64):
        out.append(Choice(GemmConfig(kernel_schedule="cooperative", tile=(128, tn, 128),
                                     cluster=(2, 1, 1), tile_scheduler="streamk"), True))
    for (tm, tn), cl in itertools.product(((64, 64), (64, 128)), ((1, 1, 1), (2, 1, 1))):
        out.append(Choice(GemmConfig(kernel_schedule="pingpong", tile=(tm, tn, 64), cluster=cl), False))
    for tn in (64, 128):
        out.append(Choice(GemmConfig(kernel_schedule="cooperative", tile=(128, tn, 64),
                                     tile_scheduler="streamk"), False))
    return out


def items():
    ops = GemmOperands.make("bf16")
    return [(c.operands_for(ops), c.config) for c in choices()]


if __name__ == "__main__":
    import sys
    import time
    from cutlass_ops.kernels import prepare_many
    t = time.time()
    res = prepare_many(items(), jobs=int(sys.argv[1]) if len(sys.argv) > 1 else None)
    bad = {k[1].name: str(v)[:200] for k, v in res.items() if isinstance(v, Exception)}
    print(len(res), "built;", len(bad), "failed", bad, f"{time.time()-t:.0f}s", flush=True)
