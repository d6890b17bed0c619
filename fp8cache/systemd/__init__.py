"""fp8kv's side of systemd: readiness and status through sd_notify, and the listening socket checked (or
handed over) before a model loads. The unit files themselves are written by `fp8kv systemd-unit`."""
