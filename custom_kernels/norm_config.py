"""Launch configurations of the fused norm kernels (``csrc/norms.cu``): pure data, no torch.

A ``NormProblem`` names what changes the compiled kernel (norm kind, direction, hidden size,
dtypes, whether the 16-byte vector path is allowed); a ``NormConfig`` names how a row is split:
threads per block, rows per block (1, or one row per warp), thread block cluster size and vector
width. ``heuristic(problem)`` picks one; ``space(problem)`` lists the valid ones for a tuner;
``NormConfig.defines(problem)`` gives the ``-D`` values of norms.cu.

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

DTYPE_CODES = {"float32": 0, "float16": 1, "bfloat16": 2}
DTYPE_SIZES = {"float32": 4, "float16": 2, "bfloat16": 2}
KINDS = ("rms", "ln")
DIRECTIONS = ("fwd", "bwd")
MIN_HIDDEN, MAX_HIDDEN = 1, 262144
THREAD_CHOICES = (64, 128, 256, 512, 1024)
CLUSTER_CHOICES = (1, 2, 4, 8)  # portable cluster sizes
_ELEMS_PER_THREAD = {"fwd": 32, "bwd": 16}
_MAX_ITERS = 64
_SMEM_LIMIT = 48 * 1024  # static + default dynamic shared memory without an opt-in


@dataclasses.dataclass(frozen=True)
class NormProblem:
    kind: str  # "rms" or "ln"
    direction: str  # "fwd" or "bwd"
    hidden: int
    dtype: str  # x, residual, dx
    out_dtype: str  # y, dy
    weight_dtype: str  # weight, bias, dweight, dbias
    aligned: bool = True  # 16-byte aligned pointers and hidden, strides multiples of the vector

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


@dataclasses.dataclass(frozen=True)
class NormConfig:
    threads: int
    rows_per_block: int
    cluster: int
    vec: int

    @property
    def warp_per_row(self) -> bool:
        return self.rows_per_block > 1 or self.threads == 32

    @property
    def threads_per_row(self) -> int:
        return 32 if self.warp_per_row else self.threads

    @property
    def name(self) -> str:
        return f"t{self.threads}_r{self.rows_per_block}_c{self.cluster}_v{self.vec}"

    @classmethod
    def from_name(cls, name: str) -> "NormConfig":
        try:
            t, r, c, v = (int(part[1:]) for part in name.split("_"))
        except ValueError:
            raise ValueError(f"not a norm config name: {name!r} (expected t256_r8_c1_v8)") from None
        return cls(t, r, c, v)

    def iters(self, hidden: int) -> int:
        """Vector accesses per thread to cover a row."""
        return math.ceil(hidden / (self.threads_per_row * self.cluster * self.vec))

    def cache(self, problem: NormProblem) -> bool:
        """Whether the row fits the register budget (else later passes read it again)."""
        budget = 32 if self.threads <= 512 else 16
        iters = self.iters(problem.hidden)
        regs = _regs(self.vec, problem.dtype)
        if problem.direction == "bwd":
            regs += _regs(self.vec, problem.out_dtype)
            # The dW (and dB) accumulators live in registers too.
            accumulators = iters * self.vec * (2 if problem.kind == "ln" else 1)
            budget = budget if accumulators <= 32 else budget // 2
        return iters * regs <= budget

    def shared_mem(self, problem: NormProblem) -> int:
        """Dynamic shared memory: the backward warp-per-row partials."""
        if problem.direction == "bwd" and self.warp_per_row:
            return self.rows_per_block * problem.hidden * 4
        return 0

    def why_invalid(self, problem: NormProblem) -> str | None:
        if self.threads not in THREAD_CHOICES:
            return f"threads {self.threads} not in {THREAD_CHOICES}"
        if self.rows_per_block not in (1, self.threads // 32):
            return "rows per block must be 1 or one per warp"
        if self.cluster not in CLUSTER_CHOICES:
            return f"cluster {self.cluster} not in {CLUSTER_CHOICES}"
        if self.warp_per_row and self.cluster > 1:
            return "a warp per row takes no cluster"
        if self.vec not in (1, problem.vec):
            return f"vector width {self.vec} not allowed here (1 or {problem.vec})"
        if self.iters(problem.hidden) > _MAX_ITERS:
            return f"{self.iters(problem.hidden)} accesses per thread (max {_MAX_ITERS})"
        if self.threads_per_row * self.cluster * self.vec > 2 * problem.hidden and (
                self.cluster > 1 or not self.warp_per_row):
            return "more than half of the threads would idle"
        if self.shared_mem(problem) > _SMEM_LIMIT:
            return f"needs {self.shared_mem(problem)} bytes of shared memory"
        return None

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
        }


def _regs(vec: int, dtype: str) -> int:
    return max(1, vec * DTYPE_SIZES[dtype] // 4)


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def heuristic(problem: NormProblem) -> NormConfig:
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
    """Every valid config, heuristic's choice first."""
    first = heuristic(problem)
    yield first
    for threads in THREAD_CHOICES:
        for rows in sorted({1, threads // 32}):
            for cluster in CLUSTER_CHOICES:
                for vec in sorted({1, problem.vec}):
                    config = NormConfig(threads, rows, cluster, vec)
                    if config != first and config.why_invalid(problem) is None:
                        yield config


def reduce_defines(weight_dtype: str) -> dict[str, int]:
    """-D values of the dW/dB reduction kernel (it depends on the weight type only)."""
    return {"NORM_W": DTYPE_CODES[weight_dtype], "NORM_PART": 2}
