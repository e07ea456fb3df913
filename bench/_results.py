"""Where every benchmark's JSON result goes, written the same way by all of them."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def write_result(path: str | Path, result: Any) -> Path:
    """Write ``result`` as indented JSON to ``path`` (creating its folder) and say so."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2, default=float) + "\n")
    print(f"wrote {out}")
    return out
