"""A blocking HTTP status probe for readiness polling (no extra dependency)."""
from __future__ import annotations

import urllib.error
import urllib.request


def get_status(url: str, timeout: float = 2.0) -> int | None:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except (urllib.error.URLError, OSError):
        return None
