"""The sidecar's one error root."""
from __future__ import annotations


class SidecarError(Exception):
    """The sidecar cannot go on; the message says which setting or engine answer to fix."""

    def __init__(self, instance_id: str, reason: str) -> None:
        self.instance_id = instance_id
        self.reason = reason
        super().__init__(f"sidecar {instance_id}: {reason}")
