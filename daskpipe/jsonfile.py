"""Reading the project's JSON files (profiles, plans, specs) with errors that name the file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping


def read_json_object(path: str | Path, error: type[Exception]) -> Mapping[str, Any]:
    """The JSON object in ``path``; ``error(message)`` names the file when it is unreadable or not an object."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise error(f"{path}: not valid JSON ({exc})") from None
    except UnicodeDecodeError:
        raise error(f"{path}: not JSON text (not UTF-8; a binary or corrupt file?)") from None
    except OSError as exc:
        raise error(f"{path}: cannot read ({exc.strerror})") from None
    if not isinstance(data, Mapping):
        raise error(f"{path}: top level must be a JSON object")
    return data
