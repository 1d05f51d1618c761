"""Hypothesis profiles for the whole workspace, chosen with HYPOTHESIS_PROFILE.

``ci`` (the default) keeps the default test run within the CI budget; ``dev`` is a quick
local loop; ``nightly`` is the long profile documented in the README.
"""

import os

from hypothesis import HealthCheck, settings

settings.register_profile("dev", max_examples=10, deadline=None)
settings.register_profile("ci", max_examples=40, deadline=None, derandomize=True,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("nightly", max_examples=2000, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
