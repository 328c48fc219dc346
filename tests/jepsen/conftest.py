"""Every harness run of a test module holds the machine lock until the module
ends; ``machine``: a test that drives its own clusters holds it meanwhile."""

from __future__ import annotations

import sys
from collections.abc import Iterator

import pytest

from jepsen_like.control import RunLock, kill_stale, unmount_stale
from tests.jepsen.harness_run import release_machine_lock


@pytest.fixture
def machine() -> Iterator[None]:
    """The harness's machine lock (one cluster of namespaces/mounts at a
    time), with whatever a killed earlier run left cleaned up first."""
    lock = RunLock()
    if not lock.acquire(1800, lambda m: print(m, file=sys.stderr, flush=True)):
        pytest.fail("another jepsen_like run held the machine lock for 30 minutes")
    kill_stale()
    unmount_stale()
    try:
        yield
    finally:
        lock.release()


@pytest.fixture(scope="module", autouse=True)
def _release_machine_lock() -> Iterator[None]:
    yield
    release_machine_lock()
