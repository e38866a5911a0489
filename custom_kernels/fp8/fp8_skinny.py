"""The few-rows FP8 scaled GEMM (``csrc/fp8_skinny.cu``): M <= 128, split along K over a thread
block cluster whose blocks sum their partial tiles through distributed shared memory.

``SkinnyConfig(bm, splits, stages)`` names one build and launch (``skinny-m16-s8-p4``): the rows
a block covers, the blocks of a cluster that share one output tile's K, and the cp.async
pipeline's depth. The tuner times these beside the CUTLASS kernels for each small-M shape
(``tuning.fp8_session``); ``cutlass_ops.fp8.fp8_routes`` runs a winner.

``run(config, a, b, scale_a, scale_b, recipe, bias, out)`` launches on tensors that passed
``cutlass_ops.gemms.fp8.fp8_operands.check_scaled`` and ``refusal`` (which the caller asks once per
signature, not per call). Read top-down: the config, the rules, compile (tensor-free, no GPU),
the launcher.
"""

from __future__ import annotations

import dataclasses
import functools
import re

from custom_kernels import jit
from custom_kernels.core.elements import element
from custom_kernels.launch import launch, set_max_dynamic_shared

SOURCE = "fp8_skinny.cu"
KERNEL = "fp8_skinny_gemm"
PREFIX = "skinny"
BLOCK_N = 128  # output columns a block, and the K depth of a pipeline stage
BLOCK_ROWS = (16, 32, 64, 128)
MAX_SPLITS = 8  # a portable cluster
MAX_M = 128  # past this the CUTLASS tiles fill their rows and win
RECIPES = {"tensorwise": 0, "rowwise": 1, "blockwise": 2}
_NAME = re.compile(rf"{PREFIX}-m(?P<bm>\d+)-s(?P<splits>\d+)-p(?P<stages>\d+)")


@dataclasses.dataclass(frozen=True)
class SkinnyConfig:
    bm: int  # rows a block covers (16, 32, 64, 128)
    splits: int  # blocks of a cluster sharing one output tile's K (1..8)
    stages: int  # cp.async pipeline depth

    def __post_init__(self) -> None:
        if self.bm not in BLOCK_ROWS:
            raise ValueError(f"bm={self.bm}: a block covers one of {BLOCK_ROWS} rows")
        if not 1 <= self.splits <= MAX_SPLITS:
            raise ValueError(f"splits={self.splits}: 1 to {MAX_SPLITS} (a portable cluster)")
        if not 2 <= self.stages <= 8:
            raise ValueError(f"stages={self.stages}: 2 to 8")
        if self.shared_bytes > 227 * 1024:
            raise ValueError(f"{self.name} needs {self.shared_bytes} bytes of shared memory; "
                             "an SM has 227 KB")

    @property
    def name(self) -> str:
        return f"{PREFIX}-m{self.bm}-s{self.splits}-p{self.stages}"

    @property
    def backend(self) -> str:
        return PREFIX

    @property
    def threads(self) -> int:
        return 256  # two warpgroups, 64 of the tile's 128 weight rows each

    @property
    def shared_bytes(self) -> int:
        """Dynamic shared memory: the pipeline's stages of a (bm rows) and b (128 rows), and
        1024 bytes of slack to start them on the 128-byte swizzle's 1024-byte boundary."""
        return self.stages * (self.bm + BLOCK_N) * BLOCK_N + 1024

    def to_dict(self) -> dict:
        """What a tuning entry stores as its winner (``from_dict`` reads it back)."""
        return {"backend": PREFIX, "name": self.name}

    @classmethod
    def from_dict(cls, data: dict) -> "SkinnyConfig":
        if data.get("backend") != PREFIX or not isinstance(data.get("name"), str):
            raise ValueError(f"not a skinny FP8 config: {data!r}"[:200])
        return cls.parse(data["name"])

    @classmethod
    def parse(cls, name: str) -> "SkinnyConfig":
        found = _NAME.fullmatch(name)
        if found is None:
            raise ValueError(f"{name!r} is not a skinny FP8 config name "
                             f"({PREFIX}-m<rows>-s<splits>-p<stages>)")
        return cls(int(found["bm"]), int(found["splits"]), int(found["stages"]))


def is_skinny_name(name: str) -> bool:
    return name.startswith(PREFIX + "-")


def refusal(m: int, n: int, k: int, element_a: str, element_b: str) -> str | None:
    """Why the kernel cannot compute this problem (None when it can): M at most MAX_M, N and K
    multiples of 128 (whole output tiles and k-blocks), no e5m2 x e5m2."""
    if not 1 <= m <= MAX_M:
        return f"M={m}: the skinny kernel takes 1 to {MAX_M} rows"
    if n % BLOCK_N or k % BLOCK_N:
        return f"N={n} and K={k} must be multiples of {BLOCK_N} for the skinny kernel"
    if element_a == element_b == "e5m2":
        return "FP8 tensor cores take e5m2 only beside e4m3"
    return None


def candidates(m: int, n: int, k: int) -> list[SkinnyConfig]:
    """The configs worth timing for a problem: the smallest block covering M (and the next
    smaller one, two blocks down M), splits from 1 to 8 that leave each block at least two
    k-blocks, two pipeline depths."""
    fits = [bm for bm in BLOCK_ROWS if bm >= m]
    rows = {fits[0]} if fits else set()
    rows |= {bm for bm in BLOCK_ROWS if bm < m <= 2 * bm}
    blocks_k = k // BLOCK_N
    found = []
    for bm in sorted(rows):
        for splits in (1, 2, 4, 8):
            if splits > 1 and blocks_k < 2 * splits:
                continue
            for stages in (4, 6):
                try:
                    found.append(SkinnyConfig(bm, splits, stages))
                except ValueError:  # too much shared memory
                    continue
    return found


# ---------------------------------------------------------------------------------------------
# Compile (tensor-free, no GPU)
# ---------------------------------------------------------------------------------------------

def defines(config: SkinnyConfig, recipe: str, element_a: str, element_b: str,
            out_float32: bool, has_bias: bool) -> dict:
    return {"BM": config.bm, "STAGES": config.stages, "RECIPE": RECIPES[recipe],
            "ELEM_A": element(element_a).code, "ELEM_B": element(element_b).code,
            "OUT_F32": int(out_float32), "HAS_BIAS": int(has_bias)}


def compile_fp8_skinny(config: SkinnyConfig, recipe: str = "tensorwise", *,
                       element_a: str = "e4m3", element_b: str = "e4m3",
                       out_float32: bool = False, has_bias: bool = False,
                       arch: str = jit.DEFAULT_ARCH):
    """The cubin of one build (cached; NVRTC, no GPU)."""
    return jit.compile_cubin(SOURCE, arch=arch, name_expressions=(KERNEL,),
                             defines=defines(config, recipe, element_a, element_b, out_float32,
                                             has_bias))


# ---------------------------------------------------------------------------------------------
# Launcher
# ---------------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _kernel(config: SkinnyConfig, recipe: str, element_a: str, element_b: str,
            out_float32: bool, has_bias: bool, device: int):
    kernel = jit.get_kernel(SOURCE, KERNEL, device=device,
                            defines=defines(config, recipe, element_a, element_b, out_float32,
                                            has_bias))
    set_max_dynamic_shared(kernel, config.shared_bytes, device)
    return kernel


def run(config: SkinnyConfig, a, b, scale_a, scale_b, recipe: str, bias, out) -> None:
    """out (M, N) contiguous = scaled_mm(a, b, scale_a, scale_b, bias): a (M, K) row-major FP8,
    b (K, N) column-major FP8, scales of ``recipe``'s shapes (blockwise scale_a column-major,
    scale_b the transpose of a row-major tensor), all checked by the caller."""
    import torch

    m, k = a.shape
    n = b.shape[1]
    device = a.device.index
    kernel = _kernel(config, recipe, element(a.dtype).name, element(b.dtype).name,
                     out.dtype == torch.float32, bias is not None, device)
    if recipe == "rowwise":
        sa_stride, sb_stride = scale_a.stride(0), scale_b.stride(1)
    elif recipe == "blockwise":
        sa_stride, sb_stride = scale_a.stride(1), scale_b.stride(1)
    else:
        sa_stride = sb_stride = 0
    lda = a.stride(0) if m > 1 else k
    ldb = b.stride(1) if n > 1 else k
    launch(kernel, a, lda, b, ldb, scale_a, sa_stride, scale_b, sb_stride,
           bias.data_ptr() if bias is not None else 0, out, m, n, k,
           grid=(config.splits, n // BLOCK_N, -(-m // config.bm)), block=config.threads,
           shared_mem=config.shared_bytes, cluster=config.splits, device=device)


__all__ = ["MAX_M", "SkinnyConfig", "candidates", "compile_fp8_skinny", "is_skinny_name",
           "refusal", "run"]
