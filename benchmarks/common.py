"""What every benchmark shares: the GPU it needs, and what it records beside its rows
(BENCHMARKS.md): GPU, versions, copy bandwidth."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def missing_gpu_reason() -> str | None:
    """Why this process cannot run the kernels (no CUDA torch, no GPU, not sm90), or None."""
    import torch

    if torch.version.cuda is None:
        return f"torch {torch.__version__} is a CPU build; install a CUDA build of torch"
    if not torch.cuda.is_available():
        return f"torch {torch.__version__} sees no CUDA GPU"
    major, minor = torch.cuda.get_device_capability()
    if (major, minor) != (9, 0):
        return f"{torch.cuda.get_device_name()} is sm{major}{minor}, not a Hopper (sm90) GPU"
    return None


def require_gpu() -> None:
    """Stop at once, with one line on stderr and exit code 2, where the kernels cannot run:
    otherwise a benchmark spends minutes in nvcc before its first launch fails."""
    reason = missing_gpu_reason()
    if reason is not None:
        script = sys.argv[0] or "this benchmark"
        print(f"{script} needs an sm90 CUDA GPU: {reason} (see README.md, Install)",
              file=sys.stderr)
        raise SystemExit(2)
    from custom_kernels import host_ops

    # Eager calls take the compiled host path once it is loaded: built (about 20 s, once per
    # torch) or found before anything is timed, so that no figure mixes the two paths.
    host_ops.ops(wait=True)


def require_gpu_and_dsl() -> None:
    """``require_gpu``, then the same for the ``cutlass-ops[dsl]`` extra (the DSL sweeps)."""
    require_gpu()
    from cutlass_ops.gemms import dsl

    why = dsl.unavailable()
    if why:
        print(f"{sys.argv[0] or 'this benchmark'} needs cutlass-ops[dsl]: {why}", file=sys.stderr)
        raise SystemExit(2)


def versions() -> dict:
    import importlib.metadata

    import torch

    from cutlass_ops import __version__
    from cutlass_ops.gemms.build import nvcc_version
    from custom_kernels import host_ops

    def run(*cmd):
        try:
            return subprocess.run(cmd, capture_output=True, text=True, timeout=30).stdout.strip()
        except OSError:
            return "unknown"

    # The GPU machine gets a copy of the tree without .git: the caller may name the commit.
    commit = os.environ.get("CUTLASS_OPS_COMMIT") or run(
        "git", "-C", str(Path(__file__).parent), "rev-parse", "--short", "HEAD")
    return {
        "torch": torch.__version__, "cuda": torch.version.cuda, "nvcc": nvcc_version(),
        "cutlass": importlib.metadata.version("nvidia-cutlass"),
        "driver": run("nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader")
        .splitlines()[0] if run("nvidia-smi", "-L") else "unknown",
        "project": f"{__version__}+{commit or 'unknown'}",
        "host_path": host_ops.status(),
    }


def copy_bandwidth_gbs() -> float:
    """A large device-to-device copy, bytes read plus written, median of 20."""
    import torch

    from tuning.timing import do_bench

    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    timing = do_bench(lambda: dst.copy_(src), reps=20, flush_l2=False)
    return 2 * src.numel() / timing.median_ms / 1e6


def read_bandwidth_gbs() -> float:
    """A large read-only pass (a float32 sum of 2 GiB of bf16), median of 20: a GEMM that streams
    weights mostly reads, which a copy's mix of reads and writes can understate."""
    import torch

    from tuning.timing import do_bench

    buf = torch.randn(1 << 30, dtype=torch.bfloat16, device="cuda")
    timing = do_bench(lambda: buf.sum(dtype=torch.float32), reps=20, flush_l2=False)
    return buf.numel() * buf.element_size() / timing.median_ms / 1e6


def write_result(name: str, rows: list[dict], **extra) -> Path:
    import torch

    data = {"benchmark": name, "gpu": torch.cuda.get_device_name(), "versions": versions(),
            **extra, "rows": rows}
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(data, indent=1) + "\n")
    return path


def rows_of_same_run(name: str, meta: dict) -> list[dict]:
    """The rows of ``benchmarks/results/<name>.json`` when that file was written by the same code
    (project version) with the same ``meta``; none otherwise. For benchmarks measured in
    sections across runs (one device call each), so that each run adds its rows to the others'."""
    try:
        old = json.loads((RESULTS / f"{name}.json").read_text())
    except (OSError, ValueError):
        return []
    same = old.get("versions", {}).get("project") == versions()["project"] and all(
        old.get(k) == v for k, v in meta.items())
    return old.get("rows", []) if same else []


def labelled_rows(name: str, meta: dict) -> list[dict]:
    """The rows of ``benchmarks/results/<name>.json`` when that file was written with the same
    ``meta`` (model, sizes, settings), by any code: a row of other code than this run's says so
    in ``detail["run"]`` (GPU and versions), so that figures kept from an earlier device call
    stand labelled beside the new ones."""
    try:
        old = json.loads((RESULTS / f"{name}.json").read_text())
    except (OSError, ValueError):
        return []
    if any(old.get(k) != v for k, v in meta.items()):
        return []
    if old.get("versions", {}).get("project") == versions()["project"]:
        return old.get("rows", [])
    run = {"gpu": old.get("gpu"), "versions": old.get("versions")}
    return [{**r, "detail": {"run": run, **r.get("detail", {})}} for r in old.get("rows", [])]


def print_table(headers: list[str], rows: list[list]) -> None:
    widths = [max(len(str(x)) for x in col) for col in zip(headers, *rows)]
    for row in [headers, ["-" * w for w in widths], *rows]:
        print("  ".join(str(x).rjust(w) for x, w in zip(row, widths)), flush=True)


@contextlib.contextmanager
def private_cache_with_online_compile():
    """An empty cache, so that no tuned entry or nearby shape sends the shape to torch: the
    online mode builds and runs the model's CUTLASS pick, and the row times our own path."""
    from cutlass_ops.gemms import dispatch
    from tuning.online import ONLINE

    previous = os.environ.get("CUTLASS_OPS_CACHE_DIR")
    private = tempfile.mkdtemp(prefix="cutlass-ops-host-")
    os.environ["CUTLASS_OPS_CACHE_DIR"] = private
    dispatch.register_online_tuner(ONLINE)  # a checkout without `pip install` has no entry point
    dispatch.set_online("compile")
    try:
        yield
    finally:
        dispatch.set_online(None)
        if previous is None:
            os.environ.pop("CUTLASS_OPS_CACHE_DIR", None)
        else:
            os.environ["CUTLASS_OPS_CACHE_DIR"] = previous
        dispatch.reset()
        shutil.rmtree(private, ignore_errors=True)
