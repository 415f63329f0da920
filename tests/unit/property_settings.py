"""The property tests' one setting (hypothesis): bounded in `make test`, longer on request.

    HYPOTHESIS_PROFILE=long .venv/bin/pytest tests/unit/test_hostile_*.py   # 5,000 examples each

No example database (nothing written into the checkout); no deadline (a 2-core CI machine is
slow and noisy); health checks that flag our deliberately large or slow inputs are off.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

settings.register_profile(
    "hsx",
    max_examples=200,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile("hsx-long", parent=settings.get_profile("hsx"), max_examples=5000)

PROPERTY = settings.get_profile("hsx-long" if os.environ.get("HYPOTHESIS_PROFILE") == "long" else "hsx")
