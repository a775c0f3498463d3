"""The package version (pyproject.toml's ``version``; tests/test_contract.py compares them)."""

__version__ = "0.1.0"
