"""Errors of KV-event decoding."""
from __future__ import annotations

from index.errors import IndexLayerError


class MalformedEvent(IndexLayerError, ValueError):
    """A KV-event message that cannot be decoded; it is counted and dropped, never applied.

    ``reason`` is a short stable label (used as a metric label), ``detail`` says what was wrong so
    that an operator can tell which publisher or field to fix.
    """

    def __init__(self, reason: str, detail: str = "") -> None:
        self.reason = reason
        self.detail = detail
        super().__init__(f"malformed KV event ({reason}){': ' + detail if detail else ''}")
