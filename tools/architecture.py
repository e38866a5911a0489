"""The README's Architecture table, generated from pyproject.toml's import-linter contracts: one
row per folder of the library (package), its floor, its purpose (the first sentence of its
``__init__`` docstring) and its modules, in the layers its contract states (top first; the
modules of one layer do not import each other) or, for a folder without a layer contract, by
name.

    python tools/architecture.py            # print the table
    python tools/architecture.py --write    # replace it in README.md

tests/cpu/test_architecture_table.py fails when the README's table differs from this output.
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BEGIN = "<!-- architecture: python tools/architecture.py --write -->"
END = "<!-- end of architecture -->"
# A floor per root package (README, Architecture); custom_kernels.core is the ground below it.
FLOORS = {"custom_kernels.core": 1, "custom_kernels": 2, "cutlass_ops": 3, "tuning": 4}


def layer_contracts(pyproject: Path) -> dict[str, list[str]]:
    """container -> its layers, top first, from the import-linter contracts."""
    config = tomllib.loads(pyproject.read_text())["tool"]["importlinter"]
    return {container: contract["layers"] for contract in config["contracts"]
            if contract["type"] == "layers" for container in contract.get("containers", [])}


def packages(root: Path) -> list[str]:
    """Every package (a folder with ``__init__.py``) of the library, dotted."""
    roots = layer_contracts(root / "pyproject.toml").keys() | set(FLOORS)
    found = set()
    for top in {name.split(".")[0] for name in roots}:
        for init in (root / top).rglob("__init__.py"):
            found.add(".".join(init.parent.relative_to(root).parts))
    return sorted(found)


def floor(package: str) -> int:
    if package == "custom_kernels.core" or package.startswith("custom_kernels.core."):
        return FLOORS["custom_kernels.core"]
    return FLOORS[package.split(".")[0]]


def purpose(root: Path, package: str) -> str:
    """The first sentence of the package's docstring (up to its colon where it runs long)."""
    init = root / Path(*package.split(".")) / "__init__.py"
    doc = " ".join((ast.get_docstring(ast.parse(init.read_text())) or "").split())
    sentence = re.split(r"(?<=\.)\s", doc, maxsplit=1)[0]
    if len(sentence) > 120:  # a long first sentence: its head, before the colon
        sentence = sentence.split(": ", 1)[0]
    return sentence.rstrip(".:")


def children(root: Path, package: str) -> list[str]:
    """The package's modules and subpackages (subpackages with a trailing "/")."""
    folder = root / Path(*package.split("."))
    out = [p.stem for p in folder.glob("*.py") if p.stem != "__init__"]
    out += [p.name + "/" for p in folder.iterdir() if (p / "__init__.py").exists()]
    return sorted(out)


def modules_cell(root: Path, package: str, layers: dict[str, list[str]]) -> str:
    def code(name: str) -> str:
        folder = root / Path(*package.split(".")) / name
        return f"`{name}/`" if (folder / "__init__.py").exists() else f"`{name}`"
    if package not in layers:
        return ", ".join(f"`{c}`" for c in children(root, package))
    return " → ".join(", ".join(code(m.strip()) for m in re.split(r"[|:]", layer))
                      for layer in layers[package])


def table(root: Path = ROOT) -> str:
    layers = layer_contracts(root / "pyproject.toml")
    rows = sorted(packages(root), key=lambda p: (-floor(p), p))
    lines = ["| floor | folder | what it is | modules (layers top first, → means imports from) |",
             "|---|---|---|---|"]
    for package in rows:
        lines.append(f"| {floor(package)} | `{package.replace('.', '/')}/` | "
                     f"{purpose(root, package)} | {modules_cell(root, package, layers)} |")
    return "\n".join(lines)


def readme_table(readme: str) -> str:
    return readme.split(BEGIN, 1)[1].split(END, 1)[0].strip()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="replace the table in README.md")
    args = parser.parse_args(argv)
    generated = table()
    if not args.write:
        print(generated)
        return 0
    readme = (ROOT / "README.md").read_text()
    before, rest = readme.split(BEGIN, 1)
    after = rest.split(END, 1)[1]
    (ROOT / "README.md").write_text(f"{before}{BEGIN}\n{generated}\n{END}{after}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
