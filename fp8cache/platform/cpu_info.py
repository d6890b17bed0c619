"""What /proc/cpuinfo says of this machine's CPU: its feature names (which kernels and dtypes pay) and the
lines that identify it (an op library built with -march=native belongs to one CPU)."""

from __future__ import annotations

import os
import platform

IDENTITY_KEYS = ("vendor_id", "cpu family", "model", "model name", "flags", "CPU implementer",
                 "CPU architecture", "CPU variant", "CPU part", "Features")


def first_cpu_lines() -> dict[str, str]:
    """The first processor's `key : value` lines of /proc/cpuinfo (empty where there is none)."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():
                    if fields:
                        break
                    continue
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    return fields


def cpu_model_name() -> str:
    """The CPU's marketing name ("model name"), else what Python's platform module knows (Arm has no such line)."""
    return first_cpu_lines().get("model name") or platform.processor() or platform.machine()


def cpu_feature_names() -> set[str]:
    """The CPU's feature names as /proc/cpuinfo spells them: x86 `flags` and Arm `Features` together."""
    fields = first_cpu_lines()
    return set(fields.get("flags", "").split()) | set(fields.get("Features", "").split())


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask: a container's or taskset's share, not the host's)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1
