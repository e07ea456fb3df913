"""Build of the optional compiled core of ``index.table`` (``index/_table_core.c`` and
``index/_table_store.c``).

Everything else is in pyproject.toml. The extension is optional: where it does not compile (no C
compiler), the install still succeeds and ``index.table`` uses its pure-Python table.
"""
from setuptools import Extension, setup

setup(ext_modules=[Extension(
    "index._table_core", ["index/_table_core.c", "index/_table_store.c"],
    depends=["index/_table_store.h"],
    # Hidden: the store's tc_* functions are internal to the module, only PyInit_ is exported.
    extra_compile_args=["-O3", "-std=c11", "-fvisibility=hidden"],
    optional=True)])
