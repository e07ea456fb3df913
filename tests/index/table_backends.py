"""Both ``BlockTable`` implementations, for tests that run against each (``index.table``), and
the longest-prefix answer they must give.

Where the compiled core did not build, its cases skip, except under CI, where
``test_table_contract.test_compiled_core_is_built_in_ci`` fails instead.
"""
from __future__ import annotations

from collections.abc import Collection, Mapping

import pytest

from index.table import CoreBlockTable, PyBlockTable, TableBase

TABLES: list[type[TableBase]] = [PyBlockTable] + ([CoreBlockTable] if CoreBlockTable else [])

table_classes = pytest.mark.parametrize(
    "table_cls",
    [pytest.param(PyBlockTable, id="python"),
     pytest.param(CoreBlockTable, id="compiled",
                  marks=pytest.mark.skipif(CoreBlockTable is None,
                                           reason="index._table_core is not built"))])


def longest_prefixes(held: Mapping[str, Collection[int]], hashes: list[int]) -> dict[str, int]:
    """Per instance holding ``hashes[0]``, how many leading blocks of ``hashes`` it holds,
    counted block by block: the reference every lookup is checked against."""
    out = {}
    for name, blocks in held.items():
        k = 0
        while k < len(hashes) and hashes[k] in blocks:
            k += 1
        if k:
            out[name] = k
    return out
