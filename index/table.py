"""The in-memory block table behind every ``BlockIndex`` read path: ``BlockTable``.

One structure, shared by the memory backend, the etcd mirror and the router's predictions, so
that all answer ``lookup`` the same way and at the same speed. Two implementations with one
contract (``tests/index/test_table_contract.py`` runs it against both):

- ``CoreBlockTable`` (``index.table_core``): the block store and ``lookup`` in the C extension
  ``index._table_core``, built by ``pip install`` (``setup.py``) where a C compiler exists;
- ``PyBlockTable`` (``index.table_py``): pure Python, the fallback where the extension did not
  build, or when the environment sets ``KVATLAS_PURE_TABLE=1``.

``BACKEND`` says which one ``BlockTable`` is: ``"compiled"`` or ``"python"``.
"""
from __future__ import annotations

import logging
import os

from index.table_py import GPU, PyBlockTable, TableBase

logger = logging.getLogger(__name__)

try:
    from index.table_core import CoreBlockTable
except ImportError as exc:  # not built: no compiler where it was installed
    logger.debug("compiled block table unavailable (%s): using the pure-Python one", exc)
    CoreBlockTable = None  # type: ignore[assignment,misc]

BlockTable: type[TableBase]
if CoreBlockTable is not None and os.environ.get("KVATLAS_PURE_TABLE") != "1":
    BlockTable = CoreBlockTable
    BACKEND = "compiled"
else:
    BlockTable = PyBlockTable
    BACKEND = "python"

__all__ = ["BACKEND", "GPU", "BlockTable", "CoreBlockTable", "PyBlockTable", "TableBase"]
