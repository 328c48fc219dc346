"""Suite-wide settings.

Hypothesis: no per-example deadline (the CI machine has two shared cores, so
wall-clock per example says nothing), no "too slow" health check, and
derandomized runs so that CI and a developer see the same examples; set
HYPOTHESIS_PROFILE=explore to search with fresh randomness.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci",
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
    print_blob=True,
)
settings.register_profile("explore", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
