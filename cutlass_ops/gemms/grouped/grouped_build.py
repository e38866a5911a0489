"""Configs and nvcc builds of the CUTLASS sm90 grouped (ptr-array) GEMM kernels
(``csrc/grouped_launcher.cu``), kept in the build cache like the dense kernels.

A ``GroupedConfig`` names one kernel: the element type (bf16 or fp16), A's and B's layouts
(``t``: row-major, ``n``: column-major, for A (M x K) and B (K x N); a Hugging Face expert weight
[N, K] used as B is column-major), the CTA tile, the cluster and the schedule. One kernel serves
every form of ``cutlass_ops.moe.grouped`` with its operand layouts and every group count: the
problem sizes are read on the device. A build needs nvcc, not a GPU (about 35 s).
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import math
import re
import subprocess
import time
from pathlib import Path

from custom_kernels.core import build_cache
from custom_kernels.core.elements import element
from cutlass_ops.gemms.build import (BUILD_TIMEOUT_S, cutlass_include_dirs, nvcc_flags,
                                     nvcc_path, nvcc_version)
from cutlass_ops.gemms.config import Arch

LAUNCHER = Path(__file__).resolve().parents[1] / "csrc" / "grouped_launcher.cu"  # gemms/csrc
FP8_LAUNCHER = LAUNCHER.with_name("grouped_fp8_launcher.cu")
LIBRARY = "grouped.so"
ELEMENTS = ("bf16", "f16")  # what the launcher is compiled for (custom_kernels.core.elements)
_NAME = re.compile(r"grouped-(bf16|f16)-([tn])([tn])-(cooperative|pingpong)-t(\d+)x(\d+)x(\d+)"
                   r"-c(\d)x(\d)")


@dataclasses.dataclass(frozen=True)
class GroupedConfig:
    element: str = "bf16"
    layout_a: str = "t"
    layout_b: str = "n"
    pingpong: bool = False
    tile: tuple[int, int, int] = (128, 256, 64)
    cluster: tuple[int, int] = (2, 1)

    def __post_init__(self) -> None:
        why = self.why_invalid()
        if why:
            raise ValueError(f"grouped GEMM config {self.name}: {why}")

    @property
    def name(self) -> str:
        schedule = "pingpong" if self.pingpong else "cooperative"
        tm, tn, tk = self.tile
        return (f"grouped-{self.element}-{self.layout_a}{self.layout_b}-{schedule}-t{tm}x{tn}x{tk}"
                f"-c{self.cluster[0]}x{self.cluster[1]}")

    @classmethod
    def from_name(cls, name: str) -> GroupedConfig:
        match = _NAME.fullmatch(name)
        if match is None:
            raise ValueError(f"not a grouped GEMM config name: {name!r}")
        element, la, lb, schedule, tm, tn, tk, cm, cn = match.groups()
        return cls(element, la, lb, schedule == "pingpong", (int(tm), int(tn), int(tk)),
                   (int(cm), int(cn)))

    def why_invalid(self) -> str | None:
        tm, tn, tk = self.tile
        if self.element not in ELEMENTS:
            return f"element {self.element} (bf16 or f16)"
        if self.layout_a not in "tn" or self.layout_b not in "tn" or \
                len(self.layout_a) != 1 or len(self.layout_b) != 1:
            return "layouts are t (row-major) or n (column-major)"
        rows = (64, 128) if self.pingpong else (128, 256)
        if tm not in rows:
            return f"{'pingpong' if self.pingpong else 'cooperative'} tiles have M in {rows}"
        if tn % 16 or not 16 <= tn <= 256 or tk not in (64, 128):
            return "tile N a multiple of 16 up to 256, tile K 64 or 128"
        if self.cluster not in ((1, 1), (2, 1), (1, 2), (2, 2)):
            return "clusters 1x1, 2x1, 1x2 or 2x2"
        return None

    @property
    def launcher(self) -> Path:
        return LAUNCHER

    def defines(self) -> tuple[str, ...]:
        tm, tn, tk = self.tile
        return (f"GROUPED_ELEMENT={element(self.element).code}",
                f"GROUPED_LAYOUT_A={0 if self.layout_a == 't' else 1}",
                f"GROUPED_LAYOUT_B={0 if self.layout_b == 't' else 1}",
                f"GROUPED_TILE_M={tm}", f"GROUPED_TILE_N={tn}", f"GROUPED_TILE_K={tk}",
                f"GROUPED_CLUSTER_M={self.cluster[0]}", f"GROUPED_CLUSTER_N={self.cluster[1]}",
                f"GROUPED_PINGPONG={int(self.pingpong)}")


_FP8_NAME = re.compile(r"grouped-e4m3-(blockwise|rowwise|rowwise-fastaccum)-(cooperative|pingpong)"
                       r"-t(\d+)x(\d+)-c(\d)x(\d)")
FP8_RECIPES = ("blockwise", "rowwise")


@dataclasses.dataclass(frozen=True)
class GroupedFp8Config:
    """One FP8 grouped kernel (``csrc/grouped_fp8_launcher.cu``, issue 53): e4m3 tokens sorted by
    expert (row-major) times each expert's e4m3 [N, K] weight, bf16 out. ``recipe`` blockwise:
    1x128 scales of the tokens and 128x128 of the weights applied in the mainloop (tile K, N
    128); rowwise: a scale a token and a scale a weight row applied in the epilogue, with
    ``fast_accum`` the accumulation kept in the tensor cores (never promoted)."""

    pingpong: bool = False
    tile: tuple[int, int] = (128, 128)
    cluster: tuple[int, int] = (1, 1)
    recipe: str = "blockwise"
    fast_accum: bool = False

    def __post_init__(self) -> None:
        why = self.why_invalid()
        if why:
            raise ValueError(f"grouped FP8 config {self.name}: {why}")

    @property
    def name(self) -> str:
        schedule = "pingpong" if self.pingpong else "cooperative"
        scaling = self.recipe + ("-fastaccum" if self.fast_accum else "")
        return (f"grouped-e4m3-{scaling}-{schedule}-t{self.tile[0]}x{self.tile[1]}"
                f"-c{self.cluster[0]}x{self.cluster[1]}")

    @classmethod
    def from_name(cls, name: str) -> "GroupedFp8Config":
        match = _FP8_NAME.fullmatch(name)
        if match is None:
            raise ValueError(f"not a grouped FP8 config name: {name!r}")
        scaling, schedule, tm, tn, cm, cn = match.groups()
        return cls(schedule == "pingpong", (int(tm), int(tn)), (int(cm), int(cn)),
                   scaling.split("-")[0], scaling.endswith("fastaccum"))

    def why_invalid(self) -> str | None:
        if self.recipe not in FP8_RECIPES:
            return f"recipes {FP8_RECIPES}"
        if self.fast_accum and self.recipe != "rowwise":
            return "fast accumulation is a rowwise kernel's (blockwise promotes every K block)"
        rows = (64,) if self.pingpong else (128,)
        if self.tile[0] not in rows:
            return f"{'pingpong' if self.pingpong else 'cooperative'} tiles have M in {rows}"
        if self.recipe == "blockwise" and self.tile[1] != 128:
            # CUTLASS's blockwise accumulation wants one B scale a tile (fp8_accumulation.hpp:
            # "Accumulator and scaleB must have same shape" at N 256, compiled here).
            return "tile N 128: one 128-wide scale block of B a tile"
        if self.tile[1] not in (128, 256):
            return "tile N 128 or 256"
        if self.cluster not in ((1, 1), (2, 1), (1, 2)):
            return "clusters 1x1, 2x1 or 1x2"
        return None

    @property
    def launcher(self) -> Path:
        return FP8_LAUNCHER

    def defines(self) -> tuple[str, ...]:
        return (f"GROUPED_TILE_M={self.tile[0]}", f"GROUPED_TILE_N={self.tile[1]}",
                f"GROUPED_CLUSTER_M={self.cluster[0]}", f"GROUPED_CLUSTER_N={self.cluster[1]}",
                f"GROUPED_PINGPONG={int(self.pingpong)}",
                f"GROUPED_ROWWISE={int(self.recipe == 'rowwise')}",
                f"GROUPED_FAST_ACCUM={int(self.fast_accum)}")


@functools.lru_cache(maxsize=None)
def load_library(path: Path, prefix: str, args_type, abi_version: int) -> ctypes.CDLL:
    """A grouped launcher's library (``grouped_launcher.cu``: ``prefix`` "cutlass_ops_grouped",
    ``grouped_fp8_launcher.cu``: "cutlass_ops_grouped_fp8"), loaded once a path, its C entry
    points typed with ``args_type`` (the ctypes mirror of its arguments) and its ABI checked."""
    from custom_kernels.core.errors import KernelLaunchError

    library = ctypes.CDLL(str(path))
    getattr(library, f"{prefix}_last_error").restype = ctypes.c_char_p
    getattr(library, f"{prefix}_run").argtypes = [ctypes.POINTER(args_type), ctypes.c_void_p,
                                                  ctypes.c_size_t, ctypes.c_void_p]
    getattr(library, f"{prefix}_workspace_size").argtypes = [ctypes.POINTER(args_type),
                                                             ctypes.POINTER(ctypes.c_size_t)]
    version = getattr(library, f"{prefix}_abi_version")()
    if version != abi_version:
        raise KernelLaunchError(f"{path}: launcher ABI {version}, expected {abi_version}; "
                                "rebuild it")
    return library


def bucket(rows_per_group: float) -> int:
    """The tuning key's rows per group: the next power of two, at least 16."""
    return max(16, 1 << max(0, math.ceil(math.log2(max(1.0, rows_per_group)))))


@dataclasses.dataclass(frozen=True)
class GroupedProblem:
    """What a grouped GEMM is tuned for: the form (``cutlass_ops.moe.grouped``), the group count,
    the per-group extents (the grouped one as a bucket of its mean: ``bucket``), the element
    type and A's and B's layouts. Routing skew is not in the key: the offsets live on the
    device, and reading them would cost a sync per call."""

    form: str
    groups: int
    m: int
    n: int
    k: int
    element: str = "bf16"
    layout_a: str = "t"
    layout_b: str = "n"

    @property
    def name(self) -> str:
        return (f"{self.form}-{self.element}-{self.layout_a}{self.layout_b}-g{self.groups}"
                f"-m{self.m}-n{self.n}-k{self.k}")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> GroupedProblem:
        return cls(**{f.name: data[f.name] for f in dataclasses.fields(cls)})

    @property
    def flops(self) -> float:
        return 2.0 * self.groups * self.m * self.n * self.k

    @classmethod
    def of(cls, form: str, a, b, offs, element: str, layout_a: str,
           layout_b: str) -> GroupedProblem:
        """The key of a call's operands (``cutlass_ops.moe.grouped``'s forms)."""
        if form == "2d3d":
            groups = b.shape[0]
            return cls(form, groups, bucket(a.shape[0] / max(1, groups)), b.shape[-1],
                       a.shape[1], element, layout_a, layout_b)
        if form == "2d2d":
            groups = offs.shape[0]
            return cls(form, groups, a.shape[0], b.shape[1],
                       bucket(a.shape[1] / max(1, groups)), element, layout_a, layout_b)
        if form == "3d2d":
            groups = a.shape[0]
            return cls(form, groups, a.shape[1], bucket(b.shape[1] / max(1, groups)),
                       a.shape[2], element, layout_a, layout_b)
        return cls(form, a.shape[0], a.shape[1], b.shape[2], a.shape[2], element, layout_a,
                   layout_b)


@dataclasses.dataclass(frozen=True)
class GroupedFp8Problem:
    """What an FP8 grouped GEMM (``GroupedFp8Config``'s kernel, the 2d-3d forward) is tuned
    for: the expert count, the mean rows per expert as a ``bucket``, N, K and the scaling
    recipe. As for ``GroupedProblem``, routing skew is not in the key."""

    groups: int
    m: int
    n: int
    k: int
    recipe: str = "blockwise"

    @property
    def name(self) -> str:
        return f"2d3d-e4m3-{self.recipe}-g{self.groups}-m{self.m}-n{self.n}-k{self.k}"

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> GroupedFp8Problem:
        return cls(**{f.name: data[f.name] for f in dataclasses.fields(cls)})

    @property
    def flops(self) -> float:
        return 2.0 * self.groups * self.m * self.n * self.k

    @classmethod
    def of(cls, a, b, recipe: str = "blockwise") -> GroupedFp8Problem:
        """The key of a call's operands in the kernel's orientation: a [M, K], b [E, N, K]."""
        groups = b.shape[0]
        return cls(groups, bucket(a.shape[0] / max(1, groups)), b.shape[1], b.shape[2], recipe)


def fp8_candidates(problem: GroupedFp8Problem, strategy: str = "default") -> list:
    """FP8 kernels to try for ``problem``'s recipe, the best guess first.

    Blockwise: pingpong 64-row tiles (one warpgroup's scale promotion overlapping the other's
    MMA) when an expert has few rows, cooperative 128-row tiles otherwise, then the 2-CTA
    clusters; quick 3, default 4, exhaustive all 6. Rowwise: the scales cost nothing in the
    mainloop, so 256-wide tiles join, with and without fast accumulation; quick 4, default 6,
    exhaustive all 12."""
    small = problem.m <= 128
    if problem.recipe == "rowwise":
        def rowwise(pingpong, tile, cluster, fast):
            return GroupedFp8Config(pingpong, tile, cluster, "rowwise", fast)

        coop = [rowwise(False, (128, n), c, fast) for fast in (True, False)
                for n in (256, 128) for c in ((1, 1), (2, 1))]
        ping = [rowwise(True, (64, n), (1, 1), fast) for fast in (True, False)
                for n in (256, 128)]
        ranked = ping[:2] + coop[:2] + ping[2:] + coop[2:] if small else \
            coop[:2] + ping[:2] + coop[2:4] + ping[2:] + coop[4:]
        limit = {"quick": 4, "default": 6, "exhaustive": None}[strategy]
        return ranked[:limit]
    pingpong = [GroupedFp8Config(pingpong=True, tile=(64, 128), cluster=c)
                for c in ((1, 1), (2, 1), (1, 2))]
    cooperative = [GroupedFp8Config(cluster=c) for c in ((1, 1), (1, 2), (2, 1))]
    if small:
        ranked = [pingpong[0], cooperative[0], cooperative[1], pingpong[1], pingpong[2],
                  cooperative[2]]
    else:
        ranked = [cooperative[0], pingpong[0], cooperative[1], cooperative[2], pingpong[1],
                  pingpong[2]]
    limit = {"quick": 3, "default": 4, "exhaustive": None}[strategy]
    return ranked[:limit]


@dataclasses.dataclass(frozen=True)
class GroupedBuild:
    config: GroupedConfig | GroupedFp8Config
    arch: Arch = Arch.SM90A

    @functools.cached_property
    def key(self) -> str:
        return build_cache.key({
            "launcher": build_cache.digest(self.config.launcher.read_bytes()),
            "nvcc": nvcc_version(),
            "flags": nvcc_flags(self.arch), "arch": self.arch.value,
            "defines": list(self.config.defines())})

    @property
    def directory(self) -> Path:
        return build_cache.entry_path("grouped", self.arch.value, self.config.name, self.key)

    @property
    def entry(self) -> build_cache.Entry:
        return build_cache.directory_entry(self.directory, self.config.name, LIBRARY,
                                           "built.json")


def _compile(spec: GroupedBuild, library: Path) -> build_cache.Built:
    command = [nvcc_path(), *nvcc_flags(spec.arch), *(f"-D{d}" for d in spec.config.defines()),
               *(f"-I{d}" for d in cutlass_include_dirs()), "-o", str(library),
               str(spec.config.launcher)]
    start = time.perf_counter()
    try:
        proc = subprocess.run(command, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
        output, ok = proc.stdout + proc.stderr, proc.returncode == 0
    except subprocess.TimeoutExpired as exc:
        output, ok = f"nvcc timed out after {BUILD_TIMEOUT_S} s\n{exc.stderr or ''}", False
    log = " ".join(command) + "\n\n" + output
    if not ok:
        raise build_cache.BuildFailed(log)
    return build_cache.Built({"seconds": time.perf_counter() - start,
                              "name": spec.config.name}, log)


def build(config: GroupedConfig | GroupedFp8Config, arch: Arch = Arch.SM90A, *,
          retry_failed: bool = False) -> Path:
    """The kernel library of ``config``: from the build cache, or compiled now (raises
    BuildError with nvcc's log kept)."""
    spec = GroupedBuild(config, arch)
    return build_cache.get_or_build(spec.entry, lambda library: _compile(spec, library),
                                    retry=retry_failed).path


def config_from_name(name: str):
    """The grouped kernel a tuning entry names: ours (``grouped-...``), the DSL path's
    (``dsl-...``, None without the extra) or a pair of them (``skew-...``, None where either
    is)."""
    if name.startswith("skew-"):
        from cutlass_ops.gemms.grouped.skew_dispatch import SkewDispatch

        return SkewDispatch.from_name(name, config_from_name)
    if name.startswith("dsl-"):
        from cutlass_ops.gemms.grouped import dsl_grouped

        return dsl_grouped.config_from_name(name)
    return GroupedConfig.from_name(name)


def candidates(problem: GroupedProblem, strategy: str = "default") -> list[GroupedConfig]:
    """Kernels to try, the best guess first: pingpong 64-row tiles when a group has few rows
    (decode-sized experts), cooperative 128 / 256-row tiles otherwise; quick 4, default 8,
    exhaustive all 15."""
    base = dict(element=problem.element, layout_a=problem.layout_a, layout_b=problem.layout_b)
    small = problem.m <= 128
    pingpong = [GroupedConfig(**base, pingpong=True, tile=tile, cluster=cluster)
                for tile in ((64, 128, 64), (64, 256, 64), (128, 128, 64))
                for cluster in ((1, 1), (2, 1))]
    cooperative = [GroupedConfig(**base, tile=tile, cluster=cluster)
                   for tile in ((128, 256, 64), (128, 128, 64), (256, 128, 64))
                   for cluster in ((2, 1), (1, 1), (1, 2))]
    ranked = pingpong + cooperative if small else cooperative + pingpong
    limit = {"quick": 4, "default": 8, "exhaustive": None}[strategy]
    return ranked[:limit]


__all__ = ["GroupedConfig", "GroupedFp8Config", "GroupedFp8Problem", "GroupedProblem",
           "GroupedBuild", "build", "bucket", "load_library", "candidates", "config_from_name", "fp8_candidates",
           "LAUNCHER", "FP8_LAUNCHER"]
