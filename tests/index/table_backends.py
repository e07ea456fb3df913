"""Both ``BlockTable`` implementations, for tests that run against each (``index.table``).

Where the compiled core did not build, its cases skip, except under CI, where
``test_table_contract.test_compiled_core_is_built_in_ci`` fails instead.
"""
from __future__ import annotations

import pytest

from index.table import CoreBlockTable, PyBlockTable, TableBase

TABLES: list[type[TableBase]] = [PyBlockTable] + ([CoreBlockTable] if CoreBlockTable else [])

table_classes = pytest.mark.parametrize(
    "table_cls",
    [pytest.param(PyBlockTable, id="python"),
     pytest.param(CoreBlockTable, id="compiled",
                  marks=pytest.mark.skipif(CoreBlockTable is None,
                                           reason="index._table_core is not built"))])
