"""A fake GEMM tuning backend for CPU tests: builds and timings are made up (from our model), so
the search's logic (ranking, the tuner protocol's rounds, failures, budgets, the cache) runs
without a GPU. ``FakeSession`` is a ``tuning.protocol.Session``."""

from __future__ import annotations

import dataclasses

from custom_kernels.core.errors import BuildError
from cutlass_ops.gemms import ranking as model
from custom_kernels.core.tuned_store import CacheScope
from custom_kernels.core.device import named_spec
from tuning.timing import GraphCaptureError

SCOPE = CacheScope("NVIDIA H100 80GB HBM3", 90, 132, "580.0", "13.0", "4.2.0.0", "test")


@dataclasses.dataclass
class FakeArtifact:
    seconds: float


@dataclasses.dataclass
class FakeSpec:
    name: str


class FakeSession:
    def __init__(self, backend, problem):
        self.backend, self.problem = backend, problem

    def verify(self, choice):
        self.backend.verified.append(choice)
        if self.backend.wrong(choice):
            return "wrong result: relative error 0.5 > 0.01"
        return None

    def time_ms(self, choice, reps):
        if self.backend.uncapturable(choice):
            raise GraphCaptureError("could not capture the timed call in a CUDA graph: fake")
        self.backend.timed.append(choice)
        if self.backend.interrupt_after is not None and \
                len(self.backend.timed) > self.backend.interrupt_after:
            raise KeyboardInterrupt
        if choice.backend == "dsl":  # a DSL kernel: torch's time scaled by its place in the list
            from cutlass_ops.gemms.dsl import SM90_CONFIGS, SMALL_CONFIGS

            return self.torch_ms(reps) * (self.backend.dsl_factor
                                          + 1e-4 * (SM90_CONFIGS + SMALL_CONFIGS).index(choice))
        if choice.backend == "skinny":  # the few-rows FP8 kernel: torch's time, scaled
            ranks = (choice.bm, choice.splits, choice.stages)
            return self.torch_ms(reps) * (self.backend.skinny_factor + 1e-4 * sum(ranks))
        penalty = 1.0 + 0.01 * choice.config.swizzle  # deterministic, distinct per variant
        return model.estimate_us(self.problem, choice, named_spec("H100")) / 1000 * penalty

    def torch_ms(self, reps):
        return model.estimate_us(self.problem, _reference_choice(), named_spec("H100")) / 1000

    def compare_ms(self, choices, reps):
        return {c: self.time_ms(c, reps) for c in choices}, self.torch_ms(reps)

    def close(self):
        pass


def _reference_choice():
    from cutlass_ops.gemms.config import GemmConfig
    from cutlass_ops.gemms.choice import Choice

    return Choice(GemmConfig(kernel_schedule="cooperative", tile=(128, 128, 64)))


class FakeBackend:
    """Builds fail for tile N = 192, choices with cluster 4x1x1 compute wrong results; a test
    may make choices uncapturable in a CUDA graph (``uncapturable``)."""

    jobs = 4

    def __init__(self, interrupt_after=None):
        self.built, self.verified, self.timed = [], [], []
        self.interrupt_after = interrupt_after
        self.build_calls = 0

    def device(self):
        return named_spec("H100")

    def scope(self):
        return SCOPE

    dsl_factor = 1.2  # DSL kernels' time over torch's (a test makes them win by lowering it)
    skinny_factor = 1.3  # the skinny FP8 kernel's, likewise

    def wrong(self, choice):
        return choice.backend == "cutlass" and choice.config.cluster == (4, 1, 1)

    def uncapturable(self, choice):
        return False

    def build(self, items, *, on_done=None):
        self.build_calls += 1
        out = {}
        for operands, config in items:
            result = (BuildError(config.build_name, "/nonexistent/build.log", "error: fake")
                      if config.tile[1] == 192 else FakeArtifact(1.0))
            self.built.append((operands, config))
            out[(operands, config)] = result
            if on_done:
                on_done(FakeSpec(f"{operands.name}-{config.build_name}"), result)
        return out

    def session(self, problem):
        return FakeSession(self, problem)


def stored(cache, problem):
    """What the store holds for ``problem`` as the tuner wrote it (the record's stored form,
    every field its schema accepted), or None."""
    entry = cache.get(problem)
    return None if entry is None else entry.to_dict()
