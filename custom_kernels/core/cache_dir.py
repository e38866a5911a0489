"""Where cutlass-ops keeps what it writes, and how it writes it.

Everything lives under one root: ``$CUTLASS_OPS_CACHE_DIR`` if set (read at call time, so tests and
users can redirect it), else the platform's user cache directory. Nothing is ever written to the
current working directory. Writes are atomic (temporary file in the same directory, then
``os.replace``) so that readers never see half a file, even if the writer is killed.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import platformdirs

from custom_kernels.core.version import __version__

ENV_VAR = "CUTLASS_OPS_CACHE_DIR"

# A corrupt file is logged, not warned about: the caller can do nothing about it (it is set aside
# and rebuilt), which is logging's case in the logging HOWTO, and an unconfigured logger prints
# the bare message, where a warning would print one of our source lines under it.
_log = logging.getLogger(__name__)


def cache_root() -> Path:
    override = os.environ.get(ENV_VAR)
    root = Path(override).expanduser() if override else platformdirs.user_cache_path("cutlass-ops")
    return root.resolve()


def versioned_dir(*parts: str) -> Path:
    """``<root>/<library version>/<parts...>``, created on demand."""
    path = cache_root().joinpath(__version__, *parts)
    path.mkdir(parents=True, exist_ok=True)
    return path


def atomic_write_bytes(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write_bytes(path, text.encode())


def atomic_write_json(path: Path, data: Any) -> None:
    atomic_write_text(path, json.dumps(data, indent=1, sort_keys=True) + "\n")


def read_json_or_quarantine(path: Path) -> Any | None:
    """The JSON in ``path``; None if absent. A corrupt file (not UTF-8, or not JSON) is renamed
    aside with a warning."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    try:
        return json.loads(data.decode("utf-8"))  # what atomic_write_json writes
    except UnicodeDecodeError:
        quarantine(path, "is not UTF-8 text")
    except ValueError:
        quarantine(path, "is not valid JSON")
    return None


def quarantine(path: Path, why: str) -> Path:
    aside = path.with_name(f"{path.name}.corrupt-{int(time.time())}-{os.getpid()}")
    try:
        os.replace(path, aside)
    except FileNotFoundError:
        return aside
    _log.warning("cutlass-ops: %s %s; moved it to %s and will rebuild it", path, why, aside.name)
    return aside
