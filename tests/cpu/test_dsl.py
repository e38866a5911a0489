"""The CuTe DSL GEMM path without its extra (the CI machine has neither quack-kernels nor
nvidia-cutlass-dsl): the configs, the candidate order, and that nothing imports the packages."""

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cutlass_ops.gemms import dsl
from custom_kernels.core.errors import UnsupportedInputError


def test_the_sm90_list_names_44_kernels_that_round_trip():
    names = [c.name for c in dsl.SM90_CONFIGS]
    assert len(set(names)) == len(names) == 44
    assert all(dsl.DslConfig.from_name(name) == c for name, c in zip(names, dsl.SM90_CONFIGS))
    assert "dsl-sm90-pingpong-t128x192-c2x1" in names
    assert "dsl-sm90-cooperative-t256x208-c1x2-swap" in names


def test_the_small_configs_name_48_more_kernels_that_round_trip():
    names = [c.name for c in dsl.SMALL_CONFIGS]
    assert len(set(names)) == len(names) == 48
    assert not set(names) & {c.name for c in dsl.SM90_CONFIGS}
    assert all(dsl.DslConfig.from_name(name) == c for name, c in zip(names, dsl.SMALL_CONFIGS))
    # The K tile is named only where it is not QuACK's default, so older names still mean the
    # same kernel.
    assert "dsl-sm90-pingpong-t64x16x128-c1x2-swap" in names
    assert "dsl-sm90-pingpong-t64x64-c1x1" in names
    assert dsl.DslConfig.from_name("dsl-sm90-pingpong-t128x128x64-c2x1") == \
        dsl.DslConfig.from_name("dsl-sm90-pingpong-t128x128-c2x1")


def test_a_dynamic_scheduler_is_named_last_and_round_trips():
    twin = dataclasses.replace(dsl.DslConfig.from_name("dsl-sm90-pingpong-t64x16x128-c1x2-swap"),
                               dynamic=True)
    assert twin.name == "dsl-sm90-pingpong-t64x16x128-c1x2-swap-dynamic"
    assert dsl.DslConfig.from_name(twin.name) == twin
    # Names without it are the static kernels they always named.
    assert not any(c.dynamic for c in (*dsl.SM90_CONFIGS, *dsl.SMALL_CONFIGS))


@pytest.mark.parametrize("name, words", [
    ("dsl-sm90-pingpong-t128x208-c2x1-dynamic-swap", "not a DSL GEMM config"),  # the order
    ("dsl-sm90-pingpong-t256x128-c2x1", "pingpong tiles"),  # a cooperative tile
    ("dsl-sm90-cooperative-t128x128-c2x1", "cooperative tiles"),
    ("dsl-sm90-cooperative-t64x64-c2x1", "cooperative tiles"),  # small tiles are pingpong
    ("dsl-sm90-pingpong-t64x16x96-c1x1-swap", "K tiles"),
    ("dsl-sm90-pingpong-t128x128-c2x2", "clusters"),
    ("sm90a-cooperative-t128x256x64", "not a DSL GEMM config"),
])
def test_a_bad_name_is_refused_by_name(name, words):
    with pytest.raises(ValueError, match=words):
        dsl.DslConfig.from_name(name)


def test_candidates_rank_every_config_and_prefer_full_tiles_and_waves():
    assert sorted(c.name for c in dsl.candidates(4096, 14336, 4096)) == \
        sorted(c.name for c in dsl.SM90_CONFIGS)
    # 3072 x 2288 = 12 x 11 tiles of 256 x 208: one full wave on 132 SMs, no padding.
    m, n = 3072, 2288
    best = dsl.candidates(m, n, 4096, sms=132)[0]
    rows, cols = (n, m) if best.swap_ab else (m, n)
    assert rows % best.tile_m == 0 and cols % best.tile_n == 0
    assert (rows // best.tile_m) * (cols // best.tile_n) % 132 == 0
    # Fewer SMs change the waves, so the ranking follows the GPU.
    assert dsl.candidates(m, n, 4096, sms=100) != dsl.candidates(m, n, 4096, sms=132)


@pytest.mark.parametrize("m, n", [(16, 4096), (128, 14336), (4096, 16), (14336, 128)])
def test_a_small_m_or_n_gets_the_small_configs_first_with_the_measured_seeds_leading(m, n):
    ranked = dsl.candidates(m, n, 4096)
    assert len(ranked) == len(dsl.SMALL_CONFIGS) + len(dsl.SM90_CONFIGS)
    assert set(ranked[:len(dsl.SMALL_CONFIGS)]) == set(dsl.SMALL_CONFIGS)
    seeds = dsl.SMALL_SEEDS if m <= n else [
        dsl.DslConfig(c.tile_m, c.tile_n, c.cluster_m, c.cluster_n, c.pingpong, not c.swap_ab,
                      c.tile_k) for c in dsl.SMALL_SEEDS]
    assert set(ranked[:len(seeds)]) == set(seeds)


def test_large_problems_are_not_offered_the_small_configs():
    assert not set(dsl.candidates(1024, 4096, 4096)) & set(dsl.SMALL_CONFIGS)
    assert not set(dsl.candidates(129, 129, 64)) & set(dsl.SMALL_CONFIGS)


def test_without_the_extra_it_says_what_to_install(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "quack" else real(name, *a))
    assert "quack-kernels" in dsl.unavailable() and "cutlass-ops[dsl]" in dsl.unavailable()
    x = torch.randn(16, 64)
    with pytest.raises(UnsupportedInputError, match="cutlass-ops\\[dsl\\]"):
        dsl.plan(dsl.SM90_CONFIGS[0], x, x.t(), torch.empty(16, 16))


def test_cpu_tensors_are_refused_by_name():
    x = torch.randn(16, 64, dtype=torch.bfloat16)
    with pytest.raises(UnsupportedInputError, match="CUDA tensors"):
        dsl.check(x, x.t(), torch.empty(16, 16, dtype=torch.bfloat16))


def test_importing_the_library_imports_neither_package():
    code = ("import sys, cutlass_ops, cutlass_ops.nn, tuning.cli, cutlass_ops.gemms.dsl\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('quack', 'cutlass')))")
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=root, env={**os.environ, "PYTHONPATH": str(root)}).stdout
    assert out.strip() == "[]"


@pytest.mark.parametrize("epilogue, refused", [
    (dict(), None),
    (dict(bias="n"), None),
    (dict(bias="n", residual=True), None),
    (dict(residual=True), None),
    (dict(bias="m"), "along M"),
    (dict(bias="n", activation="gelu_tanh"), "gelu_tanh activation"),
    (dict(activation="silu"), "silu activation"),
])
def test_epilogues_in_our_order_or_refused(monkeypatch, epilogue, refused):
    """alpha * AB + bias + beta * C is QuACK's gemm_tuned; activations (its gemm_act failed to
    compile with a pinned config on the GPU) and a bias along M are refused."""
    from cutlass_ops.gemms.config import Epilogue, GemmOperands, GemmProblem

    monkeypatch.setattr(dsl, "unavailable", lambda: None)
    problem = GemmProblem(GemmOperands.make("bf16", epilogue=Epilogue(**epilogue)), 64, 64, 64)
    why = dsl.refusal(problem)
    assert (why is None) if refused is None else (refused in why)
    with_f32 = GemmProblem(GemmOperands.make("f32"), 64, 64, 64)
    assert "bf16 or f16" in dsl.refusal(with_f32)
