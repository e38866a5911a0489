"""Pure data: what a GEMM computes (GemmProblem) and how a kernel computes it (GemmConfig).

Both are frozen and hashable, have stable readable names that carry every field, and round-trip
through plain dicts, so they can key caches, cross process boundaries and be written to JSON.
Nothing here imports torch or CUTLASS.
"""

from __future__ import annotations

import dataclasses
import enum
import re
from typing import Any


class DType(str, enum.Enum):
    """Element types. F32 operands run on the tensor cores in TF32."""

    BF16 = "bf16"
    F16 = "f16"
    F32 = "f32"

    @property
    def bytes(self) -> int:
        return 4 if self is DType.F32 else 2


class Layout(str, enum.Enum):
    """Memory order of a 2-D operand: ROW (last dimension contiguous) or COL.

    In CUTLASS's short names a row-major operand is "t" and a column-major one "n".
    """

    ROW = "row"
    COL = "col"

    @property
    def letter(self) -> str:
        return "t" if self is Layout.ROW else "n"


class KernelSchedule(str, enum.Enum):
    PINGPONG = "pingpong"  # sm90a: two consumer warpgroups alternate whole tiles
    COOPERATIVE = "cooperative"  # sm90a: two consumer warpgroups split one tile
    WARP_SPECIALIZED = "warpspecialized"  # sm90a: one producer, one consumer warpgroup
    SM100_1SM = "1sm"  # sm100a: one SM per MMA
    SM100_2SM = "2sm"  # sm100a: a CTA pair shares one MMA (TmaWarpSpecialized2SmSm100)


class EpilogueSchedule(str, enum.Enum):
    TMA = "tma"  # stage D (and C) through shared memory with TMA
    NO_SMEM = "nosmem"  # write D straight from registers


class TileScheduler(str, enum.Enum):
    PERSISTENT = "persistent"
    STREAM_K = "streamk"


class RasterOrder(str, enum.Enum):
    HEURISTIC = "heuristic"
    ALONG_M = "alongm"
    ALONG_N = "alongn"

    @property
    def abi_value(self) -> int:
        return {"heuristic": 0, "alongm": 1, "alongn": 2}[self.value]


class Arch(str, enum.Enum):
    SM90A = "sm90a"
    SM100A = "sm100a"

    @property
    def cc(self) -> int:
        return 90 if self is Arch.SM90A else 100


Triple = tuple[int, int, int]


def _triple(value: Any, what: str) -> Triple:
    out = tuple(int(v) for v in value)
    if len(out) != 3 or any(v <= 0 for v in out):
        raise ValueError(f"{what} must be three positive integers, got {value!r}")
    return out  # type: ignore[return-value]


def _dims(t: Triple) -> str:
    return "x".join(str(v) for v in t)


@dataclasses.dataclass(frozen=True)
class GemmOperands:
    """What a kernel is compiled for: element types, layouts and alignments (in elements).

    D = alpha * (A @ B) + beta * C, with A (M x K), B (K x N), C and D (M x N). C and D share one
    element type and layout. The accumulator is f32 (f16 is allowed for f16 operands).
    """

    element_a: DType
    element_b: DType
    element_c: DType
    element_d: DType
    element_accumulator: DType
    layout_a: Layout
    layout_b: Layout
    layout_c: Layout
    alignment_a: int
    alignment_b: int
    alignment_c: int

    def __post_init__(self) -> None:
        for name in ("element_a", "element_b", "element_c", "element_d", "element_accumulator"):
            object.__setattr__(self, name, DType(getattr(self, name)))
        for name in ("layout_a", "layout_b", "layout_c"):
            object.__setattr__(self, name, Layout(getattr(self, name)))
        for name in ("alignment_a", "alignment_b", "alignment_c"):
            value = int(getattr(self, name))
            if value <= 0 or value & (value - 1):
                raise ValueError(f"{name} must be a power of two, got {value}")
            object.__setattr__(self, name, value)
        if self.element_c is not self.element_d:
            raise ValueError("C and D must have the same element type")

    @classmethod
    def make(cls, dtype: str | DType, *, layout_a: str | Layout = Layout.ROW,
             layout_b: str | Layout = Layout.COL, layout_c: str | Layout = Layout.ROW,
             out_dtype: str | DType | None = None) -> GemmOperands:
        """The common case: A and B of one type, f32 accumulation, 16-byte (TMA) alignment."""
        dtype = DType(dtype)
        out = DType(out_dtype) if out_dtype is not None else dtype
        return cls(dtype, dtype, out, out, DType.F32, Layout(layout_a), Layout(layout_b),
                   Layout(layout_c), 16 // dtype.bytes, 16 // dtype.bytes, 16 // out.bytes)

    @property
    def layout_name(self) -> str:
        return self.layout_a.letter + self.layout_b.letter + self.layout_c.letter

    @property
    def name(self) -> str:
        types = "_".join(e.value for e in (self.element_a, self.element_b, self.element_c,
                                            self.element_d, self.element_accumulator))
        aligns = f"align{self.alignment_a}x{self.alignment_b}x{self.alignment_c}"
        return f"{types}_{self.layout_name}_{aligns}"

    def to_dict(self) -> dict[str, Any]:
        return {f.name: _plain(getattr(self, f.name)) for f in dataclasses.fields(self)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> GemmOperands:
        return cls(**{f.name: data[f.name] for f in dataclasses.fields(cls)})


@dataclasses.dataclass(frozen=True)
class GemmProblem:
    """One GEMM: operands plus the sizes M, N, K and the batch count L."""

    operands: GemmOperands
    m: int
    n: int
    k: int
    batch: int = 1

    def __post_init__(self) -> None:
        for name in ("m", "n", "k", "batch"):
            value = int(getattr(self, name))
            if value < 0:
                raise ValueError(f"{name} must not be negative, got {value}")
            object.__setattr__(self, name, value)
        if self.batch < 1:
            raise ValueError("batch must be at least 1")

    @property
    def flops(self) -> int:
        return 2 * self.m * self.n * self.k * self.batch

    @property
    def name(self) -> str:
        batch = f"x{self.batch}" if self.batch != 1 else ""
        return f"{self.operands.name}_{self.m}x{self.n}x{self.k}{batch}"

    def to_dict(self) -> dict[str, Any]:
        return {"operands": self.operands.to_dict(), "m": self.m, "n": self.n, "k": self.k,
                "batch": self.batch}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> GemmProblem:
        return cls(GemmOperands.from_dict(data["operands"]), data["m"], data["n"], data["k"],
                   data.get("batch", 1))


@dataclasses.dataclass(frozen=True)
class GemmConfig:
    """How one kernel computes a GEMM.

    ``tile`` is the tile shape CUTLASS is instantiated with (the emitted ``TileShape``): the CTA
    tile on sm90a and for 1-SM sm100a kernels, the tile of a CTA pair for 2-SM kernels.
    ``cluster`` is the thread block cluster. ``stages`` of 0 lets CUTLASS fit as many as shared
    memory allows.

    The first seven fields are compiled into the kernel (``build_fields``); ``splits``,
    ``raster_order`` and ``swizzle`` are run-time arguments of the same artifact.
    """

    arch: Arch = Arch.SM90A
    tile: Triple = (128, 128, 64)
    cluster: Triple = (1, 1, 1)
    stages: int = 0
    kernel_schedule: KernelSchedule = KernelSchedule.PINGPONG
    epilogue_schedule: EpilogueSchedule = EpilogueSchedule.TMA
    tile_scheduler: TileScheduler = TileScheduler.PERSISTENT
    splits: int = 1
    raster_order: RasterOrder = RasterOrder.HEURISTIC
    swizzle: int = 1

    BUILD_FIELDS = ("arch", "tile", "cluster", "stages", "kernel_schedule", "epilogue_schedule",
                    "tile_scheduler")

    def __post_init__(self) -> None:
        object.__setattr__(self, "arch", Arch(self.arch))
        object.__setattr__(self, "tile", _triple(self.tile, "tile"))
        object.__setattr__(self, "cluster", _triple(self.cluster, "cluster"))
        object.__setattr__(self, "kernel_schedule", KernelSchedule(self.kernel_schedule))
        object.__setattr__(self, "epilogue_schedule", EpilogueSchedule(self.epilogue_schedule))
        object.__setattr__(self, "tile_scheduler", TileScheduler(self.tile_scheduler))
        object.__setattr__(self, "raster_order", RasterOrder(self.raster_order))
        for name in ("stages", "splits", "swizzle"):
            object.__setattr__(self, name, int(getattr(self, name)))
        if self.stages < 0:
            raise ValueError("stages must be 0 (auto) or positive")
        if self.splits < 1:
            raise ValueError("splits must be at least 1")
        if self.swizzle not in (1, 2, 4, 8):
            raise ValueError(f"swizzle must be 1, 2, 4 or 8, got {self.swizzle}")

    @property
    def name(self) -> str:
        stages = "auto" if self.stages == 0 else str(self.stages)
        return (f"{self.arch.value}-{self.kernel_schedule.value}-t{_dims(self.tile)}"
                f"-c{_dims(self.cluster)}-s{stages}-epi{self.epilogue_schedule.value}"
                f"-{self.tile_scheduler.value}-split{self.splits}-r{self.raster_order.value}"
                f"-sw{self.swizzle}")

    @property
    def build_name(self) -> str:
        """The name of the compiled artifact: the fields that change the binary."""
        stages = "auto" if self.stages == 0 else str(self.stages)
        return (f"{self.arch.value}-{self.kernel_schedule.value}-t{_dims(self.tile)}"
                f"-c{_dims(self.cluster)}-s{stages}-epi{self.epilogue_schedule.value}"
                f"-{self.tile_scheduler.value}")

    def build_fields(self) -> tuple:
        return tuple(getattr(self, name) for name in self.BUILD_FIELDS)

    def replace(self, **changes: Any) -> GemmConfig:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return {f.name: _plain(getattr(self, f.name)) for f in dataclasses.fields(self)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> GemmConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"unknown GemmConfig fields: {sorted(unknown)}")
        return cls(**data)

    @classmethod
    def from_name(cls, name: str) -> GemmConfig:
        match = _CONFIG_NAME.fullmatch(name)
        if not match:
            raise ValueError(f"not a GemmConfig name: {name!r}")
        g = match.groupdict()
        return cls(arch=g["arch"], kernel_schedule=g["kernel"],
                   tile=tuple(int(v) for v in g["tile"].split("x")),
                   cluster=tuple(int(v) for v in g["cluster"].split("x")),
                   stages=0 if g["stages"] == "auto" else int(g["stages"]),
                   epilogue_schedule=g["epi"], tile_scheduler=g["sched"],
                   splits=int(g["splits"]), raster_order=g["raster"], swizzle=int(g["swizzle"]))


_CONFIG_NAME = re.compile(
    r"(?P<arch>sm\d+a)-(?P<kernel>\w+?)-t(?P<tile>\d+x\d+x\d+)-c(?P<cluster>\d+x\d+x\d+)"
    r"-s(?P<stages>auto|\d+)-epi(?P<epi>\w+?)-(?P<sched>\w+?)-split(?P<splits>\d+)"
    r"-r(?P<raster>\w+?)-sw(?P<swizzle>\d+)")


def _plain(value: Any) -> Any:
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, tuple):
        return list(value)
    if dataclasses.is_dataclass(value):
        return value.to_dict()  # type: ignore[union-attr]
    return value
