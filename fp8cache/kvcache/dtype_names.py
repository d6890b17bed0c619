"""The kv-cache-dtype strings users pass and the backends they are resolved for, without torch, so that the
command line can offer them (`fp8kv --help`, `fp8kv systemd-unit`) without importing torch. formats.py resolves
them."""

from __future__ import annotations

AUTO = "auto"
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2", "fp8_e4m3fnuz")
BACKENDS = ("cpu", "cuda", "rocm")
