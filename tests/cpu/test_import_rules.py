"""The import rules in pyproject.toml (import-linter's contracts, which CI runs as `lint-imports`)
hold for the tree as it is and fail a tree with a planted fault: a kernel family imported by the
ground floor (custom_kernels.core), a module no layer contract names, a circle of imports."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("importlinter")

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("custom_kernels", "cutlass_ops", "tuning")


def lint(tree: Path) -> subprocess.CompletedProcess:
    """`lint-imports` over ``tree``'s packages, with the repository's contracts."""
    code = ("import sys; from importlinter.cli import lint_imports; "
            "sys.exit(lint_imports(config_filename='pyproject.toml'))")
    return subprocess.run([sys.executable, "-c", code], cwd=tree, capture_output=True,
                          text=True, env={"PYTHONPATH": str(tree), "PATH": ""}, timeout=120)


@pytest.fixture(scope="module")
def tree(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tree")
    for package in PACKAGES:
        shutil.copytree(ROOT / package, out / package,
                        ignore=shutil.ignore_patterns("csrc", "__pycache__", "*.md"))
    shutil.copy(ROOT / "pyproject.toml", out)
    return out


def broken(result: subprocess.CompletedProcess) -> list[str]:
    """The names of the contracts a lint run reports broken (its report wraps long names)."""
    report = " ".join(result.stdout.split())
    names = ("Floors", "No circles", "The kernel families", "The public API", "The GEMM chain",
             "The tuner")
    return [n for n in names if f"{n}" in report and report.split(n, 1)[1].split(
        " KEPT", 1)[0].find(" BROKEN") != -1]


def planted(tree: Path, path: str, line: str):
    """Append ``line`` to ``path`` (a new file if it does not exist) for one check."""
    file = tree / path
    before = file.read_text() if file.exists() else None
    file.write_text((before or "") + "\n" + line + "\n")
    try:
        return lint(tree)
    finally:
        file.unlink() if before is None else file.write_text(before)


def test_the_tree_keeps_every_contract(tree):
    result = lint(tree)
    assert result.returncode == 0, result.stdout + result.stderr
    assert broken(result) == [] and " 0 broken" in result.stdout


def test_the_ground_floor_importing_a_kernel_family_fails(tree):
    result = planted(tree, "custom_kernels/core/int_limits.py", "import custom_kernels.rotary")
    # the family imports the ground: the circle is broken too
    assert result.returncode != 0 and "The kernel families" in broken(result)


def test_a_module_no_layer_names_fails(tree):
    result = planted(tree, "cutlass_ops/unlisted.py", "X = 1")
    assert result.returncode != 0 and broken(result) == ["The public API"]
    assert "unlisted" in result.stdout


def test_a_circle_of_imports_fails(tree):
    # custom_kernels.norms has no layer contract: norm_ops imports norm_config, so norm_config
    # importing norm_ops closes a circle that only the acyclic contract sees.
    result = planted(tree, "custom_kernels/norms/norm_config.py",
                     "from custom_kernels.norms import norm_ops as _ops  # noqa: E402")
    assert result.returncode != 0 and broken(result) == ["No circles"]
