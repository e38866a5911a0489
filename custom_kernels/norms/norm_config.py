"""Launch configurations of the fused norm kernels (``csrc/norms.cu``): pure data, no torch.

A ``NormProblem`` names what changes the compiled kernel (norm kind, direction, hidden size,
dtypes, whether the 16-byte vector path is allowed); a ``NormConfig`` names how a row is split:
threads per block, rows per block (1; one row per warp; or, in the direct forward kernel, one
row per 8 or 16 lanes, several short rows per warp), thread block cluster size, vector width,
rows per thread (the direct forward kernel with a warp or less per row: each thread loads its
part of that many rows before reducing any, and each weight vector once for all of them), and
the kernel: ``stages`` 0 is the direct kernel of ``csrc/norms.cu`` (registers only,
a row per block, warp or part of a warp, any alignment); ``stages`` >= 1 is the persistent kernel of
``csrc/norms_staged.cu``, which keeps ``stages - 1`` rows per row unit in flight through shared
memory (16-byte-aligned rows only). ``heuristic(problem)`` picks one; ``space(problem)`` lists the
valid ones for a tuner; ``NormConfig.defines(problem)`` gives the ``-D`` values.

How the heuristic splits a row: each thread should hold about 32 elements in the forward pass
(16 in the backward pass, which also keeps dW/dB accumulators in registers). Rows up to 32 such
chunks (1024 forward, 512 backward) get a warp each, 8 rows per 256-thread block. Longer rows get
a block of 128..512 threads, and when 512 threads are not enough, a cluster of 2..8 blocks
reducing through distributed shared memory (forward: 1024 threads per block when a cluster of 8
of 512 is still not enough; backward: more elements per thread instead, since 1024 threads have
only 64 registers each for the dW/dB accumulators; LayerNorm backward at 262144 still spills).
The row is kept in registers when it fits the register budget; otherwise (fp32 at 262144, the
backward beyond 65536, the longest scalar rows) the later passes read it again.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Iterator

from custom_kernels.core.elements import FLOATS

REDUCE_SOURCE = "norms.cu"  # holds norm_dw_reduce, which both backward kernels use
# The norm kernels' element types by torch name (the tuning keys' form), from the one table.
DTYPE_CODES = {e.torch_name: e.code for e in FLOATS}
DTYPE_SIZES = {e.torch_name: e.bytes for e in FLOATS}
KINDS = ("rms", "ln")
DIRECTIONS = ("fwd", "bwd")
MIN_HIDDEN, MAX_HIDDEN = 1, 262144
THREAD_CHOICES = (64, 128, 256, 512, 1024)
CLUSTER_CHOICES = (1, 2, 4, 8, 16)  # 16 is a non-portable size (Hopper allows it on request)
# Lanes per row when a warp holds whole rows: fewer than 32 puts several short rows in one warp,
# each lane loading more of its row at once (the direct forward kernel only).
ROW_LANE_CHOICES = (8, 16, 32)
ROWS_PER_THREAD_CHOICES = (1, 2, 4)
_ELEMS_PER_THREAD = {"fwd": 32, "bwd": 16}
_MAX_ITERS = 64
_SMEM_LIMIT = 48 * 1024  # static + default dynamic shared memory without an opt-in
STAGED_SMEM_LIMIT = 227 * 1024  # the opt-in dynamic shared memory of a Hopper block
STAGE_CHOICES = (1, 2, 3, 4)
_STAGED_MAX_ITERS = 32
_BASE_REGS = 40  # kBaseRegs of norms_staged.cu


@dataclasses.dataclass(frozen=True)
class NormProblem:
    kind: str  # "rms" or "ln"
    direction: str  # "fwd" or "bwd"
    hidden: int
    dtype: str  # x, residual, dx
    out_dtype: str  # y, dy
    weight_dtype: str  # weight, bias, dweight, dbias
    aligned: bool = True  # 16-byte aligned pointers and hidden, strides multiples of the vector
    residual: bool = False  # forward: a residual to add; backward: a residual gradient to add

    def __post_init__(self):
        if self.kind not in KINDS or self.direction not in DIRECTIONS:
            raise ValueError(f"unknown norm kind/direction {self.kind!r}/{self.direction!r}")
        for dt in (self.dtype, self.out_dtype, self.weight_dtype):
            if dt not in DTYPE_CODES:
                raise ValueError(f"unsupported dtype {dt!r}; expected one of {list(DTYPE_CODES)}")
        if not MIN_HIDDEN <= self.hidden <= MAX_HIDDEN:
            raise ValueError(f"hidden {self.hidden} outside {MIN_HIDDEN}..{MAX_HIDDEN}")

    @property
    def vec(self) -> int:
        """Elements per 16-byte access of x; 1 on the scalar path."""
        return 16 // DTYPE_SIZES[self.dtype] if self.aligned else 1

    @property
    def name(self) -> str:
        """A stable key (the tuning cache's): ``norm-rms-fwd-h4096-bfloat16-bfloat16-bfloat16``
        with ``-scalar`` and ``-residual`` suffixes."""
        name = (f"norm-{self.kind}-{self.direction}-h{self.hidden}-{self.dtype}-"
                f"{self.out_dtype}-{self.weight_dtype}")
        return name + ("-scalar" if not self.aligned else "") + \
            ("-residual" if self.residual else "")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "NormProblem":
        return cls(**{f.name: data[f.name] for f in dataclasses.fields(cls) if f.name in data})


@dataclasses.dataclass(frozen=True)
class NormConfig:
    threads: int
    rows_per_block: int
    cluster: int
    vec: int
    stages: int = 0  # 0: the direct kernel (norms.cu); >= 1: the staged kernel (norms_staged.cu)
    rows_per_thread: int = 1  # > 1: the direct forward kernel, a warp or less per row
    # The persistent staged forward with a block (cluster) per row: the weight, unless it fits
    # registers, and the bias in shared memory, copied once per block instead of read from L2
    # for every row.
    param_smem: bool = False

    @property
    def source(self) -> str:
        return "norms_staged.cu" if self.stages else "norms.cu"

    def kernel_name(self, direction: str) -> str:
        return f"norm_{direction}" + ("_staged" if self.stages else "")

    @property
    def warp_per_row(self) -> bool:
        """Rows of a warp or less (``threads_per_row`` lanes each), not of a block."""
        return self.rows_per_block > 1 or self.threads == 32

    @property
    def threads_per_row(self) -> int:
        return self.threads // self.rows_per_block

    @property
    def rows_per_launch_unit(self) -> int:
        """Rows a block (a cluster) covers at once: rows per block x rows per thread."""
        return self.rows_per_block * self.rows_per_thread

    @property
    def name(self) -> str:
        """``t128_r8_c1_v8``, with ``_s3`` (stages), ``_m`` (parameters in shared memory) or
        ``_p4`` (rows per thread) when not 0 / False / 1."""
        name = f"t{self.threads}_r{self.rows_per_block}_c{self.cluster}_v{self.vec}"
        return name + (f"_s{self.stages}" if self.stages else "") + \
            ("_m" if self.param_smem else "") + \
            (f"_p{self.rows_per_thread}" if self.rows_per_thread != 1 else "")

    @classmethod
    def from_name(cls, name: str) -> "NormConfig":
        parts = name.split("_")
        fields = {"t": "threads", "r": "rows_per_block", "c": "cluster", "v": "vec"}
        try:
            if len(parts) < 4 or [p[:1] for p in parts[:4]] != list(fields):
                raise ValueError
            values = {fields[p[0]]: int(p[1:]) for p in parts[:4]}
            rest = parts[4:]
            for key, field in (("s", "stages"), ("m", "param_smem"), ("p", "rows_per_thread")):
                if rest and rest[0][:1] == key:  # in this order
                    token = rest.pop(0)
                    if field == "param_smem":
                        if token != "m":
                            raise ValueError
                        values[field] = True
                    else:
                        values[field] = int(token[1:])
            if rest:
                raise ValueError
        except (ValueError, IndexError):
            raise ValueError(f"not a norm config name: {name!r} (expected t256_r8_c1_v8, "
                             "t256_r8_c1_v8_s3, t512_r1_c8_v8_s2_m or t32_r1_c1_v8_p4)") from None
        return cls(**values)

    def iters(self, hidden: int) -> int:
        """Vector accesses per thread to cover a row."""
        return math.ceil(hidden / (self.threads_per_row * self.cluster * self.vec))

    def cache(self, problem: NormProblem) -> bool:
        """Direct kernel: whether the row fits the register budget (else later passes read it
        again). The staged kernel keeps it in shared memory."""
        if self.stages:
            return True
        budget = 32 if self.threads <= 512 else 16
        iters = self.iters(problem.hidden) * self.rows_per_thread
        regs = _regs(self.vec, problem.dtype)
        if problem.direction == "bwd":
            regs += _regs(self.vec, problem.out_dtype)
            # The dW (and dB) accumulators live in registers too.
            accumulators = iters * self.vec * (2 if problem.kind == "ln" else 1)
            budget = budget if accumulators <= 32 else budget // 2
        return iters * regs <= budget

    def shared_mem(self, problem: NormProblem) -> int:
        """Dynamic shared memory of a block: the backward warp-per-row partials, and the
        staged kernel's stages (norms_staged.cu's header gives the layout)."""
        residual = problem.residual
        partials = (self.rows_per_block * problem.hidden * 4
                    if problem.direction == "bwd" and self.warp_per_row else 0)
        if not self.stages:
            return partials
        slots = self.stages * self.rows_per_block * self.iters(problem.hidden) \
            * self.threads_per_row
        x_vec = self.vec * DTYPE_SIZES[problem.dtype]
        if problem.direction == "fwd":
            params = self.params_in_smem(problem) * self.iters(problem.hidden) * self.threads \
                * self.vec * DTYPE_SIZES[problem.weight_dtype]
            # LayerNorm's shift slots: 4 bytes of x's (and the residual's) row start per stage
            # and thread
            shifts = self.stages * self.threads * 4 * (2 if residual else 1) \
                if problem.kind == "ln" else 0
            return slots * x_vec * (2 if residual else 1) + params + shifts
        dy_vec = self.vec * DTYPE_SIZES[problem.out_dtype]
        stats = (self.stages * (self.threads // 32) + 1) // 2 * 2 * 8
        staged = stats + slots * (x_vec + dy_vec + (x_vec if residual else 0))
        return max(staged, partials)

    def params_in_smem(self, problem: NormProblem) -> int:
        """How many of the forward's parameter vectors (weight, bias) a ``param_smem`` config
        keeps in shared memory: the bias, and the weight unless its registers fit RMSNorm's
        rule of norms_staged.cu (at most 32, beside the kernel's base registers)."""
        if not (self.param_smem and self.stages and problem.direction == "fwd"):
            return 0
        weight_regs = self.iters(problem.hidden) * max(
            1, self.vec * DTYPE_SIZES[problem.weight_dtype] // 4)
        weight_in_regs = weight_regs <= 32 and \
            _BASE_REGS + weight_regs <= min(255, 65536 // self.threads)
        return (0 if weight_in_regs else 1) + (1 if problem.kind == "ln" else 0)

    def registers_needed(self, problem: NormProblem) -> int:
        """The staged backward's estimate: base registers plus the dW/dB accumulators."""
        acc_rows = 2 if problem.kind == "ln" else 1
        extra = acc_rows * self.iters(problem.hidden) * self.vec if problem.direction == "bwd" \
            else 0
        return _BASE_REGS + extra

    def why_invalid(self, problem: NormProblem) -> str | None:
        if self.threads not in THREAD_CHOICES:
            return f"threads {self.threads} not in {THREAD_CHOICES}"
        if self.rows_per_block != 1 and (self.threads % self.rows_per_block or
                                         self.threads_per_row not in ROW_LANE_CHOICES):
            return f"rows per block must be 1 or one per {ROW_LANE_CHOICES} lanes"
        if self.threads_per_row < 32 and (self.stages or problem.direction == "bwd"):
            return "several rows per warp only in the direct forward kernel"
        if self.rows_per_thread not in ROWS_PER_THREAD_CHOICES:
            return f"rows per thread {self.rows_per_thread} not in {ROWS_PER_THREAD_CHOICES}"
        if self.rows_per_thread > 1 and (self.stages or problem.direction == "bwd"
                                         or not self.warp_per_row or not self.cache(problem)):
            return ("several rows per thread only in the direct forward kernel, with a warp or "
                    "less per row kept in registers")
        if self.param_smem and (self.stages < 2 or problem.direction == "bwd"
                                or self.warp_per_row):
            return ("parameters in shared memory only in the persistent staged forward (2 or "
                    "more stages) with a block per row")
        if self.param_smem and self.params_in_smem(problem) == 0:
            return "parameters in shared memory: none to put there (the weight fits registers)"
        if self.cluster not in CLUSTER_CHOICES:
            return f"cluster {self.cluster} not in {CLUSTER_CHOICES}"
        if self.warp_per_row and self.cluster > 1:
            return "a warp per row takes no cluster"
        if self.vec not in (1, problem.vec):
            return f"vector width {self.vec} not allowed here (1 or {problem.vec})"
        if self.stages:
            why = self._why_invalid_staged(problem)
            if why:
                return why
        elif self.iters(problem.hidden) > _MAX_ITERS:
            return f"{self.iters(problem.hidden)} accesses per thread (max {_MAX_ITERS})"
        if self.threads_per_row * self.cluster * self.vec > 2 * problem.hidden and (
                self.cluster > 1 or not self.warp_per_row):
            return "more than half of the threads would idle"
        limit = STAGED_SMEM_LIMIT if self.stages else _SMEM_LIMIT
        if self.shared_mem(problem) > limit:
            return f"needs {self.shared_mem(problem)} bytes of shared memory (max {limit})"
        return None

    def _why_invalid_staged(self, problem: NormProblem) -> str | None:
        if self.stages not in STAGE_CHOICES:
            return f"stages {self.stages} not in {STAGE_CHOICES}"
        if not problem.aligned or self.vec != problem.vec:
            return "the staged kernel needs 16-byte vectors (aligned rows)"
        if self.iters(problem.hidden) > _STAGED_MAX_ITERS:
            return (f"{self.iters(problem.hidden)} vectors per thread "
                    f"(max {_STAGED_MAX_ITERS} staged)")
        max_regs = min(255, 65536 // self.threads)
        if self.registers_needed(problem) > max_regs:
            return (f"about {self.registers_needed(problem)} registers per thread needed, "
                    f"{max_regs} available at {self.threads} threads (it would spill)")
        return None

    def _caps_registers(self, problem: NormProblem) -> bool:
        """The direct forward with 16 lanes a row and at most 2 vectors a lane, all operands of
        one width, runs with its registers capped at 32: it fits them without spilling (38-40
        uncapped), and 16 blocks of 128 threads an SM instead of 12 measured faster on short
        rows (docs/measurements.md). An fp32 output or weight with 16-bit input spills under the
        cap in LayerNorm, so mixed widths stay uncapped."""
        return (problem.direction == "fwd" and not self.stages
                and self.threads_per_row == 16 and self.rows_per_thread == 1
                and self.iters(problem.hidden) <= 2
                and DTYPE_SIZES[problem.dtype] == DTYPE_SIZES[problem.out_dtype]
                == DTYPE_SIZES[problem.weight_dtype])

    def defines(self, problem: NormProblem) -> dict[str, int]:
        why = self.why_invalid(problem)
        if why:
            raise ValueError(f"config {self.name} is invalid for {problem}: {why}")
        return {
            "NORM_IN": DTYPE_CODES[problem.dtype], "NORM_OUT": DTYPE_CODES[problem.out_dtype],
            "NORM_W": DTYPE_CODES[problem.weight_dtype], "NORM_LN": int(problem.kind == "ln"),
            "NORM_THREADS": self.threads, "NORM_WARP_PER_ROW": int(self.warp_per_row),
            "NORM_CLUSTER": self.cluster, "NORM_VEC": self.vec,
            "NORM_ITERS": self.iters(problem.hidden), "NORM_CACHE": int(self.cache(problem)),
            "NORM_PART": 0 if problem.direction == "fwd" else 1,
            **({"NORM_TPR": self.threads_per_row} if self.threads_per_row < 32 else {}),
            **({"NORM_RPT": self.rows_per_thread} if self.rows_per_thread > 1 else {}),
            **({"NORM_MAX_REGS": 32} if self._caps_registers(problem) else {}),
            **({"NORM_STAGES": self.stages, "NORM_RESIDUAL": int(problem.residual)}
               if self.stages else {}),
            **({"NORM_PARAM_SMEM": 1} if self.param_smem else {}),
        }


def _regs(vec: int, dtype: str) -> int:
    return max(1, vec * DTYPE_SIZES[dtype] // 4)


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def heuristic(problem: NormProblem) -> NormConfig:
    """Aligned rows: the staged kernel, or the direct one with 16-byte vectors for short
    forward rows. The direct kernel with scalar accesses otherwise, and where no staged split
    fits the shared memory (fp32 backward rows of 262144)."""
    if problem.aligned:
        config = _aligned_heuristic(problem)
        if config.why_invalid(problem) is None:
            return config
    return _direct_heuristic(problem)


def _aligned_heuristic(problem: NormProblem) -> NormConfig:
    """Rules read off a sweep of the whole space on an H200 (bf16, 32768 rows; in vectors of 16
    bytes, so they carry over to other dtypes); the numbers are in docs/measurements.md."""
    vec = problem.vec
    vectors = math.ceil(problem.hidden / vec)
    if problem.direction == "fwd" and problem.kind == "ln":
        # LayerNorm. Short rows: the direct kernel (registers only, not persistent), 16 lanes
        # a row up to half a vector a lane (faster than persistent grids with rows in flight),
        # a warp a row up to 4 vectors a lane. Then one stage, not persistent (more blocks per SM
        # cover each block's barriers; swept when the statistics took two reductions a row,
        # not again since they take one), 4 vectors a thread, then clusters of 512-thread
        # blocks with 8; except rows of more than 2048 vectors (below).
        if vectors <= 32:
            return NormConfig(128, 8, 1, vec)
        if vectors <= 128:
            return NormConfig(64, 2, 1, vec)
        if vectors <= 1024:
            return _fit(NormConfig(max(64, _next_pow2(math.ceil(vectors / 4))), 1, 1, vec, 1),
                        problem)
        cluster = min(16, _next_pow2(math.ceil(vectors / (512 * 8))))
        if vectors > 2048:
            # Persistent with 2 stages, the bias in shared memory and the weight in registers
            # (1024 threads a row up to 4096 vectors, then clusters of 512): the one-stage
            # split below reads both from L2 for every row, and its speed depends on where they
            # sit; this one is faster at the worst placement and steadier across them
            # (docs/measurements.md, "Norm kernels: long rows"). Where it does not fit (a
            # residual stream doubles the stages) or would take a cluster of 16 (fp32 at
            # 262144: not measured persistent), the rule below.
            in_smem = NormConfig(1024, 1, 1, vec, 2, param_smem=True) if vectors <= 4096 \
                else NormConfig(512, 1, cluster, vec, 2, param_smem=True)
            if cluster <= 8 and in_smem.why_invalid(problem) is None:
                return in_smem
        return _fit(NormConfig(512, 1, cluster, vec, 1), problem)
    if problem.direction == "fwd":
        # The direct kernel (registers only, not persistent) for short rows: 16 lanes a row up
        # to half a vector a lane, a warp a row up to 4 vectors a lane; on short rows it beats
        # both the persistent grid and one stage through shared memory (docs/measurements.md).
        if vectors <= 32:
            return NormConfig(128, 8, 1, vec)
        if vectors <= 128:
            return NormConfig(64, 2, 1, vec)
        if vectors <= 1024:  # a block per row, not persistent: the block scheduler overlaps rows
            return _fit(NormConfig(256, 1, 1, vec, 1), problem)
        if vectors <= 4096:
            return _fit(NormConfig(1024, 1, 1, vec, 2), problem)
        threads, per_thread = 512, 8
    else:
        if vectors <= 32:
            return _fit(NormConfig(512, 16, 1, vec, 3), problem)
        if vectors <= 128:
            return _fit(NormConfig(256, 8, 1, vec, 2), problem)
        if vectors <= 1024:  # a vector per thread, 2 stages
            return _fit(NormConfig(max(128, _next_pow2(vectors)), 1, 1, vec, 2), problem)
        threads, per_thread = 512, 4  # the dW accumulators take registers: fewer per thread
    cluster = min(16, _next_pow2(math.ceil(vectors / (threads * per_thread))))
    return _fit(NormConfig(threads, 1, cluster, vec, 3 if problem.direction == "bwd" else 2),
                problem)


def _fit(config: NormConfig, problem: NormProblem) -> NormConfig:
    """``config``, or the nearest valid one: fewer stages (down to 2), then a larger cluster
    (the same row over more blocks takes less shared memory in each), then 1 stage."""
    clusters = [c for c in CLUSTER_CHOICES if c >= config.cluster] if not config.warp_per_row \
        else [1]
    tries = [(c, s) for c in clusters for s in range(config.stages, 1, -1)]
    tries += [(c, 1) for c in clusters]
    for cluster, stages in tries:
        candidate = dataclasses.replace(config, cluster=cluster, stages=stages)
        if candidate.why_invalid(problem) is None:
            return candidate
    return config  # invalid: heuristic() falls back to the direct kernel


def _direct_heuristic(problem: NormProblem) -> NormConfig:
    vec = problem.vec
    per_thread = _ELEMS_PER_THREAD[problem.direction]
    if problem.hidden <= 32 * per_thread:
        return NormConfig(256, 8, 1, vec)
    needed = math.ceil(problem.hidden / per_thread)
    threads = min(512, max(128, _next_pow2(needed)))
    cluster = 1
    if needed > 512:
        cluster = _next_pow2(math.ceil(needed / 512))
        # Forward: 1024 threads hold the longest rows in registers. Backward: 1024 threads
        # (64 registers each) spill the dW/dB accumulators, so 512 threads take more elements.
        if cluster > 8:
            cluster = 8
            if problem.direction == "fwd":
                threads = 1024
    return NormConfig(threads, 1, cluster, vec)


def space(problem: NormProblem) -> Iterator[NormConfig]:
    """Every valid config (direct and staged), the heuristic's choice first."""
    first = heuristic(problem)
    yield first
    for threads in THREAD_CHOICES:
        for rows in sorted({1} | {threads // lanes for lanes in ROW_LANE_CHOICES
                                  if threads >= lanes}):
            for cluster in CLUSTER_CHOICES:
                for vec in sorted({1, problem.vec}):
                    for stages in (0, *STAGE_CHOICES):
                        for per_thread in ROWS_PER_THREAD_CHOICES:
                            for param_smem in (False, True):
                                config = NormConfig(threads, rows, cluster, vec, stages,
                                                    per_thread, param_smem)
                                if config != first and config.why_invalid(problem) is None:
                                    yield config


def reduce_defines(weight_dtype: str) -> dict[str, int]:
    """-D values of the dW/dB reduction kernel (it depends on the weight type only)."""
    return {"NORM_W": DTYPE_CODES[weight_dtype], "NORM_PART": 2}
