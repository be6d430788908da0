"""Hypothesis profiles: the same examples on every CI run, many more random ones before a release.

- ``ci`` (the default): derandomized, so a run that passes proves the same as the last one and a
  failure is the change's own; no example database, so no state carries over between runs.
- ``fuzz`` (``HYPOTHESIS_PROFILE=fuzz``, see docs/development.md): random, 25 times the examples,
  failures kept in ``.hypothesis/`` and printed with a ``@reproduce_failure`` blob. Whatever it
  finds is pinned with ``@example`` on the test, so CI checks it from then on.

Tests state their example count for the ci profile with ``fuzz_settings(n)``; the fuzz profile
scales it.
"""

from __future__ import annotations

import os
from typing import Any

from hypothesis import HealthCheck, settings

BASE_EXAMPLES = 100  # the ci profile's max_examples; a profile's own divided by this is its scale
SLOW_CHECKS = [HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large]

settings.register_profile(
    "ci", max_examples=BASE_EXAMPLES, derandomize=True, database=None, deadline=None
)
settings.register_profile(
    "fuzz", max_examples=BASE_EXAMPLES * 25, derandomize=False, deadline=None, print_blob=True
)
PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "ci")
settings.load_profile(PROFILE)


def fuzz_settings(examples: int, **overrides: Any) -> settings:
    """Settings for a property test that runs ``examples`` examples under the ci profile."""
    scale = max(1, settings.default.max_examples // BASE_EXAMPLES)
    overrides.setdefault("suppress_health_check", SLOW_CHECKS)
    return settings(max_examples=examples * scale, deadline=None, **overrides)


def describe_profile() -> str:
    current = settings.default
    mode = "derandomized" if current.derandomize else "random"
    scale = max(1, current.max_examples // BASE_EXAMPLES)
    return f"hypothesis profile {PROFILE!r}: {mode}, {scale}x the examples each test states"
