"""Parent side of emission: ask the cutlass_cppgen child process for kernel source, cache it.

The emitted source for a (operands, build fields) pair is cached on disk under the library version
and the installed nvidia-cutlass version, so a later process finds its artifact without starting
cutlass_cppgen at all. The emitted ``TileShape`` and ``ClusterShape`` are checked against the
config, because cutlass_cppgen derives them from its own ``threadblock_shape``.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Iterable

import filelock

from custom_kernels.core import cache_dir, cache_trust
from cutlass_ops.gemms.config import Arch, GemmConfig, GemmOperands
from custom_kernels.core.errors import EmissionError, ToolchainError


def cutlass_version() -> str:
    try:
        return importlib.metadata.version("nvidia-cutlass")
    except importlib.metadata.PackageNotFoundError as exc:
        raise ToolchainError("nvidia-cutlass is not installed: pip install nvidia-cutlass") from exc


def _spec_hash(*parts: Any) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _emitted_path(operands: GemmOperands, config: GemmConfig) -> Path:
    key = _spec_hash(operands.to_dict(), [str(f) for f in config.build_fields()], cutlass_version())
    return cache_dir.versioned_dir("emitted", config.arch.value) / (
        f"{operands.name}-{config.build_name}-{key}.h")


def run_bridge(request: dict[str, Any], timeout: float = 600) -> dict[str, Any]:
    """Runs one cutlass_bridge request in a child process whose working directory is our cache."""
    workdir = cache_dir.versioned_dir("cutlass_cppgen_cwd")
    with tempfile.TemporaryDirectory(dir=workdir) as tmp:
        request_path = Path(tmp) / "request.json"
        result_path = Path(tmp) / "result.json"
        request_path.write_text(json.dumps(request))
        env = dict(os.environ)
        # The child must import this very package, wherever the parent found it.
        package_parent = str(Path(__file__).resolve().parents[2])  # holds cutlass_ops/
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_parent, env.get("PYTHONPATH")]))
        proc = subprocess.run(
            [sys.executable, "-m", "cutlass_ops.gemms.cutlass_bridge", str(request_path),
             str(result_path)],
            cwd=workdir, env=env, capture_output=True, text=True, timeout=timeout)
        if proc.returncode != 0 or not result_path.exists():
            raise EmissionError(f"cutlass_cppgen child process failed (exit {proc.returncode}):\n"
                                f"{proc.stderr[-4000:]}")
        result = json.loads(result_path.read_text())
    if "fatal" in result:
        raise EmissionError(f"cutlass_cppgen failed:\n{result['fatal']}")
    return result


_SHAPE = r"cute::Shape<cute::_(\d+),\s*cute::_(\d+),\s*cute::_(\d+)>"
# cutlass_cppgen names it CollectiveMainloop, cutlass_library (blockwise kernels) <name>_mainloop.
_MAINLOOP = re.compile(r"(?:CollectiveMainloop|_mainloop)\s*=.*?" + _SHAPE + r",\s*" + _SHAPE,
                       re.S)


def check_emitted_shapes(source: str, config: GemmConfig) -> None:
    """Refuses source whose TileShape, ClusterShape or epilogue tile differ from what the config
    names."""
    epilogue_tile = config.epilogue_tile_cpp
    if f"{epilogue_tile}," not in source:
        raise EmissionError(f"{config.build_name}: the emitted source has no {epilogue_tile}")
    match = _MAINLOOP.search(source)
    if not match:
        raise EmissionError(f"{config.build_name}: no TileShape/ClusterShape in emitted source")
    values = [int(v) for v in match.groups()]
    tile, cluster = tuple(values[:3]), tuple(values[3:])
    if tile != config.tile or cluster != config.cluster:
        raise EmissionError(f"{config.build_name}: cutlass_cppgen emitted TileShape {tile} and "
                            f"ClusterShape {cluster}, not {config.tile} and {config.cluster}")


def cached_source(operands: GemmOperands, config: GemmConfig) -> str | None:
    """The emitted source if it is in the cache, else None (no emission)."""
    return _read_source(_emitted_path(operands, config))


def _read_source(path) -> str | None:
    """A cached source, or None when absent; an empty or undecodable file is set aside (the
    cache's corruption rule), so that it is emitted again. Raises UnsafeCacheError where another
    user could have written it: the source is compiled into a kernel this process loads."""
    cache_trust.require_private(path)
    try:
        text = path.read_bytes().decode()
    except OSError:
        return None
    except UnicodeDecodeError:
        cache_dir.quarantine(path, "is not UTF-8 text")
        return None
    if not text.strip():
        cache_dir.quarantine(path, "is empty")
        return None
    return text


def emit_sources(operands: GemmOperands, configs: Iterable[GemmConfig]) -> dict[GemmConfig, str]:
    """Kernel source for each config (keyed by the config given), from cache or one child process
    per arch. A config that cutlass_cppgen rejects maps to an EmissionError instance."""
    configs = list(dict.fromkeys(configs))
    out: dict[GemmConfig, Any] = {}
    missing: dict[Arch, list[GemmConfig]] = {}
    for config in configs:
        source = _read_source(_emitted_path(operands, config))
        if source is not None:
            out[config] = source
        else:
            missing.setdefault(config.arch, []).append(config)
    for arch, todo in missing.items():
        # One lock per arch: concurrent processes would otherwise emit the same batch twice.
        lock = filelock.FileLock(str(cache_dir.versioned_dir("locks") / f"emit-{arch.value}.lock"))
        with lock:
            todo = [c for c in todo if not _emitted_path(operands, c).exists()]
            if todo:
                result = run_bridge({"op": "emit", "arch": arch.value,
                                     "operands": operands.to_dict(),
                                     "configs": [c.to_dict() for c in todo]})
                for config, item in zip(todo, result["results"]):
                    if "error" in item:
                        out[config] = EmissionError(f"{config.build_name}: {item['error']}")
                        continue
                    check_emitted_shapes(item["source"], config)
                    cache_dir.atomic_write_text(_emitted_path(operands, config), item["source"])
        for config in missing[arch]:
            if config not in out:
                out[config] = _emitted_path(operands, config).read_text()
    return out


def emit_source(operands: GemmOperands, config: GemmConfig) -> str:
    source = emit_sources(operands, [config])[config]
    if isinstance(source, Exception):
        raise source
    return source


def cutlass_tile_descriptions(operands: GemmOperands, arch: Arch) -> list[dict[str, Any]]:
    """cutlass_cppgen's tile descriptions for these operands, cached as JSON."""
    path = cache_dir.versioned_dir("tile_descriptions") / (
        f"{arch.value}-{operands.name}-{_spec_hash(cutlass_version())}.json")
    cached = cache_dir.read_json_or_quarantine(path)
    if isinstance(cached, list):
        return cached
    result = run_bridge({"op": "tile_descriptions", "arch": arch.value,
                         "operands": operands.to_dict()})
    cache_dir.atomic_write_json(path, result["tile_descriptions"])
    return result["tile_descriptions"]
