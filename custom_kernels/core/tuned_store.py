"""The tuning cache: the winning config per GEMM problem, per device and software versions.

One JSON file per scope (GPU name, compute capability, SM count; driver, CUDA, CUTLASS and
library versions) under ``<cache root>/<version>/tuning/``, holding one entry per problem: the
winner, its time, torch's time and the runners-up. Each kernel family keeps its own files: GEMMs
there, the custom norm kernels' launch configs in ``tuning/norms/`` (so GEMM listings stay GEMM
listings); exports carry the family, so one bundle moves both to another machine. Files are
readable and shareable: ``export`` writes a document, ``merge`` folds one in (the faster winner of
two entries for a problem stays).

Safety: every update takes the file's lock, re-reads the file, changes one entry and replaces the
file atomically, so concurrent processes lose nothing and an interrupted tune keeps every entry it
finished. A truncated or corrupt file is set aside with a warning and the cache starts afresh.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from pathlib import Path
from typing import Any, Protocol

import filelock

from custom_kernels.core import cache_dir

FORMAT = 1


class Keyed(Protocol):
    """What a cache entry is keyed by: a problem of any kernel family with a stable ``name``."""

    @property
    def name(self) -> str: ...

# Kernel families and the subdirectory of the tuning directory that holds each one's files.
FAMILIES = {"gemm": "", "norms": "norms", "grouped": "grouped"}
GEMM = "gemm"


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
    def from_dict(cls, data: dict[str, Any]) -> CacheScope:
        return cls(**{f.name: data[f.name] for f in dataclasses.fields(cls)})

    @property
    def file_name(self) -> str:
        slug = re.sub(r"[^A-Za-z0-9]+", "-", self.gpu).strip("-").lower()
        digest = hashlib.sha256(json.dumps(self.to_dict(), sort_keys=True).encode()).hexdigest()
        return f"{slug}-cc{self.compute_capability}-sm{self.sm_count}-{digest[:12]}.json"


def _better(new: dict[str, Any], old: dict[str, Any] | None) -> bool:
    return old is None or new.get("winner_ms", float("inf")) < old.get("winner_ms", float("inf"))


class TuningCache:
    """The cache file of one scope and kernel family. ``root`` (the tuning directory) defaults to
    the library's cache directory."""

    def __init__(self, scope: CacheScope, root: Path | None = None, family: str = GEMM):
        self.scope = scope
        self.family = family
        directory = family_dir(family, root)
        directory.mkdir(parents=True, exist_ok=True)
        self.path = directory / scope.file_name
        self._lock = filelock.FileLock(str(self.path) + ".lock")

    def _read(self) -> dict[str, dict[str, Any]]:
        data = cache_dir.read_json_or_quarantine(self.path)
        if data is None:
            return {}
        if (not isinstance(data, dict) or data.get("format") != FORMAT
                or not isinstance(data.get("entries"), dict)
                or data.get("scope") != self.scope.to_dict()):
            cache_dir.quarantine(self.path, "is not a tuning cache of this format and scope")
            return {}
        return data["entries"]

    def _write(self, entries: dict[str, dict[str, Any]]) -> None:
        cache_dir.atomic_write_json(self.path, {"format": FORMAT, "scope": self.scope.to_dict(),
                                                "entries": entries})

    def entries(self) -> dict[str, dict[str, Any]]:
        return self._read()

    def get(self, problem: Keyed) -> dict[str, Any] | None:
        return self._read().get(problem.name)

    def put(self, problem: Keyed, entry: dict[str, Any]) -> None:
        """Stores one problem's result; replaces what was there."""
        with self._lock:
            entries = self._read()
            entries[problem.name] = {**entry, "problem": problem.to_dict()}
            self._write(entries)

    def merge(self, entries: dict[str, dict[str, Any]]) -> int:
        """Folds in entries (from an export of the same scope); the faster winner of a problem
        stays. Returns how many entries changed."""
        with self._lock:
            current = self._read()
            changed = 0
            for name, entry in entries.items():
                if _better(entry, current.get(name)):
                    current[name] = entry
                    changed += 1
            if changed:
                self._write(current)
            return changed

    def export(self) -> dict[str, Any]:
        return {"format": FORMAT, "family": self.family, "scope": self.scope.to_dict(),
                "entries": self._read()}

    def clear(self) -> None:
        with self._lock:
            self.path.unlink(missing_ok=True)


def import_document(document: dict[str, Any], root: Path | None = None) -> int:
    """Merges an exported document (or a bundle of them) into the cache file of its own scope
    (which may be another GPU's: a cache can be tuned on one machine and shipped to others).
    Returns how many entries changed."""
    return sum(TuningCache(CacheScope.from_dict(doc["scope"]), root, family_of(doc))
               .merge(doc["entries"]) for doc in documents_in(document))


def tuning_dir(root: Path | None = None) -> Path:
    return Path(root) if root is not None else cache_dir.versioned_dir("tuning")


def family_dir(family: str, root: Path | None = None) -> Path:
    if family not in FAMILIES:
        raise ValueError(f"unknown kernel family {family!r}; choose from {sorted(FAMILIES)}")
    return tuning_dir(root) / FAMILIES[family] if FAMILIES[family] else tuning_dir(root)


def family_of(document: dict[str, Any]) -> str:
    """The kernel family of an export document."""
    return document.get("family", GEMM)  # exports from before families were GEMM-only


def all_caches(root: Path | None = None, family: str = GEMM) -> list[TuningCache]:
    """The cache of every scope present (every GPU and software combination tuned here) for one
    kernel family."""
    out = []
    for path in sorted(family_dir(family, root).glob("*.json")):
        data = cache_dir.read_json_or_quarantine(path)
        if data is None:  # gone, or set aside as corrupt
            continue
        try:
            scope = CacheScope.from_dict(data["scope"])
        except (TypeError, KeyError):
            cache_dir.quarantine(path, "is not a tuning cache")
            continue
        cache = TuningCache(scope, root, family)
        if cache.path == path:
            out.append(cache)
    return out


BUNDLE = "cutlass-ops-tuning-bundle"


def bundle(documents: list[dict[str, Any]]) -> dict[str, Any]:
    """Several scopes' exports in one shareable document."""
    return {"format": FORMAT, "kind": BUNDLE, "caches": documents}


def documents_in(data: Any) -> list[dict[str, Any]]:
    """The per-scope export documents in a bundle or a single export; ValueError otherwise."""
    if isinstance(data, dict) and data.get("kind") == BUNDLE and isinstance(data.get("caches"),
                                                                            list):
        docs = data["caches"]
    else:
        docs = [data]
    for doc in docs:
        if not (isinstance(doc, dict) and doc.get("format") == FORMAT
                and isinstance(doc.get("entries"), dict) and isinstance(doc.get("scope"), dict)):
            raise ValueError("not a cutlass-ops tuning cache export (format mismatch)")
        if family_of(doc) not in FAMILIES:
            raise ValueError(f"not a cutlass-ops tuning cache export (unknown kernel family "
                             f"{family_of(doc)!r})")
        CacheScope.from_dict(doc["scope"])
    return docs


def merge_documents(documents: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Merges exports offline (no cache touched): per family and scope, the faster winner of each
    problem."""
    merged: dict[str, dict[str, Any]] = {}
    for doc in documents:
        key = family_of(doc) + json.dumps(doc["scope"], sort_keys=True)
        target = merged.setdefault(key, {"format": FORMAT, "family": family_of(doc),
                                         "scope": doc["scope"], "entries": {}})
        for name, entry in doc["entries"].items():
            if _better(entry, target["entries"].get(name)):
                target["entries"][name] = entry
    return list(merged.values())
