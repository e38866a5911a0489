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

from custom_kernels.core.elements import element


class DType(str, enum.Enum):
    """The element types of the plain GEMMs (names of ``custom_kernels.core.elements``, where
    their facts live). F32 operands run on the tensor cores in TF32."""

    BF16 = "bf16"
    F16 = "f16"
    F32 = "f32"
    E4M3 = "e4m3"  # FP8 operands: scaled GEMMs only (cutlass_ops.scaled_mm)
    E5M2 = "e5m2"

    @property
    def bytes(self) -> int:
        return element(self).bytes


class Scaling(str, enum.Enum):
    """How an FP8 GEMM's float32 scales reach its kernel (``torch._scaled_mm``'s recipes,
    ``cutlass_ops.gemms.fp8.fp8_operands``). ``TENSORWISE``: two device scalars, multiplied in the
    epilogue; ``ROWWISE``: M and N vectors (a column and a row broadcast) in the epilogue;
    ``BLOCKWISE``: 1x128 scales of A and 128x128 of B, applied in the mainloop per K block."""

    NONE = "none"
    TENSORWISE = "tensorwise"
    ROWWISE = "rowwise"
    BLOCKWISE = "blockwise"


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


class Activation(str, enum.Enum):
    """The elementwise function of a fused epilogue (CUTLASS's epilogue thread functors)."""

    IDENTITY = "identity"
    RELU = "relu"
    GELU = "gelu"  # erf form, torch's F.gelu default (cutlass::epilogue::thread::GELU)
    GELU_TANH = "gelu_tanh"  # F.gelu(approximate="tanh") (cutlass::epilogue::thread::GELU_taylor)
    SILU = "silu"


class BiasMode(str, enum.Enum):
    """Which extent a fused bias vector runs along. ``N``: one value per output column, the same
    for every row (nn.Linear's bias; CUTLASS's row broadcast). ``M``: one value per output row
    (what nn.Linear's bias becomes when the GEMM runs swapped, D^T = B^T A^T)."""

    NONE = "none"
    N = "n"
    M = "m"


@dataclasses.dataclass(frozen=True)
class Epilogue:
    """What a kernel does to the accumulator before it stores D, fused into the GEMM through a
    CUTLASS epilogue visitor tree:

        D = activation(alpha * (A @ B) + bias) + beta * C

    C is the residual (read only when ``residual``); alpha and beta are run-time scalars. The
    default (no bias, identity, no residual flag) is the plain ``alpha * AB + beta * C`` of every
    kernel, which still takes a C at run time.
    """

    activation: Activation = Activation.IDENTITY
    bias: BiasMode = BiasMode.NONE
    residual: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "activation", Activation(self.activation))
        object.__setattr__(self, "bias", BiasMode(self.bias))
        object.__setattr__(self, "residual", bool(self.residual))

    @property
    def is_default(self) -> bool:
        return self == Epilogue()

    @property
    def name(self) -> str:
        """"" for the default, else e.g. ``bias_n-gelu_tanh-res``."""
        parts = []
        if self.bias is not BiasMode.NONE:
            parts.append(f"bias_{self.bias.value}")
        if self.activation is not Activation.IDENTITY:
            parts.append(self.activation.value)
        if self.residual:
            parts.append("res")
        return "-".join(parts)

    def transposed(self) -> Epilogue:
        """The same epilogue on D^T: a bias along N runs along M there, and the other way."""
        flip = {BiasMode.N: BiasMode.M, BiasMode.M: BiasMode.N, BiasMode.NONE: BiasMode.NONE}
        return dataclasses.replace(self, bias=flip[self.bias])

    def to_dict(self) -> dict[str, Any]:
        return {f.name: _plain(getattr(self, f.name)) for f in dataclasses.fields(self)}

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> Epilogue:
        return cls(**(data or {}))

    @classmethod
    def parse(cls, text: str | None) -> Epilogue:
        """From a comma list as the CLI takes it: ``bias,gelu_tanh,residual`` (``bias`` is
        ``bias_n``; the order does not matter; ``""`` or ``none`` is the default)."""
        fields: dict[str, Any] = {}
        for part in filter(None, (p.strip() for p in (text or "").split(","))):
            if part == "none":
                continue
            if part in ("bias", "bias_n"):
                fields["bias"] = BiasMode.N
            elif part == "bias_m":
                fields["bias"] = BiasMode.M
            elif part in ("res", "residual"):
                fields["residual"] = True
            else:
                try:
                    fields["activation"] = Activation(part)
                except ValueError:
                    known = ", ".join(a.value for a in Activation)
                    raise ValueError(f"unknown epilogue part {part!r}: use bias, bias_m, "
                                     f"residual, or an activation ({known})") from None
        return cls(**fields)


Triple = tuple[int, int, int]


def _triple(value: Any, what: str) -> Triple:
    out = tuple(int(v) for v in value)
    if len(out) != 3 or any(v <= 0 for v in out):
        raise ValueError(f"{what} must be three positive integers, got {value!r}")
    return out  # type: ignore[return-value]


def _dims(t: tuple[int, ...]) -> str:
    return "x".join(str(v) for v in t)


# An epilogue tile of (0, 0) lets CUTLASS choose (EpilogueTileAuto).
AUTO_EPILOGUE_TILE = (0, 0)
EPILOGUE_TILE_AUTO_CPP = "cutlass::epilogue::collective::EpilogueTileAuto"
# Rows of an explicit sm90a epilogue tile, per schedule: CUTLASS's sm90 epilogue builder
# (sm90_compute_tile_shape_or_override) static_asserts 64 for one consumer warpgroup and 128 for
# two (cooperative); a thread then converts M * N / 128 or / 256 values (FragmentSize) at a time.
_EPILOGUE_TILE_M = {"pingpong": 64, "warpspecialized": 64, "cooperative": 128}
# The accumulator values a thread hands to one register-to-shared-memory copy of the sm90 TMA
# epilogue (size<0>(tRS_rAcc) in sm90_epilogue_tma_warpspecialized.hpp) are those of one wgmma:
# N / 2 for a tile N wide, since cutlass_ops.gemms.loader builds with CuTe's extended wgmma shapes
# (one wgmma per tile width; docs/measurements.md, "Epilogue tiles", says how it was read off
# CUTLASS's headers). The epilogue's FragmentSize (M * N / 128 or / 256) must divide
# it ("Fragment size does not vectorize properly"), which any epilogue tile that divides the tile
# does. (Without the extended shapes a tile such as 176 wide ran sixteen-wide wgmmas and allowed
# only 16-wide epilogue tiles.)


def epilogue_tile_widths(config: GemmConfig) -> list[int]:
    """The epilogue tile widths (N) that compile with an sm90a config's tile N."""
    tn = config.tile[1]
    return [n for n in range(16, tn + 1, 16) if tn % n == 0]


def _epilogue_tile_problems(config: GemmConfig) -> list[str]:
    """Why an explicit epilogue tile cannot be compiled with this config (CUTLASS 4.2's sm90
    static_asserts and limits); empty when it can, or when the tile is auto."""
    em, en = config.epilogue_tile
    if (em, en) == AUTO_EPILOGUE_TILE:
        return []
    if em <= 0 or en <= 0:
        return [f"epilogue_tile must be (0, 0) (auto) or two positive integers, got {(em, en)}"]
    tm, tn, _ = config.tile
    if config.arch is not Arch.SM90A:
        return ["an explicit epilogue tile is supported on sm90a only"]
    if config.epilogue_schedule is not EpilogueSchedule.TMA:
        return ["an explicit epilogue tile needs the TMA epilogue (nosmem has none)"]
    why = []
    rows = _EPILOGUE_TILE_M.get(config.kernel_schedule.value)
    if rows is not None and em != rows:
        why.append(f"{config.kernel_schedule.value} needs epilogue tile M = {rows}, got {em}")
    if tm % em or tn % en:
        why.append(f"epilogue tile {em}x{en} must divide the tile {tm}x{tn}")
    if en % 16:
        why.append(f"epilogue tile N must be a multiple of 16, got {en}")
    return why


@dataclasses.dataclass(frozen=True)
class GemmOperands:
    """What a kernel is compiled for: element types, layouts and alignments (in elements).

    D = alpha * (A @ B) + beta * C, with A (M x K), B (K x N), C and D (M x N). C and D share one
    element type and layout. The accumulator is f32 (f16 is allowed for f16 operands). A fused
    ``epilogue`` (bias, activation, residual) is compiled in, so it is part of the kernel's and
    the tuned problem's identity. ``fast_accum`` (FP8 operands only): FP8 tensor-core
    accumulation without CUTLASS's periodic promotion to float32 (torch._scaled_mm's
    ``use_fast_accum``), which changes the results, so it is part of the identity too; and so is
    ``scaling``, the FP8 recipe whose scales the kernel reads (``Scaling``).
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
    epilogue: Epilogue = Epilogue()
    fast_accum: bool = False
    scaling: Scaling = Scaling.NONE

    def __post_init__(self) -> None:
        object.__setattr__(self, "fast_accum", bool(self.fast_accum))
        object.__setattr__(self, "scaling", Scaling(self.scaling))
        if not isinstance(self.epilogue, Epilogue):
            object.__setattr__(self, "epilogue", Epilogue.from_dict(self.epilogue))
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
             out_dtype: str | DType | None = None,
             epilogue: Epilogue | str | None = None) -> GemmOperands:
        """The common case: A and B of one type, f32 accumulation, 16-byte (TMA) alignment."""
        dtype = DType(dtype)
        out = DType(out_dtype) if out_dtype is not None else dtype
        if not isinstance(epilogue, Epilogue):
            epilogue = Epilogue.parse(epilogue)
        return cls(dtype, dtype, out, out, DType.F32, Layout(layout_a), Layout(layout_b),
                   Layout(layout_c), 16 // dtype.bytes, 16 // dtype.bytes, 16 // out.bytes,
                   epilogue)

    def with_epilogue(self, epilogue: Epilogue) -> GemmOperands:
        return dataclasses.replace(self, epilogue=epilogue)

    @property
    def layout_name(self) -> str:
        return self.layout_a.letter + self.layout_b.letter + self.layout_c.letter

    @property
    def name(self) -> str:
        types = "_".join(e.value for e in (self.element_a, self.element_b, self.element_c,
                                            self.element_d, self.element_accumulator))
        aligns = f"align{self.alignment_a}x{self.alignment_b}x{self.alignment_c}"
        # The default epilogue adds nothing, so names (and cache keys) of plain GEMMs are stable.
        epilogue = f"_{self.epilogue.name}" if not self.epilogue.is_default else ""
        fast = "_fastaccum" if self.fast_accum else ""
        scaling = f"_{self.scaling.value}" if self.scaling is not Scaling.NONE else ""
        return f"{types}_{self.layout_name}_{aligns}{epilogue}{fast}{scaling}"

    @property
    def is_fp8(self) -> bool:
        return element(self.element_a).is_fp8 or element(self.element_b).is_fp8

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: _plain(getattr(self, f.name)) for f in dataclasses.fields(self)}
        if self.epilogue.is_default:  # plain GEMMs keep the dict (and the hashes) they had
            del out["epilogue"]
        if not self.fast_accum:  # likewise every GEMM from before FP8
            del out["fast_accum"]
        if self.scaling is Scaling.NONE:
            del out["scaling"]
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> GemmOperands:
        optional = ("epilogue", "fast_accum", "scaling")  # absent from the dicts of GEMMs
        fields = {f.name: data[f.name] for f in dataclasses.fields(cls) if f.name not in optional}
        return cls(**fields, epilogue=Epilogue.from_dict(data.get("epilogue")),
                   fast_accum=data.get("fast_accum", False),
                   scaling=data.get("scaling", Scaling.NONE))


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
    memory allows. ``epilogue_tile`` is the (M, N) sub-tile the TMA epilogue stores at a time;
    (0, 0) lets CUTLASS choose (EpilogueTileAuto: N = gcd(32, tile N) on sm90a, so a 176-wide
    tile stores in 11 slices of 16 columns, the only width CUTLASS 4.2 compiles for it:
    ``epilogue_tile_widths``). It comes last and is left out of names and dicts
    while it is auto, so that configs without it keep their names and cache keys.

    The build fields are compiled into the kernel (``build_fields``); ``splits``,
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
    epilogue_tile: tuple[int, int] = AUTO_EPILOGUE_TILE

    BUILD_FIELDS = ("arch", "tile", "cluster", "stages", "kernel_schedule", "epilogue_schedule",
                    "tile_scheduler", "epilogue_tile")

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
        try:
            epilogue_tile = tuple(int(v) for v in self.epilogue_tile)
        except TypeError:
            epilogue_tile = ()
        if len(epilogue_tile) != 2:
            raise ValueError(f"epilogue_tile must be two integers (M, N), got "
                             f"{self.epilogue_tile!r}")
        object.__setattr__(self, "epilogue_tile", epilogue_tile)
        why = _epilogue_tile_problems(self)
        if why:
            raise ValueError(f"epilogue_tile {_dims(epilogue_tile)}: " + "; ".join(why))

    @property
    def epilogue_tile_is_auto(self) -> bool:
        return self.epilogue_tile == AUTO_EPILOGUE_TILE

    @property
    def epilogue_tile_cpp(self) -> str:
        """The C++ epilogue tile type: CUTLASS's Auto, or the explicit (M, N) shape."""
        if self.epilogue_tile_is_auto:
            return EPILOGUE_TILE_AUTO_CPP
        m, n = self.epilogue_tile
        return f"cute::Shape<cute::_{m}, cute::_{n}>"

    @property
    def name(self) -> str:
        return (f"{self.build_name}-split{self.splits}-r{self.raster_order.value}"
                f"-sw{self.swizzle}")

    @property
    def build_name(self) -> str:
        """The name of the compiled artifact: the fields that change the binary."""
        stages = "auto" if self.stages == 0 else str(self.stages)
        epilogue_tile = "" if self.epilogue_tile_is_auto else f"-e{_dims(self.epilogue_tile)}"
        return (f"{self.arch.value}-{self.kernel_schedule.value}-t{_dims(self.tile)}"
                f"-c{_dims(self.cluster)}-s{stages}-epi{self.epilogue_schedule.value}"
                f"-{self.tile_scheduler.value}{epilogue_tile}")

    def build_fields(self) -> tuple:
        """The values of BUILD_FIELDS; an auto epilogue tile is left out, so that keys hashed
        from them (the emitted-source cache) are those of configs from before the field."""
        fields = tuple(getattr(self, name) for name in self.BUILD_FIELDS)
        return fields[:-1] if self.epilogue_tile_is_auto else fields

    def replace(self, **changes: Any) -> GemmConfig:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: _plain(getattr(self, f.name)) for f in dataclasses.fields(self)}
        if self.epilogue_tile_is_auto:  # configs without one keep the dict (and hashes) they had
            del out["epilogue_tile"]
        return out

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
                   splits=int(g["splits"]), raster_order=g["raster"], swizzle=int(g["swizzle"]),
                   epilogue_tile=tuple(int(v) for v in (g["epitile"] or "0x0").split("x")))


_CONFIG_NAME = re.compile(
    r"(?P<arch>sm\d+a)-(?P<kernel>\w+?)-t(?P<tile>\d+x\d+x\d+)-c(?P<cluster>\d+x\d+x\d+)"
    r"-s(?P<stages>auto|\d+)-epi(?P<epi>\w+?)-(?P<sched>\w+?)(?:-e(?P<epitile>\d+x\d+))?"
    r"-split(?P<splits>\d+)-r(?P<raster>\w+?)-sw(?P<swizzle>\d+)")


def _plain(value: Any) -> Any:
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, tuple):
        return list(value)
    if dataclasses.is_dataclass(value):
        return value.to_dict()  # type: ignore[union-attr]
    return value
