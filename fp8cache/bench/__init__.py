"""Benchmarks behind `fp8kv bench`: figures are measured side by side in one run (DESIGN section 7)."""
