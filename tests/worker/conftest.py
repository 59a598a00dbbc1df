"""Every engine a worker test made through ``engine_runs.tracked`` is shut down after it."""

from __future__ import annotations

import pytest

from tests.worker.engine_runs import shut_down_tracked


@pytest.fixture(autouse=True)
def _shut_down_engines():
    yield
    shut_down_tracked()
