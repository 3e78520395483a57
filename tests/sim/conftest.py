"""The toy two-partition plan and its profile, as a fixture."""

from __future__ import annotations

import pytest

from tests.sim.helpers import toy_plan, toy_profile


@pytest.fixture
def toy():
    return toy_plan(), {"toy": toy_profile()}
