"""Where cutlass-ops keeps what it writes, and how it writes it.

Everything lives under one root: ``$CUTLASS_OPS_CACHE_DIR`` if set (read at call time, so tests and
users can redirect it), else the platform's user cache directory. Nothing is ever written to the
current working directory. The directories the library creates there are private (mode 0o700,
whatever the umask): compiled code is loaded only from a cache no other user can write to
(``cache_trust``). Writes are atomic (temporary file in the same directory, then
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
    """``<root>/<library version>/<parts...>``, created on demand (``make_private_dirs``)."""
    path = cache_root().joinpath(__version__, *parts)
    make_private_dirs(path)
    return path


def make_private_dirs(path: Path) -> None:
    """Creates ``path`` and its missing parents, each with mode 0o700: only this user may list,
    write or enter them, whatever the umask (a group-writable default such as umask 002 would
    make the cache refuse its own kernels). Directories that exist keep their mode."""
    missing = []
    while not path.is_dir():
        missing.append(path)
        if path.parent == path:
            break
        path = path.parent
    for directory in reversed(missing):
        try:
            directory.mkdir(mode=0o700)
        except FileExistsError:  # a concurrent creator got there first
            pass


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


# The largest JSON file read from the cache (or imported into it): a tuning cache of thousands of
# shapes is a few MiB, and each read parses the whole file.
MAX_JSON_BYTES = 32 * 2**20


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    keys = [key for key, _ in pairs]
    if len(set(keys)) != len(keys):
        duplicate = next(key for key in keys if keys.count(key) > 1)
        raise ValueError(f"the key {duplicate[:80]!r} appears twice in one object")
    return dict(pairs)


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def loads_strict(data: bytes) -> Any:
    """JSON as the standard has it: UTF-8, no NaN or Infinity, no key twice in an object (which
    json.loads would resolve silently to the last), no nesting deep enough to exhaust the
    stack. ValueError (UnicodeDecodeError among them) otherwise."""
    try:
        return json.loads(data.decode("utf-8"), object_pairs_hook=_unique_keys,
                          parse_constant=_no_constant)
    except RecursionError:
        raise ValueError("nested too deeply") from None


def read_json_or_quarantine(path: Path) -> Any | None:
    """The JSON in ``path``; None if absent. A corrupt file (not UTF-8, not strict JSON:
    ``loads_strict``) or one over ``MAX_JSON_BYTES`` is renamed aside with a warning."""
    try:
        if path.stat().st_size > MAX_JSON_BYTES:
            quarantine(path, f"is larger than {MAX_JSON_BYTES // 2**20} MiB")
            return None
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    try:
        return loads_strict(data)  # what atomic_write_json writes
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
