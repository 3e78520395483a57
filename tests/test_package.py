"""What a user reaches from ``import daskpipe``: deploy with its real parameters, the option types it
takes, and the ``dask daskpipe`` subcommand that pyproject.toml registers with Dask's CLI."""

from __future__ import annotations

import inspect
import subprocess
import sys
from importlib.metadata import EntryPoint
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

import daskpipe

ROOT = Path(__file__).resolve().parents[1]


def test_deploy_shows_its_parameters():
    parameters = inspect.signature(daskpipe.deploy).parameters
    assert {"example_inputs", "slo_ms", "planner", "profiling", "elastic", "dispatcher"} <= set(parameters)
    assert "kwargs" not in parameters


def test_the_option_types_deploy_takes_are_importable_from_daskpipe():
    from daskpipe import ElasticSettings, PlannerOptions, ProfilingOptions, Service  # noqa: F401

    defaults = inspect.signature(daskpipe.deploy).parameters
    for name, option in {"planner": PlannerOptions, "profiling": ProfilingOptions, "elastic": ElasticSettings}.items():
        assert isinstance(defaults[name].default, option)
    assert set(daskpipe.__all__) <= set(dir(daskpipe))


def test_import_daskpipe_leaves_torch_unloaded():
    """A scheduler started with ``--preload daskpipe`` never needs torch: the runtime's names load on use."""
    code = "import sys, daskpipe; assert 'torch' not in sys.modules; daskpipe.ProfilingOptions; assert 'torch' in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def dask_cli_entry_point() -> EntryPoint:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    entries = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]["dask_cli"]
    return EntryPoint("daskpipe", entries["daskpipe"], "dask_cli")


def test_dask_daskpipe_help():
    """Dask's CLI registers the group under the group's own name (dask/cli.py), so it must be ``daskpipe``."""
    from dask.cli import _register_command_ep

    dask_cli = click.Group("dask")
    _register_command_ep(dask_cli, dask_cli_entry_point())
    result = CliRunner().invoke(dask_cli, ["daskpipe", "--help"])
    assert result.exit_code == 0, result.output
    assert "Usage: dask daskpipe" in result.output and "simulate" in result.output
