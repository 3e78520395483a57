"""A synthetic two-block profile with a hand-computable plan."""

from __future__ import annotations

import pytest

from daskpipe.profiles.model import Profile
from tests.plan.helpers import synthetic_profile


@pytest.fixture
def two_block() -> Profile:
    """Block 0 runs nearly as fast on the slow GPU B; block 1 is 10x slower there.

    One A + one B: whole models give 1/2 ms + 1/11.2 ms = 589.3 req/s, the pipeline B[0] -> A[1]
    gives min(1/1.2 ms, 1/1 ms) = 833.3 req/s.
    """
    return synthetic_profile("two-block", {("A", 1): [1000, 1000], ("B", 1): [1200, 10000]})
