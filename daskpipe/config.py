"""daskpipe's Dask config keys: their defaults (``daskpipe.yaml``) and schema (``daskpipe-schema.yaml``),
as distributed keeps its own. Importing ``daskpipe`` loads the defaults, so every process that runs
daskpipe code reads the same keys with the same defaults, whichever module reads them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import dask.config
import yaml

DEFAULTS = Path(__file__).with_name("daskpipe.yaml")
SCHEMA = Path(__file__).with_name("daskpipe-schema.yaml")


def load(path: Path) -> dict[str, Any]:
    with open(path) as f:
        return yaml.safe_load(f)


def update_defaults() -> None:
    """Give Dask's config daskpipe's defaults (what users set themselves stays)."""
    dask.config.update_defaults(load(DEFAULTS))
