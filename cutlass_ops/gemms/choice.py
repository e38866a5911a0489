"""What the tuner chooses between: a kernel config, and whether to run the problem transposed.

Swap-A/B computes D^T = B^T A^T instead of D = A B. The memory is the same (a row-major D is a
column-major D^T), so it costs nothing but changes which extent fills the CTA tile's M: for a
small M (decode, small batches) the large N then fills the 64 or 128 rows of a wgmma tile that M
would leave mostly empty. It is how cuBLAS and CUTLASS's maintainers handle skinny GEMMs. ``Choice.orient`` is the one
place the swap is written for tensors: dispatch and the tuner (through ``plan_choice``) both run
a choice through it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from cutlass_ops.gemms.config import Activation, GemmConfig, GemmOperands, GemmProblem, Scaling
from cutlass_ops.gemms.inputs import CheckedGemm, transposed_layout as _flip


def swapped_operands(operands: GemmOperands) -> GemmOperands:
    """The operands of D^T = B^T A^T: A and B trade places, transposing flips every layout, and a
    fused bias changes the extent it runs along. Scaled FP8 operands have no swapped form
    (``ranking.orientations`` offers none)."""
    if operands.scaling is not Scaling.NONE:
        raise ValueError(f"{operands.name}: scaled FP8 GEMMs run unswapped")
    return GemmOperands(
        element_a=operands.element_b, element_b=operands.element_a,
        element_c=operands.element_c, element_d=operands.element_d,
        element_accumulator=operands.element_accumulator,
        layout_a=_flip(operands.layout_b), layout_b=_flip(operands.layout_a),
        layout_c=_flip(operands.layout_c),
        alignment_a=operands.alignment_b, alignment_b=operands.alignment_a,
        alignment_c=operands.alignment_c,
        # A bias along N (nn.Linear's) runs along the rows of D^T.
        epilogue=operands.epilogue.transposed())


@dataclasses.dataclass(frozen=True)
class Choice:
    """One candidate: a config, run on the problem as given or swapped."""

    config: GemmConfig
    swap_ab: bool = False

    @property
    def name(self) -> str:
        return ("swap:" if self.swap_ab else "") + self.config.name

    @property
    def backend(self) -> str:
        """Which CUTLASS path builds it: "cutlass" (C++ through nvcc) here, "dsl" for a
        ``cutlass_ops.gemms.dsl.DslConfig``."""
        return "cutlass"

    def operands_for(self, operands: GemmOperands) -> GemmOperands:
        """The operands the kernel is compiled for."""
        return swapped_operands(operands) if self.swap_ab else operands

    def problem_for(self, problem: GemmProblem) -> GemmProblem:
        """The GEMM the kernel computes: M and N trade places when swapped."""
        if not self.swap_ab:
            return problem
        return GemmProblem(swapped_operands(problem.operands), problem.n, problem.m, problem.k,
                           problem.batch)

    def orient(self, checked: CheckedGemm) -> CheckedGemm:
        """The checked problem the kernel computes: as given, or swapped, with A and B trading
        places as each other's transposes and C and D read through their transposed views. The
        memory is the same, so nothing needs checking again."""
        if not self.swap_ab or checked.problem is None:
            return checked
        views = checked.views
        swapped = {"A": views["B"].transposed(), "B": views["A"].transposed(),
                   "out": views["out"].transposed()}
        if "C" in views:
            swapped["C"] = views["C"].transposed()
        return dataclasses.replace(checked, problem=self.problem_for(checked.problem),
                                   views=swapped)

    def replace(self, **changes: Any) -> Choice:
        return Choice(self.config.replace(**changes), self.swap_ab)

    def to_dict(self) -> dict[str, Any]:
        return {"config": self.config.to_dict(), "swap_ab": self.swap_ab}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Choice:
        return cls(GemmConfig.from_dict(data["config"]), bool(data.get("swap_ab", False)))

    @classmethod
    def from_name(cls, name: str) -> Choice:
        swap = name.startswith("swap:")
        return cls(GemmConfig.from_name(name.removeprefix("swap:")), swap)


def candidate_from_dict(data: dict[str, Any]):
    """A tuning entry's winner as the tuner stored it: a C++ kernel's ``Choice``, a DSL
    kernel's ``DslConfig`` (``"backend": "dsl"``) or the few-rows FP8 kernel's ``SkinnyConfig``
    (``"backend": "skinny"``)."""
    if data.get("backend") == "dsl":
        from cutlass_ops.gemms.dsl import DslConfig

        return DslConfig.from_dict(data)
    if data.get("backend") == "skinny":
        from custom_kernels.fp8.fp8_skinny import SkinnyConfig

        return SkinnyConfig.from_dict(data)
    return Choice.from_dict(data)


def plan_choice(choice: Choice, a, b, c=None, *, alpha: float = 1.0, beta: float = 0.0,
                bias=None, activation: Activation | str = Activation.IDENTITY, out=None,
                out_dtype=None) -> Callable[[], Any]:
    """``cutlass_ops.plan`` for a choice: the same checks, then its kernel on the problem as
    given or swapped (``Choice.orient``); ``launch()`` returns ``out`` either way."""
    from cutlass_ops.gemms import plan

    checked = plan.check(a, b, c, alpha=alpha, beta=beta, bias=bias, activation=activation,
                         out=out, out_dtype=out_dtype, config=choice.config)
    return plan.launcher(choice.orient(checked), choice.config)
