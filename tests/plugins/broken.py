"""A module that fails at import, as one needing a missing driver would (tests/test_targets.py)."""

raise RuntimeError("this module needs a driver that is not here")
