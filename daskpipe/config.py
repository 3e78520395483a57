"""daskpipe's Dask config keys: their defaults (``daskpipe.yaml``) and schema (``daskpipe-schema.yaml``),
as distributed keeps its own. Importing ``daskpipe`` loads the defaults, so every process that runs
daskpipe code reads the same keys with the same defaults, whichever module reads them. Every read
(:func:`setting`) checks all of ``daskpipe.*`` against the schema with ``jsonschema``, so a bad value
is refused, naming its key, wherever and whenever it was set (a YAML file, the environment,
``dask.config.set``), rather than read as something else or failing later with another error."""

from __future__ import annotations

import functools
import math
import sys
from pathlib import Path
from typing import Any, Iterator

import dask.config
import jsonschema
import yaml
from dask.utils import parse_timedelta

DEFAULTS = Path(__file__).with_name("daskpipe.yaml")
SCHEMA = Path(__file__).with_name("daskpipe-schema.yaml")
ROOT = "daskpipe"


class ConfigError(ValueError):
    """A ``daskpipe.*`` Dask config key holds a value its schema refuses; the message names the key."""


def load(path: Path) -> dict[str, Any]:
    with open(path) as f:
        return yaml.safe_load(f)


def finite_number(checker: jsonschema.TypeChecker, value: Any) -> bool:
    """JSON has no infinity or NaN (RFC 8259), and no daskpipe knob means anything by one."""
    return jsonschema.Draft202012Validator.TYPE_CHECKER.is_type(value, "number") and math.isfinite(value)


def minimum_duration(validator: Any, minimum: float, value: Any, schema: dict[str, Any]) -> Iterator[jsonschema.ValidationError]:
    """The schema keyword ``minimumDuration``: a duration as Dask reads one ("1s", "500ms", or
    seconds), at least ``minimum`` seconds."""
    try:
        seconds = parse_timedelta(value, default="seconds")
    except (TypeError, ValueError, KeyError):
        yield jsonschema.ValidationError(f"{value!r} is not a duration such as '1s' or '500ms', or seconds")
        return
    if seconds is None or seconds < minimum:
        yield jsonschema.ValidationError(f"{value!r} is shorter than {minimum:g} s")


@functools.cache
def validator() -> jsonschema.protocols.Validator:
    """The schema's validator, built once: Draft 2020-12 (the schema's ``$schema``), its numbers
    finite, with the ``minimumDuration`` keyword."""
    base = jsonschema.Draft202012Validator
    schema = load(SCHEMA)
    base.check_schema(schema)
    extended = jsonschema.validators.extend(
        base,
        validators={"minimumDuration": minimum_duration},
        type_checker=base.TYPE_CHECKER.redefine("number", finite_number),
    )
    return extended(schema)


def check(key: str, value: Any) -> None:
    """Check ``value`` against the schema as the Dask config key ``key`` (dotted, under
    ``daskpipe``) would hold it; raises :class:`ConfigError` naming each bad key."""
    tree: dict[str, Any] = {}
    node = tree
    parts = key.split(".")
    for part in parts[:-1]:
        node = node.setdefault(part, {})
    node[parts[-1]] = value
    errors = sorted(validator().iter_errors(tree), key=lambda e: list(map(str, e.absolute_path)))
    if errors:
        raise ConfigError("; ".join(f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in errors))


def hyphenated(tree: Any) -> Any:
    """``tree`` with its keys spelt with hyphens: Dask takes ``_`` and ``-`` in a key for the same
    (``DASK_DASKPIPE__INLINE_INPUT_BYTES`` sets ``daskpipe.inline-input-bytes``), the schema names
    them with hyphens."""
    if not isinstance(tree, dict):
        return tree
    return {key.replace("_", "-") if isinstance(key, str) else key: hyphenated(value) for key, value in tree.items()}


def check_settings() -> None:
    """Check every ``daskpipe.*`` key of Dask's config against the schema (:func:`check`)."""
    check(ROOT, hyphenated(dask.config.get(ROOT)))


def setting(key: str) -> Any:
    """The Dask config value of ``key`` (e.g. ``"daskpipe.gc-freeze"``), once every ``daskpipe.*``
    key is checked (:func:`check_settings`): a process refuses a bad key the first time it reads any."""
    check_settings()
    return dask.config.get(key)


PROFILER_OFF = {"distributed": {"worker": {"profile": {"enabled": False}}}}


def update_defaults() -> None:
    """Give Dask's config daskpipe's defaults (what users set themselves stays), and, on a Python
    whose ``sys._current_frames`` can deadlock, turn off the one daskpipe process that calls it
    every 10 ms: Dask's statistical worker profiler."""
    dask.config.update_defaults(load(DEFAULTS))
    if current_frames_can_deadlock():
        import distributed.config  # noqa: F401  (its defaults first: imported later, it would put its own back)

        dask.config.update_defaults(PROFILER_OFF)


def current_frames_can_deadlock(version: tuple[int, ...] = tuple(sys.version_info[:3])) -> bool:
    """CPython before 3.11.9 and 3.12.3 (gh-106883): ``sys._current_frames()`` holds the thread
    list's lock while it builds its dict, a garbage collection inside it runs Python callbacks (one
    is Dask's own GC diagnosis) that may hand the GIL over, and a thread that starts or ends then
    holds the GIL waiting for that lock. Seen in daskpipe's tests: a worker's profiler and a stage
    starting its compute thread hung a whole deploy."""
    return version < (3, 11, 9) or (3, 12) <= version < (3, 12, 3)
