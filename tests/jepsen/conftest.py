"""Every harness run of a test module holds the machine lock until the module ends."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.jepsen.harness_run import release_machine_lock


@pytest.fixture(scope="module", autouse=True)
def _release_machine_lock() -> Iterator[None]:
    yield
    release_machine_lock()
