"""The second CUTLASS path: Hopper GEMM kernels written in the CuTe DSL (CUTLASS's Python
interface, ``nvidia-cutlass-dsl``), QuACK's (``quack-kernels``), as candidates beside the C++
kernels. An optional extra, ``pip install "cutlass-ops[dsl]"``: without it ``unavailable()``
says why and nothing here imports either package (nor does anything else in cutlass_ops).

A ``DslConfig`` names one kernel: the CTA tile (M x N, and K: 64 unless named), the thread
block cluster, the schedule (pingpong: two consumer warp groups on alternate tiles; cooperative:
both on one tile) and swap-A/B (the kernel computes D^T = B^T A^T, so a small M sits on the
tile's N side). Every config is persistent. Its tile scheduler is static (each CTA takes every
grid-th tile: no semaphore or workspace per call) unless the config is ``dynamic``: then CTAs
take tiles from an atomic counter, which balances tiles of unequal cost (grouped GEMMs over
skewed routing) at the price of a 4-byte counter QuACK allocates and zeroes per call. A CUDA
graph captures both with the kernel and replays the zeroing before it. The grouped tuner tries
such twins of its best kernels (``dsl_grouped.dynamic_twins``).

``SM90_CONFIGS`` is QuACK's own sm90 autotuning list (11 tiles, 2 clusters, swapped or not: 44
kernels); ``SMALL_CONFIGS`` adds
pingpong tiles 64 rows tall and 16 to 128 wide, with K tiles of 64 or 128 and 1x1 clusters too
(48 kernels), for problems whose M or N is at most 128: the memory-bound shapes where QuACK's
list loses to cuBLAS and these reach or beat it (docs/measurements.md).

QuACK compiles one kernel per config and operand types / majors, with M, N, K and the strides
symbolic (one kernel serves every shape), in 1-2 s, and keeps it as an object file in its disk
cache, which is put under our cache root (``<cache>/<version>/dsl/quack``, unless the user set
``QUACK_CACHE_DIR``) before QuACK is first imported: another process loads it in milliseconds.
Ours is used only while no other user can write to it (``custom_kernels.core.cache_trust``:
``UnsafeCacheError`` otherwise, which dispatch's DSL route answers with torch.matmul).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
import re
from typing import Callable, Optional

import torch

from custom_kernels.core.errors import UnsupportedInputError

PINGPONG_TILES = ((128, 128), (128, 160), (128, 192), (128, 208), (192, 128))
# 64-row pingpong tiles (wgmma's smallest M), 16 to 128 wide: for a small M, swapped (M on
# the tile's N side) or not (two tiles over M = 128); for a small N, the mirror images.
SMALL_TILES = ((64, 16), (64, 32), (64, 64), (64, 128))
SMALL_EXTENT = 128  # the problems SMALL_CONFIGS are offered to: min(M, N) at most this
TILE_KS = (64, 128)  # 64: QuACK's default for 16-bit operands (four wgmma K steps)
COOPERATIVE_TILES = ((256, 128), (256, 160), (256, 192), (256, 208), (128, 224), (128, 256))
CLUSTERS = ((2, 1), (1, 2))  # the dense candidates' (QuACK's autotuning list)
VALID_CLUSTERS = (*CLUSTERS, (1, 1))  # 1x1 too: grouped GEMMs with small groups want it
DTYPES = (torch.bfloat16, torch.float16)
SMS_H100 = 132  # the wave model's SM count when no GPU says otherwise
CACHE_ENV = "QUACK_CACHE_DIR"
_NAME = re.compile(
    r"dsl-sm90-(pingpong|cooperative)-t(\d+)x(\d+)(?:x(\d+))?-c(\d)x(\d)(-swap)?(-dynamic)?")


@dataclasses.dataclass(frozen=True)
class DslConfig:
    tile_m: int
    tile_n: int
    cluster_m: int = 2
    cluster_n: int = 1
    pingpong: bool = True
    swap_ab: bool = False
    tile_k: int = 64
    dynamic: bool = False  # the tile scheduler: an atomic counter rather than a fixed stride

    @property
    def name(self) -> str:
        schedule = "pingpong" if self.pingpong else "cooperative"
        k = f"x{self.tile_k}" if self.tile_k != 64 else ""
        return (f"dsl-sm90-{schedule}-t{self.tile_m}x{self.tile_n}{k}-c{self.cluster_m}x"
                f"{self.cluster_n}" + ("-swap" if self.swap_ab else "")
                + ("-dynamic" if self.dynamic else ""))

    @classmethod
    def from_name(cls, name: str) -> DslConfig:
        match = _NAME.fullmatch(name)
        if match is None:
            raise ValueError(f"not a DSL GEMM config name: {name!r} (expected e.g. "
                             f"{SM90_CONFIGS[0].name!r})")
        schedule, tm, tn, tk, cm, cn, swap, dynamic = match.groups()
        config = cls(int(tm), int(tn), int(cm), int(cn), schedule == "pingpong", bool(swap),
                     int(tk or 64), bool(dynamic))
        why = config.why_invalid()
        if why:
            raise ValueError(f"{name}: {why}")
        return config

    def why_invalid(self) -> Optional[str]:
        tiles = PINGPONG_TILES if self.pingpong else COOPERATIVE_TILES
        if self.pingpong:
            tiles += SMALL_TILES
        if (self.tile_m, self.tile_n) not in tiles:
            schedule = "pingpong" if self.pingpong else "cooperative"
            return f"the {schedule} tiles are {', '.join(f'{m}x{n}' for m, n in tiles)}"
        if self.tile_k not in TILE_KS:
            return f"the K tiles are {', '.join(map(str, TILE_KS))}"
        if (self.cluster_m, self.cluster_n) not in VALID_CLUSTERS:
            return f"the clusters are {', '.join(f'{m}x{n}' for m, n in VALID_CLUSTERS)}"
        return None

    @property
    def backend(self) -> str:
        return "dsl"

    def to_dict(self) -> dict:
        """What a tuning entry stores (``cutlass_ops.gemms.choice.candidate_from_dict`` reads
        it back)."""
        return {"backend": "dsl", "name": self.name}

    @classmethod
    def from_dict(cls, data: dict) -> DslConfig:
        return cls.from_name(data["name"])

    def to_quack(self):
        from quack.gemm_config import GemmConfig

        return GemmConfig(tile_m=self.tile_m, tile_n=self.tile_n, pingpong=self.pingpong,
                          is_dynamic_persistent=self.dynamic, cluster_m=self.cluster_m,
                          cluster_n=self.cluster_n, swap_ab=self.swap_ab, device_capacity=9,
                          # None for 64, QuACK's default: the same kernel (and disk-cache key)
                          # as before K tiles were named.
                          tile_k=self.tile_k if self.tile_k != 64 else None)


SM90_CONFIGS = tuple(
    DslConfig(tm, tn, cm, cn, pingpong, swap)
    for pingpong, tiles in ((True, PINGPONG_TILES), (False, COOPERATIVE_TILES))
    for tm, tn in tiles for cm, cn in CLUSTERS for swap in (False, True))

SMALL_CONFIGS = tuple(
    DslConfig(tm, tn, cm, cn, True, swap, tile_k)
    for tm, tn in SMALL_TILES for cm, cn in VALID_CLUSTERS for swap in (True, False)
    for tile_k in TILE_KS)


# The small configs that won the six M = 16 / 128 LLM shapes in a sweep of them
# (benchmarks/sweeps/dsl_gemm_space.py, H100): searched first, since the wave model ranks the
# small configs poorly (it cannot see a weight read once per tile along the small extent). For
# a small N, their mirror images (swap-A/B flipped: the kernel sees the same problem).
SMALL_SEEDS = tuple(DslConfig.from_name(name) for name in (
    "dsl-sm90-pingpong-t64x16x128-c1x2-swap", "dsl-sm90-pingpong-t64x32x128-c1x1-swap",
    "dsl-sm90-pingpong-t64x64-c1x2-swap", "dsl-sm90-pingpong-t64x128-c2x1"))


def unavailable() -> Optional[str]:
    """Why the DSL path cannot run here, or None. Looks for the packages without importing
    them (their import loads the DSL's compiler)."""
    for module, package in (("quack", "quack-kernels"), ("cutlass", "nvidia-cutlass-dsl")):
        if importlib.util.find_spec(module) is None:
            return (f"the CuTe DSL GEMM path needs {package} "
                    "(pip install \"cutlass-ops[dsl]\")")
    return None


def refusal(problem) -> Optional[str]:
    """Why the DSL kernels cannot take a ``GemmProblem`` (the tuner's question), or None: the
    extra is missing, the operands are not one 16-bit type with a 16-bit or float32 output, an
    epilogue QuACK's kernels do not compute as ours (``epilogue_refusal``), or operands not
    16-byte aligned."""
    return unavailable() or operands_refusal(problem)


def operands_refusal(problem) -> Optional[str]:
    """``refusal`` without the question whether the extra is installed: what no DSL kernel
    computes, wherever it runs (a stored DSL winner for such a problem is not one we tuned)."""
    from cutlass_ops.gemms.config import DType

    ops = problem.operands
    if ops.element_a not in (DType.BF16, DType.F16) or ops.element_b != ops.element_a:
        return f"{ops.element_a.value} x {ops.element_b.value} operands (bf16 or f16 only)"
    if ops.element_d not in (ops.element_a, DType.F32):
        return f"a {ops.element_d.value} output"
    why = epilogue_refusal(ops.epilogue)
    if why:
        return why
    if min(ops.alignment_a, ops.alignment_b, ops.alignment_c) * ops.element_a.bytes < 16:
        return "operands not 16-byte aligned"
    return None


def epilogue_refusal(epilogue) -> Optional[str]:
    """Why the DSL path cannot compute ``epilogue`` (ours: D = activation(alpha * AB + bias) +
    beta * C), or None. QuACK's ``gemm_tuned`` computes alpha * AB + beta * C + bias: a bias
    along N and a residual are ours. Activations go through its ``gemm_act``, which with a
    pinned config failed to compile on an H100 (quack-kernels 0.6.5, nvidia-cutlass-dsl 4.8.1:
    "TypeError: epilogue fn depends on <ContextVar name='_LOC_TRANSFORMS'>"), and which adds C
    before the activation: they stay with the C++ kernels. A bias along M is refused too."""
    activation = getattr(epilogue.activation, "value", epilogue.activation)
    bias = getattr(epilogue.bias, "value", epilogue.bias)
    if bias == "m":
        return "a bias along M"
    if activation != "identity":
        return f"a fused {activation} activation (QuACK's gemm_act does not compile with a " \
            "pinned config)"
    return None


def candidates(m: int, n: int, k: int, sms: int = SMS_H100) -> list[DslConfig]:
    """Every sm90 config for the shape, the best guess first: by how much of the tiles' work is
    the problem's (edge tiles padded) times how full the last wave of tiles is, on ``sms`` SMs.
    Where M or N is at most ``SMALL_EXTENT``, the 64-row ``SMALL_CONFIGS`` come first: the wave
    model cannot tell them from the large tiles, which on such memory-bound shapes all lose."""
    def fill(config: DslConfig) -> float:
        rows, cols = (n, m) if config.swap_ab else (m, n)
        tiles_m, tiles_n = math.ceil(rows / config.tile_m), math.ceil(cols / config.tile_n)
        useful = rows * cols / (tiles_m * config.tile_m * tiles_n * config.tile_n)
        tiles = tiles_m * tiles_n
        return useful * tiles / (math.ceil(tiles / sms) * sms)

    small = SMALL_CONFIGS if min(m, n) <= SMALL_EXTENT else ()
    seeds = SMALL_SEEDS if m <= n else tuple(
        dataclasses.replace(c, swap_ab=not c.swap_ab) for c in SMALL_SEEDS)
    return [*sorted(small, key=lambda c: (c not in seeds, -fill(c), c.name)),
            *sorted(SM90_CONFIGS, key=lambda c: (-fill(c), c.name))]


def check(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor,
          bias: Optional[torch.Tensor] = None, c: Optional[torch.Tensor] = None) -> None:
    """What the kernels take, with the problem named: CUDA tensors on one device; a (M, K) or
    (L, M, K), b (K, N) or (L, K, N), out and the residual c (M, N) or (L, M, N); bf16 or fp16
    operands of one dtype (out and c of theirs or float32); each operand with one unit-stride
    dimension of its last two and the other strides multiples of 16 bytes, from a 16-byte
    aligned address; bias (N,) of out's dtype."""
    tensors = {"a": a, "b": b, "out": out, **({"bias": bias} if bias is not None else {}),
               **({"c": c} if c is not None else {})}
    devices = {t.device for t in tensors.values()}
    if len(devices) != 1 or next(iter(devices)).type != "cuda":
        raise UnsupportedInputError(f"the DSL GEMM needs CUDA tensors on one device, got "
                                    f"{sorted(map(str, devices))}")
    if a.dtype not in DTYPES or b.dtype != a.dtype:
        raise UnsupportedInputError(f"the DSL GEMM takes bf16 or fp16 operands of one dtype, "
                                    f"got {a.dtype} and {b.dtype}")
    if out.dtype not in (a.dtype, torch.float32):
        raise UnsupportedInputError(f"out must be {a.dtype} or float32, got {out.dtype}")
    if not (a.dim() == b.dim() == out.dim() and a.dim() in (2, 3)):
        raise UnsupportedInputError(f"a, b and out must all be 2-D or all 3-D, got "
                                    f"{a.dim()}, {b.dim()} and {out.dim()} dimensions")
    m, k = a.shape[-2:]
    if b.shape[-2] != k or tuple(out.shape[-2:]) != (m, b.shape[-1]) or (
            a.dim() == 3 and not a.shape[0] == b.shape[0] == out.shape[0]):
        raise UnsupportedInputError(f"shapes do not make a GEMM: a {tuple(a.shape)}, b "
                                    f"{tuple(b.shape)}, out {tuple(out.shape)}")
    if c is not None and (c.shape != out.shape or c.dtype != out.dtype):
        raise UnsupportedInputError(f"the residual c must have out's shape {tuple(out.shape)} "
                                    f"and dtype {out.dtype}, got {tuple(c.shape)} {c.dtype}")
    if bias is not None and (tuple(bias.shape) != (b.shape[-1],) or bias.dtype != out.dtype):
        raise UnsupportedInputError(f"bias must be ({b.shape[-1]},) of {out.dtype}, got "
                                    f"{tuple(bias.shape)} of {bias.dtype}")
    for name, t in tensors.items():
        if name == "bias":
            continue
        unit = [d for d in (-1, -2) if t.stride(d) == 1 or t.shape[d] == 1]
        if not unit:
            raise UnsupportedInputError(f"{name}: one of the last two dimensions needs a unit "
                                        f"stride, got strides {t.stride()}")
        step = 16 // t.element_size()
        others = [t.stride(d) for d in range(t.dim()) if d != t.dim() + unit[0]
                  and t.shape[d] > 1]
        if any(s % step for s in others) or t.data_ptr() % 16:
            raise UnsupportedInputError(f"{name}: strides {t.stride()} and address need 16-byte "
                                        "alignment (leading dimension a multiple of "
                                        f"{step} elements)")


def plan(config: DslConfig, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, *,
         bias: Optional[torch.Tensor] = None, c: Optional[torch.Tensor] = None,
         alpha: float = 1.0, beta: float = 1.0) -> Callable[[], torch.Tensor]:
    """``launch()``, running ``out = alpha * (a @ b) + bias + beta * c`` with ``config``'s
    kernel on torch's current stream and returning ``out``. The first launch compiles the kernel
    (or loads it from the disk cache); capture a launch in a CUDA graph only after one has run."""
    why = unavailable()
    if why:
        raise UnsupportedInputError(why)
    check(a, b, out, bias, c)
    run = runner(config)

    def launch() -> torch.Tensor:
        run(a, b, out, bias, c, alpha, beta)
        return out

    return launch


def runner(config: DslConfig) -> Callable[..., None]:
    """``run(a, b, out, bias=None, c=None, alpha=1.0, beta=1.0)``: ``config``'s kernel without
    ``check`` (dispatch's per-call path, whose route signature keeps check's answer for every
    call it serves), through QuACK's ``gemm_tuned`` with the config pinned."""
    why = unavailable()
    if why:
        raise UnsupportedInputError(why)
    gemm = _interface().gemm_tuned.fn
    quack_config = config.to_quack()

    def run(a, b, out, bias=None, c=None, alpha=1.0, beta=1.0) -> None:
        # beta 1.0 without C: QuACK compiles the term out.
        gemm(a, b, out, c, bias, alpha, beta if c is not None else 1.0, config=quack_config)

    return run


_prepared = None


def _interface():
    """quack.gemm_interface, its disk cache placed under ours first."""
    global _prepared
    if _prepared is None:
        from custom_kernels.core.cache_dir import versioned_dir
        from custom_kernels.core.cache_trust import require_private

        if CACHE_ENV not in os.environ:
            directory = versioned_dir("dsl", "quack")
            require_private(directory)  # QuACK loads the object files it finds there
            os.environ[CACHE_ENV] = str(directory)
        from quack import gemm_interface

        _prepared = gemm_interface
    return _prepared


__all__ = ["DslConfig", "SM90_CONFIGS", "SMALL_CONFIGS", "SMALL_SEEDS", "unavailable", "refusal",
           "epilogue_refusal", "candidates", "check", "plan", "runner"]
