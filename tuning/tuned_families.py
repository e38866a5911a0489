"""Every kernel family's tuned entries, for the commands that go over all of them (``cutlass-tune
list``, ``show``, ``clear``, ``export``, ``import``, ``merge``, ``doctor``): the schemas by
family name, and the caches present for a selection of families and GPUs.

The families' schemas live with the families (``custom_kernels.core.tuned_store.EntrySchema``);
this table on the top floor is the one place that knows them all. A new family adds its schema
here.
"""

from __future__ import annotations

from pathlib import Path

from cutlass_ops.gemms import gemm_entries
from cutlass_ops.gemms.grouped import grouped_entries, grouped_fp8_entries
from custom_kernels.core.tuned_store import EntrySchema, TuningCache, all_caches
from custom_kernels.norms import tuned as norm_entries

SCHEMAS: dict[str, EntrySchema] = {
    schema.family: schema
    for schema in (gemm_entries.SCHEMA, grouped_entries.SCHEMA, grouped_fp8_entries.SCHEMA,
                   norm_entries.SCHEMA)}
ALL = "all"
CHOICES = (*SCHEMAS, ALL)


def selected(family: str) -> list[EntrySchema]:
    """The schemas ``--family`` names (``all``: every one)."""
    if family == ALL:
        return list(SCHEMAS.values())
    if family not in SCHEMAS:
        raise ValueError(f"unknown kernel family {family!r}; choose from {list(CHOICES)}")
    return [SCHEMAS[family]]


def caches(family: str = ALL, gpu: str | None = None, root: Path | None = None
           ) -> list[TuningCache]:
    """The cache files present of the selected families, for GPUs whose name contains ``gpu``
    (case-insensitive; None: every GPU)."""
    return [cache for schema in selected(family) for cache in all_caches(schema, root)
            if not gpu or gpu.lower() in cache.scope.gpu.lower()]


__all__ = ["ALL", "CHOICES", "SCHEMAS", "caches", "selected"]
