"""Policies by name: the one place that knows every policy class.

Separate from ``router.policy`` (the ABC and the load-only policies) because ``router.kv_aware``
builds on that module: a factory there would have to import kv_aware back.
"""
from __future__ import annotations

from typing import Any

from router.kv_aware import KvAware
from router.policy import Policy, PowerOfTwo, RandomPolicy, RoundRobin


def make_policy(name: str, **kv_args: Any) -> Policy:
    """The policy called ``name``; kv_aware takes ``KvAware``'s keyword arguments (``config``,
    ``lookup``, ``index_version``), the others none."""
    if name == "round_robin":
        return RoundRobin()
    if name == "random":
        return RandomPolicy()
    if name == "power_of_two":
        return PowerOfTwo()
    if name == "kv_aware":
        return KvAware(**kv_args)
    raise ValueError(f"unknown policy {name!r}")
