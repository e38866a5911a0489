import pytest
from tuning_fakes import SCOPE, FakeBackend, stored

from cutlass_ops.gemms.config import GemmOperands, GemmProblem
from cutlass_ops.gemms.gemm_entries import gemm_cache
from cutlass_ops.gemms.choice import Choice
from tuning.candidates import Strategy
from tuning.search import GemmFamily, tune

OPS = GemmOperands.make("bf16")


def problems():
    return [GemmProblem(OPS, 16, 4096, 4096), GemmProblem(OPS, 4096, 4096, 4096)]


def test_tune_stores_verified_winners_with_failures_and_runners_up(tmp_path):
    backend = FakeBackend()
    cache = gemm_cache(SCOPE, tmp_path)
    report = tune(problems(), backend=backend, strategy="default", cache=cache,
                  use_heuristics=False)
    assert [r.problem for r in report.results] == problems()
    for result in report.results:
        entry = stored(cache, result.problem)
        assert entry["complete"] and entry["winner"] and entry["torch_ms"] > 0
        winner = Choice.from_dict(entry["winner"])
        assert winner.config.cluster != (4, 1, 1)  # wrong results never win
        assert winner in backend.verified
        assert entry["winner_ms"] <= min(r["ms"] for r in entry["runners_up"])
        assert entry["prefer"] in ("cutlass", "torch")
        stages = {f["stage"] for f in entry["failures"]}
        assert stages <= {"build", "wrong result", "launch"}
    # Every variant that was timed was verified first.
    assert set(backend.timed) <= set(backend.verified)
    # One kernel serves every shape: nothing is built twice.
    assert len(backend.built) == len(set(backend.built))


def test_failures_are_results(tmp_path):
    backend = FakeBackend()
    backend.wrong = lambda choice: True  # nothing computes the right result
    cache = gemm_cache(SCOPE, tmp_path)
    tune(problems()[:1], backend=backend, cache=cache, strategy="quick", use_heuristics=False)
    entry = stored(cache, problems()[0])
    assert entry["winner"] is None and entry["prefer"] == "torch"
    assert entry["failures"] and all(f["stage"] in ("wrong result", "build")
                                     for f in entry["failures"])


def test_a_kernel_that_breaks_cuda_graph_capture_is_a_failure_not_a_winner(tmp_path):
    backend = FakeBackend()
    backend.uncapturable = lambda choice: choice.config.cluster == (2, 1, 1)  # the fake's best
    cache = gemm_cache(SCOPE, tmp_path)
    tune(problems()[:1], backend=backend, cache=cache, strategy="quick", use_heuristics=False)
    entry = stored(cache, problems()[0])
    assert entry["winner"] and Choice.from_dict(entry["winner"]).config.cluster != (2, 1, 1)
    captures = [f for f in entry["failures"] if f["stage"] == "capture"]
    assert captures and all("CUDA graph" in f["error"] for f in captures)


def test_second_tune_is_a_cache_hit_and_force_retunes(tmp_path):
    cache = gemm_cache(SCOPE, tmp_path)
    tune(problems(), backend=FakeBackend(), cache=cache, strategy="quick", use_heuristics=False)
    again = FakeBackend()
    report = tune(problems(), backend=again, cache=cache, strategy="quick", use_heuristics=False)
    assert all(r.cached for r in report.results) and not again.timed and not again.built
    forced = FakeBackend()
    tune(problems()[:1], backend=forced, cache=cache, strategy="quick", force=True,
         use_heuristics=False)
    assert forced.timed


def test_interrupted_tune_keeps_finished_shapes(tmp_path):
    cache = gemm_cache(SCOPE, tmp_path)
    first = FakeBackend()
    tune(problems()[:1], backend=first, cache=cache, strategy="quick", use_heuristics=False)
    per_problem = len(first.timed)
    backend = FakeBackend(interrupt_after=per_problem + 3)  # dies inside the second shape
    with pytest.raises(KeyboardInterrupt):
        tune(problems(), backend=backend, cache=cache, strategy="quick", force=True,
             use_heuristics=False)
    assert stored(cache, problems()[0]) is not None  # finished and stored before the interrupt
    assert stored(cache, problems()[1]) is None
    # The file is intact and a rerun finishes only what is missing.
    rerun = FakeBackend()
    report = tune(problems(), backend=rerun, cache=gemm_cache(SCOPE, tmp_path),
                  strategy="quick", use_heuristics=False)
    assert [r.cached for r in report.results] == [True, False]


def test_budget_stops_early_and_marks_incomplete(tmp_path):
    cache = gemm_cache(SCOPE, tmp_path)
    backend = FakeBackend()
    report = tune(problems(), backend=backend, cache=cache, strategy="default", budget_s=0.0,
                  use_heuristics=False, build_chunk=2)
    # The first chunk is always built so that something can be measured.
    assert backend.build_calls == 1
    entries = [stored(cache, p) for p in problems()]
    assert all(e is not None and e["complete"] is False for e in entries)
    # Each problem still measured what was built (a minimum share of time), and has a winner.
    assert all(e["winner"] and e["compiled_candidates"] >= 1 for e in entries)
    assert report.results


def test_progress_reports_builds_and_problems(tmp_path):
    events = []
    tune(problems(), backend=FakeBackend(), cache=gemm_cache(SCOPE, tmp_path),
         strategy="quick", use_heuristics=False, progress=lambda *e: events.append(e))
    builds = [e for e in events if e[0] == "build"]
    assert builds[-1][1] == builds[-1][2] > 0
    assert ("problem", 2, 2, problems()[1].name) in events


def test_one_tolerance_table_serves_every_family_and_dtype_spelling():
    import subprocess
    import sys

    import torch

    from cutlass_ops.gemms.config import DType
    from custom_kernels.core.tolerances import relative_tolerance

    spellings = [(DType.BF16, "bf16", "bfloat16", torch.bfloat16),
                 (DType.F16, "f16", "float16", torch.float16),
                 (DType.F32, "f32", "float32", torch.float32)]
    for family in ("gemm", "norms"):
        for names in spellings:
            assert len({relative_tolerance(name, family) for name in names}) == 1
    assert relative_tolerance(DType.BF16) == 1e-2  # the GEMM column by default
    # f32 GEMMs run as TF32; the norms compute in true float32.
    assert relative_tolerance("f32", "gemm") == 5e-3 > relative_tolerance("float32", "norms")
    with pytest.raises(ValueError, match="dtype"):
        relative_tolerance("int8")
    with pytest.raises(ValueError, match="family"):
        relative_tolerance("bf16", "conv")
    imported = subprocess.run(
        [sys.executable, "-c", "import sys, custom_kernels.core.tolerances, tuning.protocol; "
         "print('torch' in sys.modules)"], capture_output=True, text=True, check=True)
    assert imported.stdout.strip() == "False"


def test_check_fails_nan_and_errors_above_the_bound():
    import torch

    from tuning.protocol import check

    reference = torch.ones(4, 4)
    assert check([reference + 1e-3], [reference], 1e-2) is None
    assert check([reference, reference * 1.5], [reference, reference], 1e-2) == \
        "wrong result: relative error 0.5 > 0.01"
    unwritten = torch.full((4, 4), float("nan"))
    assert check([unwritten, reference], [reference, reference], 1e-2).endswith("nan > 0.01")
    assert check([reference, unwritten], [reference, reference], 1e-2).endswith("nan > 0.01")


def test_finalists_are_timed_each_beside_torch_and_the_best_ratio_wins(tmp_path):
    backend = FakeBackend()
    compared = []
    session = backend.session

    def recording_session(problem):
        s = session(problem)
        compare = s.compare_ms
        s.compare_ms = lambda choices, reps: compared.append((choices, reps)) or \
            compare(choices, reps)
        return s

    backend.session = recording_session
    cache = gemm_cache(SCOPE, tmp_path)
    tune(problems()[:1], backend=backend, cache=cache, strategy="default", use_heuristics=False)
    entry = stored(cache, problems()[0])
    # Rounds 1 and 2, each one group at the first round's repetitions; then the four finalists.
    rounds, final = compared[:2], compared[2:]
    assert all(len(c) > 1 and reps == 15 for c, reps in rounds)
    assert len(final) == 4 and all(len(c) == 1 and reps == 60 for c, reps in final)
    finalists = [c[0].name for c, _ in final]
    assert entry["winner_name"] in finalists
    assert all(r["torch_ms"] is not None for r in entry["runners_up"][:3])
    assert entry["timed_variants"] > entry["compiled_candidates"]  # round 2: run-time variants


def test_round_two_is_ranked_by_its_time_over_torchs_in_its_own_group(tmp_path):
    """Clocks that drift between rounds (every time of round 2 twice round 1's, torch's too)
    still let a variant of round 2 that is truly the fastest reach the final and win."""
    from tuning_fakes import FakeSession

    class Drifting(FakeSession):
        groups = 0

        def compare_ms(self, choices, reps):
            times, torch_ms = super().compare_ms(choices, reps)
            if reps == 60:  # the final round: each finalist beside torch, no drift
                return times, torch_ms
            Drifting.groups += 1
            drift = 2.0 if Drifting.groups > 1 else 1.0
            return {c: ms * drift for c, ms in times.items()}, torch_ms * drift

        def time_ms(self, choice, reps):
            ms = super().time_ms(choice, reps)
            return ms * 0.7 if choice.config.swizzle == 4 else ms  # the best, found in round 2

    backend = FakeBackend()
    backend.session = lambda problem: Drifting(backend, problem)
    cache = gemm_cache(SCOPE, tmp_path)
    large = problems()[1]  # more tiles than SMs: its variants are tile orders
    tune([large], backend=backend, cache=cache, strategy="default", use_heuristics=False)
    assert Drifting.groups == 2 and cache.get(large).winner.config.swizzle == 4


def _with_the_dsl_extra(monkeypatch):
    """The DSL path as if ``cutlass-ops[dsl]`` were installed (the fake backend times it)."""
    from cutlass_ops.gemms import dsl

    monkeypatch.setattr(dsl, "unavailable", lambda: None)


@pytest.mark.parametrize("strategy, count", [("quick", 8), ("default", 24)])
def test_dsl_kernels_join_the_pool_and_a_dsl_winner_records_its_path(tmp_path, monkeypatch,
                                                                     strategy, count):
    from cutlass_ops.gemms.choice import candidate_from_dict
    from cutlass_ops.gemms.dsl import DslConfig

    _with_the_dsl_extra(monkeypatch)
    backend = FakeBackend()
    backend.dsl_factor = 0.5  # faster than torch and than any C++ kernel here
    cache = gemm_cache(SCOPE, tmp_path)
    tune(problems(), backend=backend, strategy=strategy, cache=cache, use_heuristics=False)
    for problem in problems():
        entry = stored(cache, problem)
        winner = candidate_from_dict(entry["winner"])
        assert isinstance(winner, DslConfig) and entry["backend"] == "dsl"
        assert entry["winner_name"] == winner.name and entry["prefer"] == "cutlass"
        assert entry["other_backend_best"]["backend"] == "cutlass"
        assert {r["backend"] for r in entry["runners_up"]} <= {"dsl", "cutlass"}
    from cutlass_ops.gemms import dsl

    # Each problem's best ``count`` by the DSL ranking, each verified before it was timed.
    expected = {c for p in problems() for c in dsl.candidates(p.m, p.n, p.k, 132)[:count]}
    assert {c for c in backend.verified if c.backend == "dsl"} == expected
    # DSL kernels are never handed to the nvcc build; beside them, the default compiles as
    # few C++ kernels per problem as quick (compiled_beside_dsl).
    assert all(config.__class__.__name__ == "GemmConfig" for _, config in backend.built)
    assert len({config for _, config in backend.built}) <= 4 * len(problems())


def test_a_cpp_winner_names_the_best_dsl_kernel_and_the_extra_absent_offers_none(
        tmp_path, monkeypatch):
    _with_the_dsl_extra(monkeypatch)
    backend = FakeBackend()  # DSL kernels at 1.2x torch's time: the C++ path wins
    cache = gemm_cache(SCOPE, tmp_path)
    tune(problems()[1:], backend=backend, strategy="quick", cache=cache, use_heuristics=False)
    entry = stored(cache, problems()[1])
    assert entry["backend"] == "cutlass" and entry["other_backend_best"]["backend"] == "dsl"
    monkeypatch.undo()
    backend = FakeBackend()
    tune(problems()[1:], backend=backend, strategy="quick", cache=gemm_cache(SCOPE, tmp_path),
         use_heuristics=False, force=True)
    assert all(c.backend == "cutlass" for c in backend.verified)
    assert stored(gemm_cache(SCOPE, tmp_path), problems()[1])["other_backend_best"] is None


def test_a_scaled_tune_times_the_stream_k_kernels_splits_wherever_it_ranked(tmp_path):
    """FP8 problems compile the FP8 seeds only, unswapped, and round 2 times the forced split
    counts of the best stream-K kernel even when round 1 ranked it low (its first time is
    CUTLASS's own split count)."""
    from cutlass_ops.fp8.fp8_plan import scaled_problem

    from tuning_fakes import FakeSession

    class SlowUnsplitStreamK(FakeSession):  # last in round 1 unless its splits are forced
        def time_ms(self, choice, reps):
            ms = super().time_ms(choice, reps)
            if choice.backend != "cutlass":
                return ms
            config = choice.config
            return ms * 5 if config.tile_scheduler.value == "streamk" and config.splits == 1 \
                else ms

    backend = FakeBackend()
    backend.session = lambda problem: SlowUnsplitStreamK(backend, problem)
    problem = scaled_problem("blockwise", 16, 4096, 14336)
    tune([problem], backend=backend, strategy="quick", cache=gemm_cache(SCOPE, tmp_path),
         use_heuristics=False)
    assert backend.built and all(ops == problem.operands for ops, _ in backend.built)
    cutlass = [c for c in backend.timed if c.backend == "cutlass"]
    split_variants = [c for c in cutlass
                      if c.config.tile_scheduler.value == "streamk" and c.config.splits > 1]
    assert split_variants and not any(c.swap_ab for c in cutlass)


def test_a_scaled_tune_varies_every_kernel_and_finds_one_that_ranked_last_unswizzled(tmp_path):
    """FP8 problems time the tile orders of every kernel of the pool, not of the best few: a
    kernel last in round 1 (its default order) wins once swizzled, as pingpong 128x128 did on
    an H100. A bf16 problem still varies the strategy's best few only."""
    from cutlass_ops.fp8.fp8_plan import scaled_problem

    from tuning_fakes import FakeSession

    class SwizzleBloomer(FakeSession):  # the slowest kernel at swizzle 1 is fastest at 8
        def time_ms(self, choice, reps):
            ms = super().time_ms(choice, reps)
            if choice.backend == "cutlass" and choice.config.build_fields() == slow.build_fields():
                return ms / 100 if choice.config.swizzle == 8 else ms * 10
            return ms

    backend = FakeBackend()
    problem = scaled_problem("tensorwise", 16384, 14336, 4096, fast_accum=True)
    pool = GemmFamily(backend, Strategy.QUICK, budget_s=None, use_heuristics=False,
                      progress=None, build_chunk=None).candidates(problem)
    slow = max((c for c in pool if isinstance(c, Choice)),
               key=lambda c: FakeSession(backend, problem).time_ms(c, 1)).config
    backend.session = lambda p: SwizzleBloomer(backend, p)
    cache = gemm_cache(SCOPE, tmp_path)
    tune([problem], backend=backend, strategy="quick", cache=cache, use_heuristics=False)
    winner = cache.get(problem).winner
    assert winner.config.build_fields() == slow.build_fields() and winner.config.swizzle == 8

    backend = FakeBackend()
    bf16 = problems()[0]
    tune([bf16], backend=backend, strategy="quick", cache=gemm_cache(SCOPE, tmp_path),
         use_heuristics=False)
    varied = {c.config.build_fields() for c in backend.timed
              if c.backend == "cutlass" and c.config.swizzle > 1}
    assert len(varied) <= Strategy.QUICK.varied_kernels


def test_a_small_m_scaled_tune_times_the_skinny_kernel_and_stores_its_winner(tmp_path):
    """A scaled FP8 problem of few rows gets the skinny kernel's configs beside the CUTLASS
    ones; when one wins, the store keeps it as {"backend": "skinny", ...} and reads it back as
    a SkinnyConfig. Large-M and bf16 problems get none."""
    from cutlass_ops.fp8.fp8_plan import scaled_problem
    from custom_kernels.fp8.fp8_skinny import SkinnyConfig

    backend = FakeBackend()
    backend.skinny_factor = 0.05  # faster than torch and than any C++ kernel here
    small, large = scaled_problem("rowwise", 16, 4096, 4096), scaled_problem("rowwise", 4096,
                                                                             4096, 4096)
    cache = gemm_cache(SCOPE, tmp_path)
    tune([small, large, problems()[0]], backend=backend, strategy="quick", cache=cache,
         use_heuristics=False)
    skinny = [c for c in backend.verified if c.backend == "skinny"]
    assert skinny and {c.bm for c in skinny} == {16}
    entry = cache.get(small)
    assert isinstance(entry.winner, SkinnyConfig) and entry.backend == "skinny"
    assert stored(cache, small)["winner"] == {"backend": "skinny", "name": entry.winner.name}
    assert cache.get(large).backend == "cutlass"
    assert cache.get(problems()[0]).backend == "cutlass"


class WholeCallBackend(FakeBackend):
    """Sessions that also time whole eager calls: ours 45 us, torch's 27 us (a host-bound
    M = 16 call on an H100), counting what they were asked to time."""

    def __init__(self):
        super().__init__()
        self.whole_calls = []

    def session(self, problem):
        session = super().session(problem)
        backend = self

        def whole_call_ms(choice, reps):
            backend.whole_calls.append((problem, choice))
            return 0.045, 0.027
        session.whole_call_ms = whole_call_ms
        return session


def test_a_short_kernel_is_also_timed_as_a_whole_eager_call_and_dispatch_reads_it(tmp_path):
    """Issue 52: where the kernel is short enough for the host to count, the winner's and
    torch's whole eager calls are timed; a winner whose eager call loses runs inside CUDA graphs
    only. Long kernels are not timed so (the host hides behind them)."""
    from cutlass_ops.gemms import dispatch
    from cutlass_ops.gemms.gemm_entries import SCHEMA
    from custom_kernels.core.device import named_spec
    from tuning.search import WHOLE_CALL_BELOW_MS

    backend = WholeCallBackend()
    cache = gemm_cache(SCOPE, tmp_path)
    small, large = problems()
    tune([small, large], backend=backend, strategy="quick", cache=cache, use_heuristics=False)
    timed = {p for p, _ in backend.whole_calls}
    assert timed == {small}
    entry = stored(cache, small)
    assert entry["winner_ms"] <= WHOLE_CALL_BELOW_MS and entry["prefer"] == "cutlass"
    assert (entry["whole_call_ms"], entry["torch_whole_call_ms"]) == (0.045, 0.027)
    assert backend.whole_calls == [(small, Choice.from_dict(entry["winner"]))]
    assert stored(cache, large)["whole_call_ms"] is None
    record = SCHEMA.parse(small.name, entry, SCOPE)
    decision = dispatch.decide(small, {small.name: record}, named_spec("H100"),
                               is_built=lambda c: True, built_choices=lambda: [])
    assert decision.graphs_only and decision.choice == record.winner


def test_no_whole_call_where_torch_won_on_gpu_time():
    from types import SimpleNamespace

    from tuning import protocol

    asked = []
    session = SimpleNamespace(whole_call_ms=lambda c, reps: asked.append(c) or (1.0, 2.0))
    family = SimpleNamespace(whole_call_below_ms=0.05)

    def measured(winner_ms, torch_ms):
        return protocol.Measured(1, {"k": winner_ms}, {"k": winner_ms}, {"k": torch_ms}, None,
                                 [], True, 0.0)
    assert protocol.whole_call(family, session, measured(0.03, 0.02), 10) is None  # torch won
    # ... by more than WHOLE_CALL_SLOWER_KERNEL: a winner near torch's kernel is timed (below)
    assert protocol.whole_call(family, session, measured(0.08, 0.09), 10) is None  # too long
    assert protocol.whole_call(SimpleNamespace(), session, measured(0.01, 0.02), 10) is None
    assert protocol.whole_call(family, SimpleNamespace(), measured(0.01, 0.02), 10) is None
    assert not asked
    assert protocol.whole_call(family, session, measured(0.01, 0.02), 10) == (1.0, 2.0)
    assert protocol.whole_call(family, session, measured(0.021, 0.02), 10) == (1.0, 2.0)
    assert asked == ["k", "k"]
