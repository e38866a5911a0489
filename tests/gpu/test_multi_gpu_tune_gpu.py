"""``cutlass-tune tune`` on every local GPU, both ways: ``--gpus all`` (one worker process per
GPU) and torchrun (a rank per GPU, rank 0 gathering the others' entries). Each must leave one
cache with an entry for every shape. On a one-GPU machine both run with a single worker."""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from custom_kernels.core.version import __version__

pytestmark = [pytest.mark.gpu, pytest.mark.nvcc]  # builds CUTLASS C++ kernels with nvcc

# Two shapes that share the quick strategy's kernels: compiled once, then both ways reuse them.
SHAPES = ["16x4096x4096", "16x4096x14336"]


def cli(*args: str, env: dict, launcher: tuple = ()) -> str:
    done = subprocess.run([sys.executable, *launcher, "-m", "tuning.cli", *args], env=env,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def tuned_shapes(env: dict) -> list[str]:
    gpu = torch.cuda.get_device_name()
    return sorted(row["shape"] for row in json.loads(cli("list", "--json", env=env))
                  if row["gpu"] == gpu and row["prefer"] in ("cutlass", "torch"))


def test_every_gpu_tunes_its_share_into_one_cache_with_workers_and_under_torchrun(tmp_path):
    env = dict(os.environ, CUTLASS_OPS_CACHE_DIR=str(tmp_path / "cache"))
    gpus = torch.cuda.device_count()

    cli("tune", *SHAPES, "--strategy", "quick", "--gpus", "all", "--no-progress", env=env)
    assert tuned_shapes(env) == sorted(SHAPES)

    shutil.rmtree(tmp_path / "cache" / __version__ / "tuning")  # the kernels stay built
    assert tuned_shapes(env) == []
    cli("tune", *SHAPES, "--strategy", "quick", "--no-progress", env=env,
        launcher=("-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={gpus}"))
    assert tuned_shapes(env) == sorted(SHAPES)
