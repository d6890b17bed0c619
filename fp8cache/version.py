"""fp8kv's version (setup.cfg carries the same number; tests/test_packaging.py holds them equal)."""

__version__ = "0.1.0"
