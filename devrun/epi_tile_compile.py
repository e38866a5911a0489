"""Compile-only half of the epilogue-tile study, for a machine with nvcc and no GPU: builds
devrun/epi_tile_list's configs through the project's build path (emit, nvcc, artifact cache) with
ptxas -v added to the flags, and prints per kernel: built or the error, registers, spills, the
shared memory the launcher reports (CollectiveMainloop + CollectiveEpilogue SharedStorage), and
the mainloop stage count that leaves. JSON to $OUT/epi_tile_compile.json.

    CUTLASS_OPS_CACHE_DIR=/tmp/epi-cache python devrun/epi_tile_compile.py [jobs]
"""
import json
import os
import re
import sys
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).parent)]

import epi_tile_list  # noqa: E402

from cutlass_ops import build, kernels, runtime  # noqa: E402
from cutlass_ops.errors import BuildError  # noqa: E402

_flags = build.nvcc_flags
build.nvcc_flags = lambda arch: [*_flags(arch), "-Xptxas=-v"]  # artifacts apart from normal ones

_PTXAS = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads"
                    r".*?Used (\d+) registers", re.S)


def ptxas_facts(log: str) -> dict:
    """Of the GEMM kernel's entry (the launcher .cu has a few tiny helper kernels too): the
    entry with the most registers."""
    facts = [dict(zip(("stack", "spill_stores", "spill_loads", "registers"), map(int, m.groups())))
             for m in _PTXAS.finditer(log)]
    return max(facts, key=lambda f: f["registers"]) if facts else {}


def main():
    jobs = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    ops = epi_tile_list.OPERANDS
    configs = epi_tile_list.configs()
    start = time.time()
    results = kernels.prepare_many([(ops, c) for c in configs], jobs=jobs)
    rows = []
    for config in configs:
        result = results[(ops, config)]
        row = {"config": config.build_name, "epilogue_tile": config.epilogue_tile}
        if isinstance(result, Exception):
            row["error"] = str(result)[:400]
            if isinstance(result, BuildError):
                row.update(ptxas_facts(Path(result.log_path).read_text()))
        else:
            log = (result.library.parent / "build.log").read_text()
            kernel = runtime.load(str(result.library), config.build_name)
            row.update(ptxas_facts(log), smem=kernel.shared_storage_bytes,
                       build_s=round(result.seconds, 1))
            tm, tn, tk = config.tile
            row["stage_bytes"] = (tm + tn) * tk * ops.element_a.bytes
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(f"wall {time.time() - start:.0f} s")
    out = Path(os.environ.get("OUT", "/tmp")) / "epi_tile_compile.json"
    out.write_text(json.dumps(rows, indent=1))
    print("wrote", out)


if __name__ == "__main__":
    main()
