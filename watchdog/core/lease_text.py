"""The Lease's annotations as the sidecars write them: one JSON object each, with its version.

Pure. The fleet's ledger, the quarantine records and the placement records each parse their own
fields; what they share is how an annotation is opened, and that anything else is refused by name.
"""

from __future__ import annotations

import json
from typing import Any


def opened(text: str, version: int, what: str, error: type[ValueError]) -> dict[str, Any]:
    """The JSON object an annotation holds, of `version`; `error` (naming `what`) for anything else."""
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise error(f"not JSON: {exc}") from None
    if not isinstance(data, dict) or data.get("v") != version:
        raise error(f"expected {what} of version {version}")
    return data
