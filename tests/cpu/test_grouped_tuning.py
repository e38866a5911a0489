"""The grouped GEMM tuner on the CPU with a fake backend: keys, candidates, the protocol's rounds
(failures recorded, wrong results never win), stored entries, the CLI's refusals, and the skew
dispatch (the two routings' best kernels behind one key)."""

import dataclasses

import pytest
from tuning_fakes import SCOPE, stored

from cutlass_ops.gemms.grouped import grouped_entries
from custom_kernels.core.tuned_store import TuningCache
from cutlass_ops.gemms.grouped.grouped_build import GroupedConfig, GroupedProblem, bucket, candidates
from tuning import grouped_search


class FakeSession:
    def __init__(self, backend, problem):
        self.backend, self.problem = backend, problem

    def verify(self, config):
        self.backend.verified.append(config)
        return "wrong result: relative error 0.5 > 0.01" if config.cluster == (1, 2) else None

    def time_ms(self, config, reps):
        # Cooperative 128x256 fastest, pingpong slowest: a deterministic order.
        return 1.0 + 0.1 * config.pingpong + 0.001 * sum(config.tile) + 0.01 * config.cluster[0]

    def torch_ms(self, reps):
        return 1.5

    def compare_ms(self, configs, reps):
        return {c: self.time_ms(c, reps) for c in configs}, self.torch_ms(reps)

    def close(self):
        pass


class FakeBackend:
    dsl = False

    def __init__(self):
        self.built, self.verified = [], []

    def build(self, configs):
        self.built += configs
        return {c: "build: fake nvcc error" for c in configs if c.tile == (256, 128, 64)}

    def session(self, problem):
        return FakeSession(self, problem)


def test_keys_bucket_the_grouped_extent_and_name_the_layouts():
    assert [bucket(x) for x in (1, 16, 17, 100, 512, 513)] == [16, 16, 32, 128, 512, 1024]
    forward, dx, dw = grouped_search.moe_problems(8, 14336, 4096, 8192, backward=True)
    assert forward == GroupedProblem("2d3d", 8, 1024, 14336, 4096, "bf16", "t", "n")
    assert dx.n == 4096 and dx.k == 14336 and (dx.layout_a, dx.layout_b) == ("t", "t")
    assert dw.form == "2d2d" and (dw.m, dw.n, dw.k) == (14336, 4096, 1024)  # dY^T X: [E, N, K]
    assert GroupedProblem.from_dict(forward.to_dict()) == forward
    assert forward.name == "2d3d-bf16-tn-g8-m1024-n14336-k4096"


def test_candidates_follow_the_rows_per_group():
    small = GroupedProblem("2d3d", 128, 64, 768, 2048)
    large = GroupedProblem("2d3d", 8, 2048, 14336, 4096)
    assert candidates(small, "quick")[0].pingpong and not candidates(large, "quick")[0].pingpong
    assert len(candidates(large, "quick")) == 4 and len(candidates(large, "default")) == 8
    assert len(candidates(large, "exhaustive")) == 15


def test_a_tune_stores_verified_winners_and_records_failures(tmp_path):
    backend = FakeBackend()
    cache = TuningCache(SCOPE, grouped_entries.SCHEMA, tmp_path)
    problems = grouped_search.moe_problems(8, 14336, 4096, 8192, backward=True)
    results = grouped_search.tune(problems, strategy="exhaustive", backend=backend, cache=cache,
                                  progress=lambda message: None)
    assert [r.problem for r in results] == problems
    # One kernel serves every problem of its layouts: each config built once.
    assert len(backend.built) == len(set(backend.built))
    for problem in problems:
        entry = stored(cache, problem)
        assert entry["winner"] and entry["prefer"] == "cutlass"
        assert "-c1x2" not in entry["winner"]  # wrong results never win
        stages = {f["stage"] for f in entry["failures"]}
        assert stages == {"build", "wrong result"}
    again = grouped_search.tune(problems, backend=backend, cache=cache,
                                progress=lambda message: None)
    assert all(r.cached for r in again)


@pytest.mark.parametrize("groups, per_group", [(8, 1024), (128, 256), (256, 16), (2, 8)])
def test_the_skewed_routing_keeps_the_rows_and_aligned_groups(groups, per_group):
    ends = grouped_search.skewed_offsets(groups, per_group)
    counts = [int(ends[0])] + (ends[1:] - ends[:-1]).tolist()
    assert int(ends[-1]) == groups * per_group and min(counts) >= 0
    assert all(c % 8 == 0 for c in counts)
    assert max(counts) >= 2 * per_group  # skewed: the top expert takes several times its share


def test_tuned_config_reads_a_winner_that_beat_torch(tmp_path, monkeypatch):
    from cutlass_ops.gemms.grouped import grouped_build

    monkeypatch.setenv("CUTLASS_OPS_CACHE_DIR", str(tmp_path))
    problem = GroupedProblem("2d3d", 8, 1024, 14336, 4096)
    assert grouped_entries.tuned_config(problem) is None  # nothing tuned: no device query
    cache = TuningCache(SCOPE, grouped_entries.SCHEMA)
    monkeypatch.setattr(grouped_entries, "grouped_cache", lambda device=None: cache)
    cache.put(problem, {"winner": "grouped-bf16-tn-cooperative-t128x256x64-c2x1",
                        "prefer": "cutlass", "winner_ms": 1.0, "torch_ms": 1.2})
    assert grouped_entries.tuned_config(problem).tile == (128, 256, 64)
    cache.put(problem, {"winner": "grouped-bf16-tn-cooperative-t128x256x64-c2x1",
                        "prefer": "torch", "winner_ms": 1.3, "torch_ms": 1.2})
    assert grouped_entries.tuned_config(problem) is None


FASTEST = "grouped-bf16-tn-cooperative-t128x128x64-c1x1"


class FakeRoutingSession(FakeSession):
    """Per-routing ratios to torch (even, skewed): the fastest kernel overall (cooperative
    128x128, cluster 1x1) loses to torch on the even routing."""

    def __init__(self, backend, problem):
        super().__init__(backend, problem)
        self.ratios = {}

    def compare_ms(self, configs, reps):
        times, torch_ms = super().compare_ms(configs, reps)
        for c in configs:
            ratio = times[c] / torch_ms
            fastest = c.name == FASTEST
            self.ratios[c] = [1.02, ratio * ratio / 1.02] if fastest or self.backend.all_lose \
                else [ratio, ratio]
        return times, torch_ms


class FakeRoutingBackend(FakeBackend):
    all_lose = False

    def session(self, problem):
        return FakeRoutingSession(self, problem)


@pytest.mark.parametrize("all_lose", [False, True])
def test_the_winner_beats_torch_on_every_routing_or_torch_runs(tmp_path, all_lose):
    backend = FakeRoutingBackend()
    backend.all_lose = all_lose
    cache = TuningCache(SCOPE, grouped_entries.SCHEMA, tmp_path)
    problem = grouped_search.moe_problems(8, 14336, 4096, 8192)[0]
    grouped_search.tune([problem], strategy="exhaustive", backend=backend, cache=cache,
                        progress=lambda message: None)
    entry = stored(cache, problem)
    if all_lose:
        assert entry["prefer"] == "torch"
    else:
        assert entry["prefer"] == "cutlass" and entry["winner"] != FASTEST
        assert entry["runners_up"][0]["config"] == FASTEST  # ranked first, yet not the winner
        assert min(entry["routing_speedups"]) >= 1.0


class FakeDslSession(FakeSession):
    """The DSL kernels are faster than every C++ one here, but pingpong 128x208 is wrong, and a
    dynamic scheduler's twin is a little faster than its static kernel."""

    def verify(self, config):
        self.backend.verified.append(config)
        if getattr(config, "tile_n", None) == 208:
            return "with an empty group: wrong result: relative error 0.5 > 0.01"
        return None

    def time_ms(self, config, reps):
        if hasattr(config, "tile_n"):
            return 0.5 + 0.001 * config.tile_n - 0.002 * config.dynamic
        return super().time_ms(config, reps)


class FakeDslBackend(FakeBackend):
    dsl = True

    def session(self, problem):
        return FakeDslSession(self, problem)


def test_the_dsl_kernels_join_the_pool_and_the_winner_names_its_path(tmp_path, monkeypatch):
    from cutlass_ops.gemms import dsl
    from cutlass_ops.gemms.grouped import dsl_grouped, grouped_build

    monkeypatch.setattr(dsl, "unavailable", lambda: None)  # the extra, as if installed
    monkeypatch.setenv("CUTLASS_OPS_CACHE_DIR", str(tmp_path))
    backend = FakeDslBackend()
    cache = TuningCache(SCOPE, grouped_entries.SCHEMA)
    problems = grouped_search.moe_problems(8, 14336, 4096, 8192, backward=True)
    grouped_search.tune(problems, strategy="default", backend=backend, cache=cache,
                        progress=lambda message: None)
    # Only the C++ kernels go to nvcc; the DSL ones are verified (their compile) and timed:
    # the default 8, then the dynamic twins of the best two that passed.
    assert not any(dsl_grouped.is_dsl(c) for c in backend.built)
    assert sum(dsl_grouped.is_dsl(c) for c in backend.verified) == (8 + 2) * 3
    twins = [c for c in backend.verified if getattr(c, "dynamic", False)]
    assert not any(c.tile_n == 208 for c in twins)  # no twin of a kernel that failed
    for problem in problems:
        entry = stored(cache, problem)
        assert entry["backend"] == "dsl" and entry["winner"].startswith("dsl-sm90-")
        assert "x208" not in entry["winner"]  # wrong with an empty group: never wins
        assert entry["winner"].endswith("-dynamic")  # the faster twin
        assert entry["other_backend_best"]["backend"] == "cutlass"
        monkeypatch.setattr(grouped_entries, "grouped_cache", lambda device=None: cache)
        assert grouped_entries.tuned_config(problem).name == entry["winner"]
    monkeypatch.setattr(dsl, "unavailable", lambda: "no extra")  # the winner, then uninstalled
    assert grouped_entries.tuned_config(problems[0]) is None  # torch._grouped_mm runs instead


def test_the_dsl_path_takes_the_varlen_forms_only(monkeypatch):
    from cutlass_ops.gemms import dsl
    from cutlass_ops.gemms.grouped import dsl_grouped

    problem = GroupedProblem("2d3d", 8, 1024, 14336, 4096)
    monkeypatch.setattr(dsl, "unavailable", lambda: "needs quack-kernels")
    assert dsl_grouped.candidates(problem) == [] and "quack" in dsl_grouped.refusal(problem)
    monkeypatch.setattr(dsl, "unavailable", lambda: None)
    assert len(dsl_grouped.candidates(problem, "quick")) == 4
    assert len(dsl_grouped.candidates(problem, "exhaustive")) == len(dsl_grouped.CONFIGS) == 22
    assert not any(c.swap_ab for c in dsl_grouped.CONFIGS)
    assert "3d3d" in dsl_grouped.refusal(GroupedProblem("3d3d", 8, 64, 64, 64))
    assert dsl_grouped.refusal(GroupedProblem("2d2d", 8, 64, 64, 64)) is None


@pytest.mark.parametrize("m, form, short", [(128, "2d3d", True), (16, "2d3d", True),
                                            (256, "2d3d", False), (128, "2d2d", False)])
def test_short_groups_get_the_64_row_tiles_first(monkeypatch, m, form, short):
    from cutlass_ops.gemms import dsl
    from cutlass_ops.gemms.grouped import dsl_grouped

    monkeypatch.setattr(dsl, "unavailable", lambda: None)
    problem = GroupedProblem(form, 256, m, 2048, 7168)
    default = dsl_grouped.candidates(problem)
    exhaustive = dsl_grouped.candidates(problem, "exhaustive")
    assert dsl_grouped.has_short_groups(problem) is short
    if short:  # one 64-row tile ahead of the default eight; every one of them when exhaustive
        assert default == [dsl_grouped.SHORT_GROUP_CONFIGS[0], *dsl_grouped.CONFIGS[:8]]
        assert len(exhaustive) == len(dsl_grouped.SHORT_GROUP_CONFIGS) + 22
    else:
        assert default == list(dsl_grouped.CONFIGS[:8]) and len(exhaustive) == 22
    assert all(c.tile_m == 64 and c.pingpong and c.why_invalid() is None
               for c in dsl_grouped.SHORT_GROUP_CONFIGS)
    assert len(set(default)) == len(default) and len(set(exhaustive)) == len(exhaustive)


@pytest.mark.parametrize("args, words", [
    (["--grouped", "8:14336"], "E:N:K"),
    (["--grouped", "8:0:4096", "--tokens", "64"], "positive"),
    (["--grouped", "8:14336:4096"], "--tokens"),
    (["--grouped", "8:14336:4096", "--tokens", "64", "--dtype", "f32"], "bf16 or f16"),
    (["--grouped", "8:14336:4096", "--tokens", "64"], "needs a CUDA GPU"),  # before any build
])
def test_the_cli_refuses_bad_grouped_arguments_by_name(args, words, capsys, monkeypatch):
    import torch

    from tuning.cli import main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the no-GPU case anywhere
    assert main(["tune", *args]) != 0
    assert words in capsys.readouterr().err


# ---- skew dispatch: two kernels behind one key, the routing's skew choosing on the device ----

EVEN_BEST = "grouped-bf16-tn-pingpong-t64x128x64-c2x1"
SKEWED_BEST = "grouped-bf16-tn-cooperative-t128x256x64-c2x1"


class FakeSplitSession(FakeSession):
    """Per-routing times: pingpong 64x128 (2x1) best on the even routing, cooperative 128x256
    (2x1) on the skewed one; a skew dispatch costs its two kernels' best plus 0.01 ms."""

    skewed_ratio = 42.25

    def __init__(self, backend, problem):
        super().__init__(backend, problem)
        self.routing_times, self.ratios = {}, {}

    def _pair(self, config):
        from cutlass_ops.gemms.grouped import skew_dispatch

        if skew_dispatch.is_skew_dispatch(config):
            return [self._pair(config.even)[0] + 0.01, self._pair(config.skewed)[1] + 0.01]
        return {EVEN_BEST: [1.0, 3.0], SKEWED_BEST: [1.6, 1.8]}.get(config.name, [2.0, 3.5])

    def verify(self, config):
        self.backend.verified.append(config)
        return None

    def time_ms(self, config, reps):
        self.routing_times[config] = self._pair(config)
        return (self._pair(config)[0] * self._pair(config)[1]) ** 0.5

    def compare_ms(self, configs, reps):
        for c in configs:
            self.ratios[c] = [t / 2.5 for t in self._pair(c)]
        return {c: self.time_ms(c, reps) for c in configs}, 2.5


class FakeSplitBackend(FakeBackend):
    def build(self, configs):
        self.built += configs
        return {}

    def session(self, problem):
        return FakeSplitSession(self, problem)


def test_a_skew_dispatch_of_the_two_routings_best_wins_where_it_pays(tmp_path, monkeypatch):
    from cutlass_ops.gemms.grouped import grouped_build, skew_dispatch

    monkeypatch.setenv("CUTLASS_OPS_CACHE_DIR", str(tmp_path))
    backend = FakeSplitBackend()
    cache = TuningCache(SCOPE, grouped_entries.SCHEMA)
    forward, dx, dw = grouped_search.moe_problems(256, 2048, 7168, 32768, backward=True)
    grouped_search.tune([forward, dw], strategy="default", backend=backend, cache=cache,
                        progress=lambda message: None)
    entry = stored(cache, forward)
    assert entry["winner"] == f"skew-x6.5-{EVEN_BEST}+{SKEWED_BEST}"  # sqrt(42.25) = 6.5
    assert entry["backend"] == "cutlass" and entry["routing_speedups"] == [
        round(2.5 / 1.01, 4), round(2.5 / 1.81, 4)]
    monkeypatch.setattr(grouped_entries, "grouped_cache", lambda device=None: cache)
    config = grouped_entries.tuned_config(forward)
    assert skew_dispatch.is_skew_dispatch(config) and config.skew == 6.5
    assert (config.even.name, config.skewed.name) == (EVEN_BEST, SKEWED_BEST)
    assert not skew_dispatch.is_skew_dispatch(grouped_entries.tuned_config(dw))  # 2d2d: never
    # An entry edited by hand to name a pair for dW: rejected, and torch runs.
    report = cache.merge({dw.name: {**entry, "problem": dw.to_dict(), "winner_ms": 1e-3}})
    assert report.changed == 0 and "skew dispatch for the 2d2d form" in report.rejections[0].reason
    assert not skew_dispatch.is_skew_dispatch(grouped_entries.tuned_config(dw))
    assert not any(skew_dispatch.is_skew_dispatch(c) for c in backend.built)  # not an nvcc job


def test_no_skew_dispatch_when_one_kernel_is_best_on_both_routings():
    family = grouped_search.GroupedFamily("default", FakeSplitBackend(), lambda message: None)
    problem = grouped_search.moe_problems(8, 14336, 4096, 8192)[0]
    session = family.session(problem)
    configs = candidates(problem)
    session.routing_times = {c: [1.0 + i, 2.0 + i] for i, c in enumerate(configs)}
    assert list(family.derived(problem, configs)) == []
    session.routing_times = {}  # a session that does not time routings apart
    assert list(family.derived(problem, configs)) == []


@pytest.mark.parametrize("strategy, count", [("quick", 1), ("default", 2), ("exhaustive", 4)])
def test_dynamic_twins_of_the_best_static_dsl_kernels(strategy, count):
    from cutlass_ops.gemms.grouped import dsl_grouped
    from cutlass_ops.gemms.dsl import DslConfig

    cpp = candidates(grouped_search.moe_problems(8, 14336, 4096, 8192)[0])[0]
    already = DslConfig(128, 192, 2, 1, True, dynamic=True)
    ranked = [cpp, already, *dsl_grouped.CONFIGS[1:6]]
    twins = dsl_grouped.dynamic_twins(ranked, strategy)
    # C++ kernels and kernels already dynamic are passed over; the rest keep their rank.
    assert twins == [dataclasses.replace(c, dynamic=True)
                     for c in dsl_grouped.CONFIGS[1:1 + count]]
    assert all(c.name.endswith("-dynamic") and DslConfig.from_name(c.name) == c for c in twins)
    assert dsl_grouped.dynamic_twins([cpp], strategy) == []


def test_a_tune_without_dynamic_twins_times_none(tmp_path, monkeypatch):
    from cutlass_ops.gemms import dsl

    monkeypatch.setattr(dsl, "unavailable", lambda: None)
    monkeypatch.setenv("CUTLASS_OPS_CACHE_DIR", str(tmp_path))
    backend = FakeDslBackend()
    cache = TuningCache(SCOPE, grouped_entries.SCHEMA)
    problem = grouped_search.moe_problems(8, 14336, 4096, 8192)[0]
    grouped_search.tune([problem], backend=backend, cache=cache, dynamic_twins=False,
                        progress=lambda message: None)
    assert not any(getattr(c, "dynamic", False) for c in backend.verified)
    assert not stored(cache, problem)["winner"].endswith("-dynamic")


def test_round_2_times_the_twins_before_pairing_the_routings_best(monkeypatch):
    """The skew pair is made after the twins are timed, so a twin can be half of it."""
    from cutlass_ops.gemms import dsl
    from cutlass_ops.gemms.grouped import dsl_grouped, skew_dispatch

    monkeypatch.setattr(dsl, "unavailable", lambda: None)
    family = grouped_search.GroupedFamily("quick", FakeSplitBackend(), lambda message: None)
    problem = grouped_search.moe_problems(256, 2048, 7168, 32768)[0]
    session = family.session(problem)
    static = dsl_grouped.CONFIGS[0]
    session.routing_times = {static: [2.0, 3.0]}
    rounds = family.derived(problem, [static])
    twin = next(rounds)
    assert twin == dataclasses.replace(static, dynamic=True)
    session.routing_times[twin] = [2.1, 1.5]  # what timing it would record
    pair = next(rounds)
    assert skew_dispatch.is_skew_dispatch(pair) and (pair.even, pair.skewed) == (static, twin)
    assert next(rounds, None) is None


def test_skew_dispatch_names_round_trip_and_refuse_nonsense(monkeypatch):
    from cutlass_ops.gemms import dsl
    from cutlass_ops.gemms.grouped import grouped_build, skew_dispatch
    from cutlass_ops.gemms.grouped.skew_dispatch import SkewDispatch

    monkeypatch.setattr(dsl, "unavailable", lambda: None)
    mixed = SkewDispatch(dsl.DslConfig(64, 128, 2, 1, True, tile_k=128),
                         GroupedConfig.from_name(SKEWED_BEST), 4.9)
    assert mixed.name == f"skew-x4.9-dsl-sm90-pingpong-t64x128x128-c2x1+{SKEWED_BEST}"
    assert grouped_build.config_from_name(mixed.name) == mixed
    assert grouped_search._path(mixed) == "cutlass+dsl"
    twins = SkewDispatch(dsl.DslConfig(64, 128, 2, 1, True, tile_k=128, dynamic=True),
                         dsl.DslConfig(128, 256, 1, 1, False), 7.1)
    assert twins.name == ("skew-x7.1-dsl-sm90-pingpong-t64x128x128-c2x1-dynamic"
                          "+dsl-sm90-cooperative-t128x256-c1x1")
    assert grouped_build.config_from_name(twins.name) == twins
    monkeypatch.setattr(dsl, "unavailable", lambda: "no extra")  # half of it uninstalled
    assert grouped_build.config_from_name(mixed.name) is None  # torch._grouped_mm runs
    with pytest.raises(ValueError, match="two different kernels"):
        SkewDispatch(mixed.skewed, mixed.skewed, 2.0)
    with pytest.raises(ValueError, match="at least 1"):
        SkewDispatch(mixed.even, mixed.skewed, 0.5)
    with pytest.raises(ValueError, match="finite"):
        SkewDispatch(mixed.even, mixed.skewed, float("inf"))
    with pytest.raises(ValueError, match="skew dispatch name"):
        grouped_build.config_from_name(f"skew-{SKEWED_BEST}")
    assert [skew_dispatch.threshold(r) for r in (42.25, 2.94, 1.0, 0.5)] == [6.5, 1.7, 1.0, 1.0]


def test_a_skew_dispatch_refuses_the_2d2d_form():
    from cutlass_ops.gemms.grouped import skew_dispatch
    from cutlass_ops.gemms.grouped.skew_dispatch import SkewDispatch

    config = SkewDispatch(GroupedConfig.from_name(EVEN_BEST), GroupedConfig.from_name(SKEWED_BEST),
                          2.0)
    with pytest.raises(ValueError, match="2d3d"):
        skew_dispatch.launch(config, None, "2d2d", None, None, None, None)

