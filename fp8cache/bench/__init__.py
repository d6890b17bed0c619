"""Benchmarks behind `fp8kv bench`: figures are measured side by side in one run (docs/design.md section 7)."""
