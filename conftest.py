"""The repository's root conftest: CI's tier plugin for every pytest run (tests/ and e2e/)."""

pytest_plugins = ["tests.tiers"]
