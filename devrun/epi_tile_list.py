"""Epilogue-tile study (1024x14336x4096 at 0.93x cuBLAS, which runs a 176-wide tile there).
Shared by devrun/epi_tile_compile.py (nvcc on a CPU machine) and devrun/epi_tile.py (timing on
the GPU).

CUTLASS's automatic epilogue tile stores 128 x gcd(32, tile N) at a time (cooperative). The
hypothesis was that a larger explicit one makes 176-wide tiles competitive. With CUTLASS 4.2 and
nvcc 13.0 (bf16, tnt, cooperative) it cannot be tried: an explicit 128x176 (cluster 1x1 and 2x1),
128x208, and 128x48 / 128x80 on a 128x240 tile each fail in 35 s with
sm90_epilogue_tma_warpspecialized.hpp(626): static assertion failed with "Fragment size does not
vectorize properly": a tile whose N / 16 is odd hands only 8 accumulator values a thread to each
epilogue copy, and the epilogue's FragmentSize (M * N / 256) must divide that, so N = 16 is the
only width (GemmConfig now refuses the others; cutlass_ops.config._EPILOGUE_COPY_VALUES). What can
be timed: those odd tiles with CUTLASS's choice, and explicit epilogue tiles on the widths that
allow them (128: up to 128, 192: up to 192, 256: up to 256), against the tuned winners.

Compiled on the CPU machine (devrun/epi_tile_compile.py, 2 cores, 60-100 s each): every kernel
below builds; ptxas reports 168 registers (the launch bound of 384 threads: the consumer
warpgroups raise theirs with setmaxnreg), no stack and no spills for all of them. Shared memory
(launcher's SharedStorage) and mainloop stages: 128x176 auto 211456 B, 5 stages (also cluster
2x1); 128x208 auto 231936 B, 5; 128x240 auto 205312 B, 4; 128x128 auto (128x32) 230400 B, 6;
e128x64 215040 B, 5; e128x128 231424 B, 5; 128x192 auto 197632 B, 4; e128x64 215040 B, 4;
e128x96 197632 B, 3; 128x256 and 256x128 auto 230400 B, 4; e128x64 215040 B, 3. An explicit
epilogue tile's buffers come out of the mainloop's stages (cutlass_ops.space.auto_stages).
"""

from cutlass_ops.config import GemmConfig, GemmOperands

OPERANDS = GemmOperands.make("bf16")  # y = x W^T: A row-major, B column-major, D row-major

# (tile, cluster, epilogue tiles); None is CUTLASS's automatic choice.
STUDY = [
    # Odd widths: only auto compiles (an explicit 128x16 is the same kernel type).
    ((128, 176, 64), (1, 1, 1), [None, (128, 16)]),
    ((128, 176, 64), (2, 1, 1), [None]),
    ((128, 208, 64), (1, 1, 1), [None]),
    ((128, 240, 64), (1, 1, 1), [None]),
    # The tuned winner at 1024x14336x4096 (742 TFLOP/s on an H200, 0.927x): auto is 128x32.
    ((128, 128, 64), (2, 1, 1), [None, (128, 64), (128, 128)]),
    ((128, 192, 64), (2, 1, 1), [None, (128, 64), (128, 96)]),
    ((128, 256, 64), (1, 2, 1), [None, (128, 64)]),
    ((256, 128, 64), (1, 2, 1), [None, (128, 64)]),
]


def configs() -> list[GemmConfig]:
    out = []
    for tile, cluster, epilogue_tiles in STUDY:
        for epilogue_tile in epilogue_tiles:
            out.append(GemmConfig(kernel_schedule="cooperative", tile=tile, cluster=cluster,
                                  epilogue_tile=epilogue_tile or (0, 0)))
    return out
