"""The tuned-results store: the winning config per problem, per device and software versions.

One JSON file per scope (GPU name, compute capability, SM count; driver, CUDA, CUTLASS and
library versions) and kernel family under ``<cache root>/<version>/tuning/``: GEMMs there, each
other family in its own folder (``norms/``, ``grouped/``). Files are readable and shareable:
``export`` writes a document, a bundle carries several, ``import_documents`` folds them in (the
faster of two valid entries for a problem stays).

A trust boundary: what is read from a cache file or an imported document is input. Each family
has one schema (an ``EntrySchema``: ``cutlass_ops.gemms.gemm_entries``,
``cutlass_ops.gemms.grouped.grouped_entries``, ``custom_kernels.norms.tuned``) that turns a stored
entry into a typed record or rejects it; the rest of the code sees records only. A scope must
have its fields' types, and the file path built from it must stay in the family's folder. A
rejected entry is skipped with one log line naming the file, the key and the reason, counted
(``TuningCache.rejections``), and never displaces an accepted one or breaks a lookup.

Safety of writes: every update takes the file's lock, re-reads the file, changes one entry and
replaces the file atomically, so concurrent processes lose nothing and an interrupted tune keeps
every entry it finished. A truncated, corrupt or oversized file is set aside with a warning and
the cache starts afresh.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import re
from pathlib import Path
from typing import Any, Iterable, Mapping, Protocol

import filelock

from custom_kernels.core import cache_dir
from custom_kernels.core.tuned_fields import EntryRejected, integer, mapping, require, text

FORMAT = 1
BUNDLE = "cutlass-ops-tuning-bundle"
MAX_FILE_BYTES = cache_dir.MAX_JSON_BYTES  # a cache file or an imported file: 32 MiB
_MAX_KEY = 400
_log = logging.getLogger(__name__)
_logged: set[tuple[str, str, str]] = set()

__all__ = ["BUNDLE", "FORMAT", "MAX_FILE_BYTES", "CacheScope", "Document", "EntryRejected",
           "EntrySchema", "ImportReport", "Keyed", "Rejection", "TunedEntry", "TuningCache",
           "all_caches", "bundle", "family_dir", "import_documents", "merge_documents",
           "parse_documents", "tuning_dir"]


class Keyed(Protocol):
    """What a cache entry is keyed by: a problem of any kernel family with a stable ``name``."""

    @property
    def name(self) -> str: ...

    def to_dict(self) -> dict[str, Any]: ...


class TunedEntry(Protocol):
    """A family's typed record of one stored entry."""

    key: str
    winner_ms: float | None  # None: no kernel won (every candidate failed)

    def to_dict(self) -> dict[str, Any]:
        """What is stored and exported."""


class EntrySchema(Protocol):
    """One kernel family's entries: where they live and how one is read."""

    family: str  # "gemm", "grouped", "norms": the name exports carry
    directory: str  # the family's folder under the tuning directory ("" for the GEMMs)

    def parse(self, key: str, raw: Any, scope: CacheScope) -> TunedEntry:
        """The record of ``raw`` stored under ``key`` for ``scope``; raises EntryRejected."""


@dataclasses.dataclass(frozen=True)
class Rejection:
    source: str  # the file (or document) the entry came from
    key: str
    reason: str

    def __str__(self) -> str:
        return f"{self.source}: entry {self.key!r} rejected: {self.reason}"


def _report(rejection: Rejection) -> Rejection:
    """Logs a rejection once per process (a cache file is read again on every change)."""
    seen = (rejection.source, rejection.key, rejection.reason)
    if seen not in _logged:
        _logged.add(seen)
        _log.warning("cutlass-ops: %s", rejection)
    return rejection


# ---- scopes ------------------------------------------------------------------------------------

# Version strings and the GPU's name: printable, no path separators, no "..".
_SAFE_TEXT = re.compile(r"[A-Za-z0-9 ._+()\-]{0,128}")
_CC_TEXT = re.compile(r"(\d{1,2})\.(\d)|(\d{1,4})")


@dataclasses.dataclass(frozen=True)
class CacheScope:
    """Everything besides the problem that changes which kernel wins."""

    gpu: str
    compute_capability: int
    sm_count: int
    driver: str
    cuda: str
    cutlass: str
    library: str

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Any) -> CacheScope:
        """The scope a document or a cache file names; EntryRejected (a ValueError) when a
        field is missing, of the wrong type, or could reach outside the cache in a path."""
        data = mapping(data, "the scope")
        unknown = set(data) - {f.name for f in dataclasses.fields(cls)}
        require(not unknown, f"the scope has unknown fields {sorted(unknown)[:5]}")
        strings = {}
        for name in ("gpu", "driver", "cuda", "cutlass", "library"):
            value = text(data, name)
            require(bool(_SAFE_TEXT.fullmatch(value)) and ".." not in value,
                    f"the scope's {name} {value[:40]!r} has characters a name cannot have")
            strings[name] = value
        return cls(compute_capability=_compute_capability(data.get("compute_capability")),
                   sm_count=integer(data, "sm_count", 1, 100_000), **strings)

    @property
    def file_name(self) -> str:
        slug = re.sub(r"[^A-Za-z0-9]+", "-", self.gpu).strip("-").lower() or "gpu"
        digest = hashlib.sha256(json.dumps(self.to_dict(), sort_keys=True).encode()).hexdigest()
        return f"{slug}-cc{self.compute_capability}-sm{self.sm_count}-{digest[:12]}.json"


def _compute_capability(value: Any) -> int:
    """90 from 90, "90" or "9.0"."""
    if isinstance(value, str):
        match = _CC_TEXT.fullmatch(value)
        require(match is not None, f"the scope's compute_capability {value[:20]!r} is not "
                "digits like 90 or 9.0")
        value = int(match[1]) * 10 + int(match[2]) if match[1] else int(match[3])
    return integer({"compute_capability": value}, "compute_capability", 10, 10_000)


# ---- one scope's file ----------------------------------------------------------------------------

def tuning_dir(root: Path | None = None) -> Path:
    return Path(root) if root is not None else cache_dir.versioned_dir("tuning")


def family_dir(schema: EntrySchema, root: Path | None = None) -> Path:
    """The folder of ``schema``'s files; created on demand by the writers."""
    base = tuning_dir(root)
    return base / schema.directory if schema.directory else base


@dataclasses.dataclass
class _Parsed:
    signature: tuple
    entries: dict[str, TunedEntry]
    rejections: list[Rejection]


_parsed: dict[Path, _Parsed] = {}  # per file, while its (inode, size, mtime) stays the same


class TuningCache:
    """The cache file of one scope and kernel family. ``root`` (the tuning directory) defaults to
    the library's cache directory."""

    def __init__(self, scope: CacheScope, schema: EntrySchema, root: Path | None = None):
        self.scope = scope
        self.schema = schema
        directory = family_dir(schema, root)
        self.path = directory / scope.file_name
        # The name is built from checked fields; this is the second lock on the door.
        if self.path.resolve().parent != directory.resolve():
            raise EntryRejected(f"the scope's file {scope.file_name!r} would leave {directory}")
        self._file_lock = filelock.FileLock(str(self.path) + ".lock")

    def _locked(self) -> filelock.FileLock:
        """The file's lock, its folder created first (the lock file lives beside it)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        return self._file_lock

    @property
    def family(self) -> str:
        return self.schema.family

    def _load(self) -> _Parsed:
        try:
            stat = self.path.stat()
            signature = (stat.st_ino, stat.st_size, stat.st_mtime_ns)
        except FileNotFoundError:
            return _Parsed((), {}, [])
        known = _parsed.get(self.path)
        if known is not None and known.signature == signature:
            return known
        data = cache_dir.read_json_or_quarantine(self.path)
        if data is None:
            return _Parsed((), {}, [])
        if (not isinstance(data, dict) or data.get("format") != FORMAT
                or not isinstance(data.get("entries"), dict)
                or data.get("scope") != self.scope.to_dict()):
            cache_dir.quarantine(self.path, "is not a tuning cache of this format and scope")
            return _Parsed((), {}, [])
        entries, rejections = parse_entries(self.schema, self.scope, data["entries"],
                                            str(self.path))
        parsed = _Parsed(signature, entries, rejections)
        _parsed[self.path] = parsed
        return parsed

    def entries(self) -> dict[str, TunedEntry]:
        """The valid entries, by key."""
        return dict(self._load().entries)

    def rejections(self) -> list[Rejection]:
        """The entries of the file that failed the schema (skipped, and logged once)."""
        return list(self._load().rejections)

    def get(self, problem: Keyed) -> TunedEntry | None:
        return self._load().entries.get(problem.name)

    def put(self, problem: Keyed, fields: Mapping[str, Any]) -> TunedEntry:
        """Stores one problem's result, replacing what was there. Our tuners write entries the
        schema accepts; one it rejects is a bug, and raises EntryRejected."""
        entry = self.schema.parse(problem.name, {**fields, "problem": problem.to_dict()},
                                  self.scope)
        with self._locked():
            current = self._load().entries
            self._write({**current, problem.name: entry})
        return entry

    def merge(self, raw_entries: Mapping[str, Any], source: str = "merged entries"
              ) -> ImportReport:
        """Folds in stored entries (an export of this scope and family); each is parsed first,
        and the faster of two valid entries for a problem stays."""
        entries, rejections = parse_entries(self.schema, self.scope, raw_entries, source)
        return self.merge_records(entries, rejections)

    def merge_records(self, entries: Mapping[str, TunedEntry],
                      rejections: Iterable[Rejection] = ()) -> ImportReport:
        with self._locked():
            current = self._load().entries
            changed = {key: entry for key, entry in entries.items()
                       if better(entry, current.get(key))}
            if changed:
                self._write({**current, **changed})
        return ImportReport(len(entries), len(changed), list(rejections))

    def export(self) -> dict[str, Any]:
        return {"format": FORMAT, "family": self.family, "scope": self.scope.to_dict(),
                "entries": {key: e.to_dict() for key, e in sorted(self.entries().items())}}

    def clear(self) -> None:
        with self._locked():
            self.path.unlink(missing_ok=True)
        _parsed.pop(self.path, None)

    def _write(self, entries: Mapping[str, TunedEntry]) -> None:
        cache_dir.atomic_write_json(self.path, {
            "format": FORMAT, "scope": self.scope.to_dict(),
            "entries": {key: e.to_dict() for key, e in sorted(entries.items())}})


def better(new: TunedEntry, old: TunedEntry | None) -> bool:
    """Whether ``new`` replaces ``old``: it is the first, or its winner is faster (an entry
    whose every candidate failed has no time and gives way to any)."""
    inf = float("inf")
    return old is None or (new.winner_ms or inf) < (old.winner_ms or inf)


def parse_entries(schema: EntrySchema, scope: CacheScope, raw_entries: Any, source: str
                  ) -> tuple[dict[str, TunedEntry], list[Rejection]]:
    """The valid entries of a stored ``entries`` object, and the rejections (logged)."""
    if not isinstance(raw_entries, Mapping):
        return {}, [_report(Rejection(source, "*", "entries is not an object"))]
    entries, rejections = {}, []
    for key, raw in raw_entries.items():
        try:
            require(isinstance(key, str) and 0 < len(key) <= _MAX_KEY,
                    f"a key of 1 to {_MAX_KEY} characters is needed")
            entries[key] = schema.parse(key, raw, scope)
        except EntryRejected as exc:
            rejections.append(_report(Rejection(source, str(key)[:80], str(exc))))
    return entries, rejections


def all_caches(schema: EntrySchema, root: Path | None = None) -> list[TuningCache]:
    """The cache of every scope present (every GPU and software combination tuned here) for one
    kernel family. A file whose scope is unreadable is set aside."""
    directory = family_dir(schema, root)
    out = []
    for path in sorted(directory.glob("*.json")) if directory.is_dir() else ():
        data = cache_dir.read_json_or_quarantine(path)
        if data is None:  # gone, or set aside as corrupt
            continue
        try:
            cache = TuningCache(CacheScope.from_dict(
                data.get("scope") if isinstance(data, dict) else None), schema, root)
        except EntryRejected as exc:
            cache_dir.quarantine(path, f"is not a tuning cache ({exc})")
            continue
        if cache.path == path:
            out.append(cache)
    return out


# ---- documents: exports, bundles, imports, merges ------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Document:
    """One scope's and family's entries from an export, parsed and checked."""

    schema: EntrySchema
    scope: CacheScope
    entries: dict[str, TunedEntry]
    rejections: tuple[Rejection, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"format": FORMAT, "family": self.schema.family, "scope": self.scope.to_dict(),
                "entries": {key: e.to_dict() for key, e in sorted(self.entries.items())}}


@dataclasses.dataclass
class ImportReport:
    valid: int = 0  # entries that passed their schema
    changed: int = 0  # of those, added or faster than what was there
    rejections: list[Rejection] = dataclasses.field(default_factory=list)

    def add(self, other: ImportReport) -> ImportReport:
        return ImportReport(self.valid + other.valid, self.changed + other.changed,
                            self.rejections + other.rejections)


def bundle(documents: list[dict[str, Any]]) -> dict[str, Any]:
    """Several scopes' exports in one shareable document."""
    return {"format": FORMAT, "kind": BUNDLE, "caches": documents}


def parse_documents(data: Any, schemas: Mapping[str, EntrySchema], source: str
                    ) -> tuple[list[Document], list[Rejection]]:
    """The documents of a bundle or a single export, each entry parsed by its family's schema.
    A document of an unknown family, another format or a bad scope is rejected whole (one
    rejection naming its index); ValueError when ``data`` is neither a bundle nor an export."""
    if isinstance(data, dict) and data.get("kind") == BUNDLE:
        raw_docs = data.get("caches")
        if data.get("format") != FORMAT or not isinstance(raw_docs, list):
            raise ValueError("not a cutlass-ops tuning bundle of this format")
    elif isinstance(data, dict) and "entries" in data and "scope" in data:
        raw_docs = [data]
    else:
        raise ValueError("not a cutlass-ops tuning cache export (no scope and entries)")
    documents, rejections = [], []
    for index, doc in enumerate(raw_docs):
        where = f"{source} (document {index})"
        try:
            doc = mapping(doc, "the document")
            require(doc.get("format") == FORMAT, "not a tuning cache export of this format")
            family = doc.get("family", "gemm")  # exports from before families were GEMM-only
            require(isinstance(family, str) and family in schemas,
                    f"unknown kernel family {str(family)[:40]!r} (known: {sorted(schemas)})")
            scope = CacheScope.from_dict(doc.get("scope"))
            require(isinstance(doc.get("entries"), Mapping), "entries is not an object")
        except EntryRejected as exc:
            rejections.append(_report(Rejection(where, "*", str(exc))))
            continue
        schema = schemas[family]
        entries, rejected = parse_entries(schema, scope, doc["entries"], where)
        documents.append(Document(schema, scope, entries, tuple(rejected)))
        rejections += rejected
    return documents, rejections


def import_documents(documents: Iterable[Document], root: Path | None = None) -> ImportReport:
    """Merges parsed documents into the cache files of their own scopes (which may be another
    GPU's: a cache can be tuned on one machine and shipped to others)."""
    report = ImportReport()
    for doc in documents:
        cache = TuningCache(doc.scope, doc.schema, root)
        report = report.add(cache.merge_records(doc.entries, doc.rejections))
    return report


def merge_documents(documents: Iterable[Document]) -> list[Document]:
    """Merges parsed documents offline (no cache touched): per family and scope, the faster of
    the valid entries for each problem."""
    merged: dict[tuple[str, str], Document] = {}
    for doc in documents:
        key = (doc.schema.family, json.dumps(doc.scope.to_dict(), sort_keys=True))
        target = merged.setdefault(key, Document(doc.schema, doc.scope, {}, ()))
        for name, entry in doc.entries.items():
            if better(entry, target.entries.get(name)):
                target.entries[name] = entry
    return list(merged.values())


def read_document_file(path: Path) -> Any:
    """The JSON of an export file, refusing one over ``MAX_FILE_BYTES`` before reading it, and
    duplicate keys or NaN in it (ValueError with the reason)."""
    try:
        size = os.stat(path).st_size
        if size > MAX_FILE_BYTES:
            raise ValueError(f"{path} is {size / 2**20:.1f} MiB; tuning exports over "
                             f"{MAX_FILE_BYTES // 2**20} MiB are refused")
        data = Path(path).read_bytes()
    except OSError as exc:
        raise ValueError(f"cannot read {path}: {exc.strerror}") from exc
    try:
        return cache_dir.loads_strict(data)
    except ValueError as exc:
        raise ValueError(f"{path} is not a readable JSON export: {exc}") from exc
