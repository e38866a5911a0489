"""The README's Architecture table is the one tools/architecture.py generates from the import
contracts: a module added, moved or given another layer shows there or this test fails."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def architecture():
    spec = importlib.util.spec_from_file_location("architecture", ROOT / "tools/architecture.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_readme_table_is_generated_from_the_contracts():
    tool = architecture()
    readme = (ROOT / "README.md").read_text()
    assert tool.readme_table(readme) == tool.table(), \
        "README's Architecture table is stale: run python tools/architecture.py --write"


def test_every_folder_and_module_of_the_library_is_in_the_table():
    tool = architecture()
    generated = tool.table()
    for package in ("custom_kernels", "cutlass_ops", "tuning"):
        for path in (ROOT / package).rglob("*.py"):
            folder = "/".join(path.parent.relative_to(ROOT).parts) + "/"
            assert f"`{folder}`" in generated, folder
            if path.stem != "__init__":
                assert f"`{path.stem}`" in generated or f"`{path.stem}/`" in generated, path
