"""Hypothesis profiles for the whole workspace, chosen with HYPOTHESIS_PROFILE, and the
order the tests are handed out in.

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


def pytest_collection_modifyitems(items):
    """Tests marked ``processes`` (each starts Python processes: tens of seconds) first,
    the rest in collection order: under ``pytest -n`` the workers then end on short tests
    together instead of one of them running the long ones alone at the end."""
    items.sort(key=lambda item: item.get_closest_marker("processes") is None)
