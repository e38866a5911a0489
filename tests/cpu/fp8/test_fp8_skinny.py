"""The few-rows FP8 kernel's configs, rules and candidates (``custom_kernels.fp8.fp8_skinny``), and
its place in the tuning store and dispatch (``cutlass_ops.gemms.fp8.fp8_skinny_route``): a stored
skinny winner is validated like any other (a crafted one naming a problem it cannot compute is
refused), and a nearest-shape lookup passes over a skinny winner that cannot take the shape."""

import pytest
from tuning_fakes import SCOPE

from cutlass_ops.fp8.fp8_plan import scaled_problem
from cutlass_ops.gemms import dispatch, gemm_entries
from cutlass_ops.gemms.config import GemmOperands, GemmProblem
from cutlass_ops.gemms.fp8 import fp8_skinny_route
from custom_kernels.fp8 import fp8_skinny
from custom_kernels.core.device import named_spec
from custom_kernels.core.tuned_fields import EntryRejected
from custom_kernels.core.tuned_store import CacheScope
from custom_kernels.fp8.fp8_skinny import SkinnyConfig


def test_config_names_round_trip():
    config = SkinnyConfig(16, 4, 6)
    assert config.name == "skinny-m16-s4-p6" and config.backend == "skinny"
    assert SkinnyConfig.parse(config.name) == config
    assert SkinnyConfig.from_dict(config.to_dict()) == config
    assert config.threads == 256
    # The pipeline's stages and the 1024-byte alignment slack.
    assert config.shared_bytes == 6 * (16 + 128) * 128 + 1024


@pytest.mark.parametrize("name", [
    "skinny-m48-s2-p4",  # not a block height
    "skinny-m16-s9-p4",  # past a portable cluster
    "skinny-m16-s0-p4",
    "skinny-m16-s2-p1",  # no pipeline
    "skinny-m128-s2-p8",  # 257 KB of shared memory
    "skinny-m16-s2-p4-x",
    "skinny-m016-s2-p4x",
    "dsl-sm90-pingpong-t128x128-c2x1",
])
def test_bad_names_are_refused(name):
    with pytest.raises(ValueError):
        SkinnyConfig.parse(name)


def test_from_dict_requires_its_backend():
    with pytest.raises(ValueError):
        SkinnyConfig.from_dict({"backend": "dsl", "name": "skinny-m16-s2-p4"})
    with pytest.raises(ValueError):
        SkinnyConfig.from_dict({"backend": "skinny", "name": 16})


@pytest.mark.parametrize("m, n, k, a, b, says", [
    (0, 4096, 4096, "e4m3", "e4m3", "rows"),
    (129, 4096, 4096, "e4m3", "e4m3", "rows"),
    (16, 4000, 4096, "e4m3", "e4m3", "multiples of 128"),
    (16, 4096, 4160, "e4m3", "e4m3", "multiples of 128"),
    (16, 4096, 4096, "e5m2", "e5m2", "e5m2"),
])
def test_refusals_name_the_rule(m, n, k, a, b, says):
    assert says in fp8_skinny.refusal(m, n, k, a, b)


def test_refusal_takes_what_the_kernel_computes():
    assert fp8_skinny.refusal(1, 128, 128, "e4m3", "e4m3") is None
    assert fp8_skinny.refusal(128, 14336, 4096, "e5m2", "e4m3") is None


@pytest.mark.parametrize("m, rows", [(1, {16}), (16, {16}), (17, {32, 16}), (100, {128, 64}),
                                     (128, {128, 64})])
def test_candidates_cover_m_with_one_block_or_two(m, rows):
    found = fp8_skinny.candidates(m, 4096, 4096)
    assert {c.bm for c in found} == rows
    assert {c.splits for c in found} == {1, 2, 4, 8} and {c.stages for c in found} == {4, 6}


def test_splits_leave_each_block_two_k_blocks():
    assert {c.splits for c in fp8_skinny.candidates(16, 4096, 256)} == {1}
    assert {c.splits for c in fp8_skinny.candidates(16, 4096, 1024)} == {1, 2, 4}


def test_defines_name_the_build():
    defines = fp8_skinny.defines(SkinnyConfig(64, 2, 4), "blockwise", "e5m2", "e4m3", True,
                                 False)
    assert defines == {"BM": 64, "STAGES": 4, "RECIPE": 2, "ELEM_A": 4, "ELEM_B": 3,
                       "OUT_F32": 1, "HAS_BIAS": 0}


def test_only_scaled_fp8_problems_of_few_rows_take_it():
    assert fp8_skinny_route.operands_refusal(scaled_problem("tensorwise", 16, 4096, 4096)) is None
    assert fp8_skinny_route.operands_refusal(
        scaled_problem("blockwise", 128, 4096, 4096, out_dtype="f32")) is None
    bf16 = GemmProblem(GemmOperands.make("bf16"), 16, 4096, 4096)
    assert "scaled FP8" in fp8_skinny_route.operands_refusal(bf16)
    assert "rows" in fp8_skinny_route.operands_refusal(scaled_problem("rowwise", 256, 4096, 4096))
    assert fp8_skinny_route.candidates(bf16) == []
    assert fp8_skinny_route.candidates(scaled_problem("rowwise", 16, 4096, 4096))


# ---- the tuning store: a skinny winner is input like any other -----------------------------

def _raw(problem: GemmProblem, winner: dict) -> dict:
    return {"problem": problem.to_dict(), "winner": winner, "prefer": "cutlass",
            "winner_ms": 0.01, "torch_ms": 0.02}


def _parse(problem, winner, scope=SCOPE):
    return gemm_entries.SCHEMA.parse(problem.name, _raw(problem, winner), scope)


def test_a_stored_skinny_winner_of_a_small_scaled_problem_is_read_back():
    problem = scaled_problem("rowwise", 16, 4096, 4096)
    entry = _parse(problem, {"backend": "skinny", "name": "skinny-m16-s4-p6"})
    assert entry.winner == SkinnyConfig(16, 4, 6) and entry.uses_kernel


@pytest.mark.parametrize("problem, winner, says", [
    # The wrong element type: a skinny (FP8) winner for a bf16 problem.
    (GemmProblem(GemmOperands.make("bf16"), 16, 4096, 4096),
     {"backend": "skinny", "name": "skinny-m16-s4-p6"}, "scaled FP8"),
    (scaled_problem("tensorwise", 256, 4096, 4096),
     {"backend": "skinny", "name": "skinny-m128-s1-p4"}, "rows"),
    (scaled_problem("tensorwise", 16, 4096, 4000),
     {"backend": "skinny", "name": "skinny-m16-s1-p4"}, "128"),
    (scaled_problem("tensorwise", 16, 4096, 4096),
     {"backend": "skinny", "name": "skinny-m16-s99-p4"}, "winner"),
    (scaled_problem("tensorwise", 16, 4096, 4096),
     {"backend": "skinny", "name": "skinny-m16-s2-p4", "extra": 1}, "winner"),
])
def test_a_crafted_skinny_winner_is_refused(problem, winner, says):
    with pytest.raises(EntryRejected, match=says):
        _parse(problem, winner)


def test_a_skinny_winner_on_a_gpu_that_is_not_sm90_is_refused():
    blackwell = CacheScope("NVIDIA B200", 100, 148, "580.0", "13.0", "4.2.0.0", "test")
    with pytest.raises(EntryRejected, match="sm90"):
        _parse(scaled_problem("rowwise", 16, 4096, 4096),
               {"backend": "skinny", "name": "skinny-m16-s4-p6"}, blackwell)


# ---- dispatch ---------------------------------------------------------------------------------

def test_nearest_lookup_passes_over_a_skinny_winner_that_cannot_take_the_shape():
    small = scaled_problem("tensorwise", 16, 4096, 4096)
    large = scaled_problem("tensorwise", 4096, 4096, 4096)
    entries = {small.name: _parse(small, {"backend": "skinny", "name": "skinny-m16-s2-p6"})}
    cutlass = dispatch.decide(large, entries, named_spec("H100"), lambda c: True, lambda: [])
    assert cutlass.choice is None and cutlass.source == "torch"  # nothing else tuned
    decision = dispatch.decide(scaled_problem("tensorwise", 8, 4096, 4096), entries,
                               named_spec("H100"), lambda c: True, lambda: [])
    assert decision.source == "nearest" and decision.choice == SkinnyConfig(16, 2, 6)
    # A tuned CUTLASS shape farther away than the skinny one is found past it.
    from tuning import candidates

    choice = candidates.select(large, named_spec("H100"), candidates.Strategy("quick"),
                               use_heuristics=False)[0]
    entries[large.name] = _parse(large, choice.to_dict())
    between = scaled_problem("tensorwise", 200, 4096, 4096)  # nearer 16 rows than 4096
    assert dispatch._distance(between, small) < dispatch._distance(between, large)
    decision = dispatch.decide(between, entries, named_spec("H100"), lambda c: True, lambda: [])
    assert decision.source == "nearest" and decision.choice == choice
