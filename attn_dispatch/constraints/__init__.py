"""Every provider's constraint table, in one registry. The single source of truth for what runs where."""
from __future__ import annotations

import importlib

from .base import Check, Failure, Table, fail
from .common import context_parallel, no_softcap
from .flex_attention import refuse_user_mods

# family -> module defining the tables; each module lists its tables in TABLES (provider preference order).
_FAMILY_MODULES = ("flash_attn_4", "flash_attn_3", "cudnn_fused", "flash_attn_2", "flex_attention", "mem_efficient",
                   "unfused")


def _load() -> dict[str, Table]:
    tables: dict[str, Table] = {}
    for family in _FAMILY_MODULES:
        try:
            module = importlib.import_module(f"{__name__}.{family}")
        except ModuleNotFoundError as exc:
            if exc.name != f"{__name__}.{family}":
                raise
            continue  # family not declared yet
        for table in getattr(module, "TABLES", None) or [getattr(module, family.upper())]:
            tables[table.id] = table
    for table in tables.values():  # every engine runs under our context parallelism through the same rules
        if not any(c.code == f"{table.family}.cp_support" for c in table.checks):
            table.add(context_parallel(table))
        if not any(c.code == f"{table.family}.softcap" for c in table.checks):
            table.add(no_softcap(table))
        if not any(c.code == f"{table.family}.user_mods" for c in table.checks):
            table.add(refuse_user_mods(table))
    return tables


TABLES: dict[str, Table] = _load()


def tables_of(family: str) -> list[Table]:
    return [t for t in TABLES.values() if t.family == family]


__all__ = ["Check", "Failure", "Table", "TABLES", "fail", "tables_of"]
