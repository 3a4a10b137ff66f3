"""Shared pytest setup: import path and Hypothesis profiles.

Profile "ci" is selected when the environment variable ``CI`` is ``true``
(as in ``CI=true bash .ci/run``); otherwise "default".  Override with
``--hypothesis-profile=NAME``.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent

# Defensive: the editable install normally makes the packages importable.
if importlib.util.find_spec("protocol") is None:
    sys.path.insert(0, str(REPO_ROOT))

try:
    from hypothesis import HealthCheck, settings
except ImportError:  # pragma: no cover - hypothesis is a dev dependency
    pass
else:
    settings.register_profile(
        "default",
        deadline=None,
        max_examples=100,
        suppress_health_check=[HealthCheck.too_slow],
    )
    settings.register_profile(
        "ci",
        deadline=None,
        max_examples=60,
        derandomize=False,
        print_blob=True,
        suppress_health_check=[HealthCheck.too_slow],
    )
    settings.load_profile("ci" if os.environ.get("CI", "").lower() == "true" else "default")
