"""benchmarks/e2e.py's peak memory rows on a CPU, with a fake ``torch.cuda`` allocator: each
variant's peak is its own train step's (the peak reset before it, the other variants' weights
and eager's kept gradients left out), and a row says when both peaks are the floor that every
variant of the same weights shares (parameters plus gradients: the 2-layer runs' 5.96 GB).

The fake allocator counts what the fake models say they hold: their parameters (for their
lifetime), their activations (from the forward until the backward), their gradients (from
accumulation until the tensor is freed, so that eager's gradients kept by ``measure_train``
stay counted). Its ``max_memory_allocated`` moves only by allocations or by
``reset_peak_memory_stats``: a reset left out, or done in the wrong place, shows."""

import sys
import weakref
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from benchmarks import e2e  # noqa: E402

NUMEL = 1000  # each fake model's bf16 parameter: 2000 bytes, and as many for its gradient
PARAMETERS = 2 * NUMEL


class FakeAllocator:
    """``torch.cuda``'s memory figures, counting what ``alloc`` / ``free`` say."""

    def __init__(self):
        self.allocated = self.peak = 0
        self.resets = 0

    def alloc(self, n: int) -> None:
        self.allocated += n
        self.peak = max(self.peak, self.allocated)

    def free(self, n: int) -> None:
        self.allocated -= n

    def memory_allocated(self, device=None) -> int:
        return self.allocated

    def max_memory_allocated(self, device=None) -> int:
        return self.peak

    def reset_peak_memory_stats(self, device=None) -> None:
        self.resets += 1
        self.peak = self.allocated

    def synchronize(self, device=None) -> None:
        pass


class _Activations(torch.autograd.Function):
    """A loss whose forward holds ``activations`` bytes until its backward."""

    @staticmethod
    def forward(ctx, weight, memory, activations):
        memory.alloc(activations)
        ctx.memory, ctx.activations = memory, activations
        return weight.float().sum() * 0 + 5.0

    @staticmethod
    def backward(ctx, grad):
        ctx.memory.free(ctx.activations)
        return torch.ones(NUMEL, dtype=torch.bfloat16) * grad, None, None


class FakeModel(torch.nn.Module):
    """A "model" as measure_train calls it (``model(input_ids=, labels=).loss``) whose step
    holds ``activations`` bytes at the end of its forward, then its gradient (as many bytes as
    its parameter) at the end of its backward."""

    def __init__(self, memory: FakeAllocator, activations: int):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(NUMEL, dtype=torch.bfloat16))
        memory.alloc(PARAMETERS)
        self.memory, self.activations = memory, activations

        def gradient_written(parameter):
            memory.alloc(PARAMETERS)
            weakref.finalize(parameter.grad, memory.free, PARAMETERS)
        self.weight.register_post_accumulate_grad_hook(gradient_written)

    def forward(self, input_ids=None, labels=None):
        return SimpleNamespace(loss=_Activations.apply(self.weight, self.memory,
                                                       self.activations))


@pytest.fixture
def memory(monkeypatch):
    fake = FakeAllocator()
    for name in ("memory_allocated", "max_memory_allocated", "reset_peak_memory_stats",
                 "synchronize"):
        monkeypatch.setattr(torch.cuda, name, getattr(fake, name))

    def bench(fns, **_):
        for fn in fns.values():
            fn()
        return {k: SimpleNamespace(median_ms=10.0) for k in fns}
    monkeypatch.setattr(e2e, "do_bench_interleaved", bench)
    return fake


def measure(memory, activations: dict) -> dict:
    """measure_train over fake models (every one resident, as in e2e.py) with these
    activations."""
    variants = {name: FakeModel(memory, a) for name, a in activations.items()}
    return e2e.measure_train(variants, torch.zeros(1, 8, dtype=torch.long), reps=2)


# eager, ours and an FP8 recipe: the peak is the larger of parameters + activations (the
# forward's end) and parameters + gradient (the backward's end).
ACTIVATION_BOUND = {"eager": 5000, "ours": 3000, "ours fp8 rowwise": 1000}
EXPECTED = {"eager": 7000, "ours": 5000, "ours fp8 rowwise": 4000}


def test_each_variant_s_peak_is_its_own_step_s(memory):
    train = measure(memory, ACTIVATION_BOUND)
    for name, peak in EXPECTED.items():
        m = train[name]["memory"]
        assert train[name]["peak_gb"] == pytest.approx(peak / 1e9), name
        assert m["parameters_gb"] == pytest.approx(PARAMETERS / 1e9)
        assert m["gradients_gb"] == pytest.approx(PARAMETERS / 1e9)
        assert m["forward_peak_gb"] == pytest.approx(
            (PARAMETERS + ACTIVATION_BOUND[name]) / 1e9), name
        assert m["above_parameters_and_gradients_gb"] == pytest.approx(
            (peak - 2 * PARAMETERS) / 1e9), name
    assert train["ours"]["check"].ok
    row = e2e.memory_row(train["ours"], train["eager"], "eager", True)
    assert row["ratio"] == round(7000 / 5000, 4) and "at_the_floor" not in row["detail"]
    assert set(row["detail"]["ours_memory"]) == set(row["detail"]["reference_memory"]) == {
        "peak_gb", "parameters_gb", "gradients_gb", "above_parameters_and_gradients_gb",
        "forward_peak_gb"}
    assert row["detail"]["forward_peak_ratio"] == round(7000 / 5000, 4)


def test_a_broken_reset_is_caught(memory, monkeypatch):
    """The same measurement with the reset doing nothing: the allocator's peak is the run's
    (eager's first step, with the models all resident), the same for every variant."""
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: None)
    train = measure(memory, ACTIVATION_BOUND)
    peaks = {name: round(train[name]["peak_gb"] * 1e9) for name in EXPECTED}
    assert peaks != EXPECTED
    assert len(set(peaks.values())) == 1  # what test_each_variant_s_peak_is_its_own_step_s
    # rules out: one figure for every variant


def test_equal_peaks_at_the_floor_say_so_and_keep_the_forward_apart(memory):
    """The 2-layer runs' case: activations below the gradients, so every variant's peak is its
    parameters plus gradients, and the row says so; the forward peaks still differ."""
    train = measure(memory, {"eager": 1500, "ours": 1000})
    assert train["eager"]["peak_gb"] == train["ours"]["peak_gb"] == pytest.approx(4000 / 1e9)
    row = e2e.memory_row(train["ours"], train["eager"], "eager", True)
    assert row["ratio"] == 1.0 and "parameters plus gradients" in row["detail"]["at_the_floor"]
    assert row["detail"]["forward_peak_ratio"] == round(3500 / 3000, 4)


def test_rows_without_a_breakdown_keep_their_figures():
    ours, ref = {"peak_gb": 2.0}, {"peak_gb": 3.0}
    row = e2e.memory_row(ours, ref, "eager", True)
    assert row["detail"] == {"ours_gb": 2.0, "reference_gb": 3.0} and row["ratio"] == 1.5
