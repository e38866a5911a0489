"""The one cache of built artifacts: nvcc shared objects and NVRTC cubins alike.

An entry is an artifact (``kernel.so``, ``<name>.cubin``) and a JSON sidecar beside it (the
build's metadata, or a cubin's symbol table), under
``<root>/<version>/<kind>/<arch>/<readable name>-<hash>``; the hash covers everything that changes
the output. ``get_or_build`` returns a complete entry or builds it once: check, take the entry's
file lock, check again, build into a temporary file, then publish the log, the sidecar and last
the artifact (``os.replace``). So an artifact that is present with a valid sidecar is a complete
entry, and a build that is interrupted or killed leaves none.

An artifact is returned only from a cache that no other user can write to (``cache_trust``:
``UnsafeCacheError`` otherwise, checked before a build too), and a built one is published
without group or other write permission, whatever the umask.

A failed build leaves one failure record, its log and a small JSON summary, and raises
``BuildError``. Kinds that keep failures re-raise the record without building again until asked to
retry. A corrupt entry (an empty or truncated artifact, a missing or invalid sidecar) is set aside
with ``cache_dir.quarantine`` and rebuilt, never raised.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import secrets
import stat
import struct
import time
from pathlib import Path
from typing import Any, Callable, Mapping, NamedTuple

import filelock

from custom_kernels.core import cache_dir, cache_trust
from custom_kernels.core.errors import BuildError

KEY_CHARS = 20  # of the sha256 hex digest: readable paths, no collision at any cache's size
SUMMARY_CHARS = 300


# ---- keys ------------------------------------------------------------------------------------

def key(payload: Mapping[str, Any]) -> str:
    """The hash of a JSON-able payload (canonical: sorted keys): the one key of every entry."""
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:KEY_CHARS]


def digest(data: bytes) -> str:
    """A payload field for large inputs (sources, headers): their sha256."""
    return hashlib.sha256(data).hexdigest()


def adopt(directory: Path, legacy: Path, artifact: str) -> None:
    """Moves an entry built under an earlier key (``legacy``) to its key now (``directory``) when
    only the earlier one exists and holds its artifact: the migration that keeps caches warm
    across a change of key. A concurrent adopter or builder that got there first wins."""
    if directory.exists() or not (legacy / artifact).is_file():
        return
    try:
        os.replace(legacy, directory)
    except OSError:  # the new entry appeared meanwhile, or the old one went
        pass


def entry_path(kind: str, arch: str, name: str, entry_key: str) -> Path:
    """``<root>/<version>/<kind>/<arch>/<name>-<key>`` (the arch directory is created)."""
    return cache_dir.versioned_dir(kind, arch) / f"{name}-{entry_key}"


# ---- entries ---------------------------------------------------------------------------------

def _is_dict(data: Any) -> bool:
    return isinstance(data, dict)


@dataclasses.dataclass(frozen=True)
class Entry:
    """Where one entry's files live, and what makes its sidecar valid."""

    name: str  # readable: names the entry in errors
    artifact: Path
    sidecar: Path
    log: Path
    failure: Path  # the JSON failure record
    lock: Path
    sidecar_ok: Callable[[Any], bool] = _is_dict
    # A kept failure is re-raised without building again until a retry is asked for.
    keep_failures: bool = True


def directory_entry(directory: Path, name: str, artifact: str, sidecar: str,
                    **options) -> Entry:
    """An entry that is a directory: ``<dir>/<artifact>``, ``<dir>/<sidecar>``, ``build.log``,
    ``failed.json``, locked by ``<dir>.lock``."""
    return Entry(name, directory / artifact, directory / sidecar, directory / "build.log",
                 directory / "failed.json", Path(f"{directory}.lock"), **options)


def file_entry(artifact: Path, **options) -> Entry:
    """An entry of sibling files named after the artifact: ``<stem>.json``, ``<stem>.log``,
    ``<stem>.failed.json``, ``<stem>.lock``."""
    return Entry(artifact.stem, artifact, artifact.with_suffix(".json"),
                 artifact.with_suffix(".log"), artifact.with_suffix(".failed.json"),
                 artifact.with_suffix(".lock"), **options)


# ---- the build protocol ----------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Built:
    """What a build function returns after writing the artifact to the path it was given."""

    sidecar: Any  # JSON, published beside the artifact
    log: str = ""  # kept in the entry's log when not empty


class BuildFailed(Exception):
    """Raised by a build function when the compiler refused: its full log, and a one-line summary
    (by default the log's first line that says "error")."""

    def __init__(self, log: str, summary: str | None = None):
        self.log = log
        self.summary = summary or summarize(log)
        super().__init__(self.summary)


class Published(NamedTuple):
    path: Path
    seconds: float  # build time; 0.0 when the entry came from the cache


def summarize(log: str) -> str:
    errors = [line.strip() for line in log.splitlines() if "error" in line]
    return errors[0][:SUMMARY_CHARS] if errors else log.strip()[-SUMMARY_CHARS:]


def get_or_build(entry: Entry, build: Callable[[Path], Built], *,
                 retry: bool = False) -> Published:
    """The entry's artifact: from the cache, or ``build(temporary path)`` now, once across threads
    and processes. Raises BuildError (the new or the kept failure), or UnsafeCacheError where
    the artifact or a directory above it could be written by another user (before building:
    nothing built there would be loaded)."""
    if is_complete(entry):
        return _loadable(Published(entry.artifact, 0.0))
    cache_trust.require_private(entry.artifact.parent)
    with filelock.FileLock(str(entry.lock)):
        # Only the lock holder sets corrupt files aside: a reader outside it could move away an
        # entry that a builder has just published.
        if is_complete(entry, repair=True):  # another caller built it while we waited
            return _loadable(Published(entry.artifact, 0.0))
        if entry.keep_failures and not retry:
            failure = kept_failure(entry)
            if failure is not None:
                raise failure
        entry.failure.unlink(missing_ok=True)
        return _loadable(_build(entry, build))


def _loadable(published: Published) -> Published:
    """``published``, once its artifact and the directories above it are private."""
    cache_trust.require_private(published.path)
    return published


def is_complete(entry: Entry, *, repair: bool = False) -> bool:
    """Whether the entry is whole. With ``repair``, a corrupt artifact is set aside (its sidecar
    too when that is not JSON), so that the caller rebuilds it."""
    try:
        why = damage(entry.artifact)
    except FileNotFoundError:  # absent, or set aside by the lock holder since
        return False
    if why is None:
        sidecar = (cache_dir.read_json_or_quarantine(entry.sidecar) if repair
                   else _read_json(entry.sidecar))
        if sidecar is None or not entry.sidecar_ok(sidecar):
            why = f"has no valid {entry.sidecar.name}"
    if why is not None and repair:
        cache_dir.quarantine(entry.artifact, why)
    return why is None


def damage(path: Path) -> str | None:
    """Why the artifact at ``path`` cannot be whole, or None: it is empty, or it is an ELF file
    (what nvcc and NVRTC write) whose header tables reach past its end."""
    size = path.stat().st_size
    if size == 0:
        return "is empty"
    with open(path, "rb") as f:
        head = f.read(64)
    if head[:4] != b"\x7fELF" or head[4:6] != b"\x02\x01":  # 64-bit little-endian only
        return None
    if len(head) < 64:
        return "is truncated"
    program_at, sections_at = struct.unpack_from("<QQ", head, 0x20)
    program_size, program_count, section_size, section_count = struct.unpack_from(
        "<HHHH", head, 0x36)
    end = max(program_at + program_size * program_count, sections_at + section_size * section_count)
    return "is truncated" if end > size else None


def kept_failure(entry: Entry) -> BuildError | None:
    """The BuildError of the entry's failure record, or None. A corrupt record is set aside."""
    record = cache_dir.read_json_or_quarantine(entry.failure)
    if record is None:
        return None
    if not isinstance(record, dict):
        cache_dir.quarantine(entry.failure, "is not a failure record")
        return None
    return BuildError(entry.name, str(entry.log), str(record.get("summary", "")))


def _read_json(path: Path) -> Any | None:
    try:
        return json.loads(path.read_bytes().decode())
    except (OSError, ValueError):
        return None


def _build(entry: Entry, build: Callable[[Path], Built]) -> Published:
    # A fresh name the build creates (so the artifact gets the compiler's usual file mode).
    tmp = entry.artifact.with_name(
        f".{entry.artifact.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    cache_dir.make_private_dirs(tmp.parent)
    start = time.perf_counter()
    try:
        try:
            built = build(tmp)
            why = damage(tmp) if tmp.is_file() else "is missing"
            if why is not None:
                raise BuildFailed(built.log, f"the build reported success but its output {why}")
            # Compilers honour the umask (nvcc's 0o775 under umask 002): no group or other
            # write on what this process and others will load.
            os.chmod(tmp, stat.S_IMODE(os.stat(tmp).st_mode) & ~(stat.S_IWGRP | stat.S_IWOTH))
        except BuildFailed as failed:
            raise _record_failure(entry, failed, time.perf_counter() - start) from failed.__cause__
        seconds = time.perf_counter() - start
        if built.log:
            cache_dir.atomic_write_text(entry.log, built.log)
        cache_dir.atomic_write_json(entry.sidecar, built.sidecar)
        os.replace(tmp, entry.artifact)  # last: the artifact's presence marks a complete entry
    finally:
        tmp.unlink(missing_ok=True)
    return Published(entry.artifact, seconds)


def _record_failure(entry: Entry, failed: BuildFailed, seconds: float) -> BuildError:
    cache_dir.atomic_write_text(entry.log, failed.log)
    cache_dir.atomic_write_json(entry.failure, {"summary": failed.summary,
                                                "seconds": round(seconds, 3)})
    return BuildError(entry.name, str(entry.log), failed.summary)
