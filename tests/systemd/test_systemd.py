"""systemd integration without systemd running: sd_notify datagrams, the generated and shipped units
(checked by `systemd-analyze verify`), and the flags <-> FP8KV_* environment variables of `fp8kv run`."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import socket
import subprocess
from pathlib import Path

import pytest
from server_process import fp8kv_command

from fp8cache.systemd.notify import Notifier, sd_notify, watchdog_interval
from launcher.unit_file import render_gpu_dropin, render_unit

REPO = Path(__file__).resolve().parents[2]
UNITS = REPO / "scripts" / "systemd"
RUN_FLAGS = ["--kv-cache-dtype", "--quantization-param-path", "--calculate-kv-scales", "--dtype", "--block-size",
             "--max-model-len", "--max-num-seqs", "--max-num-batched-tokens", "--kv-cache-memory",
             "--enable-prefix-caching", "--host", "--port", "--api-key", "--served-model-name",
             "--graceful-timeout", "--log-format", "--trust-remote-code"]


def _receiver(address) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(address)
    sock.settimeout(10)
    return sock


def test_notify_to_a_socket_path(tmp_path):
    path = str(tmp_path / "notify.sock")
    with _receiver(path) as sock:
        notifier = Notifier(path)
        assert notifier.enabled
        assert notifier.ready("serving")
        assert sock.recv(4096) == b"READY=1\nSTATUS=serving"
        assert notifier.watchdog()
        assert sock.recv(4096) == b"WATCHDOG=1"
        assert notifier.stopping()
        assert sock.recv(4096) == b"STOPPING=1"


def test_notify_to_an_abstract_socket(monkeypatch):
    name = f"fp8kv-notify-{os.getpid()}"
    with _receiver(b"\0" + name.encode()) as sock:
        monkeypatch.setenv("NOTIFY_SOCKET", "@" + name)
        assert sd_notify("READY=1")
        assert sock.recv(4096) == b"READY=1"


def test_notify_without_systemd_is_a_no_op(monkeypatch, tmp_path):
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    assert not Notifier().enabled
    assert not sd_notify("READY=1")
    monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "gone.sock"))
    assert not sd_notify("READY=1")  # a vanished socket is not an error


def test_watchdog_interval_is_half_of_watchdog_usec(monkeypatch):
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    monkeypatch.delenv("WATCHDOG_USEC", raising=False)
    assert watchdog_interval() is None
    monkeypatch.setenv("WATCHDOG_USEC", "3000000")
    assert watchdog_interval() == 1.5
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))
    assert watchdog_interval() == 1.5
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid() + 1))
    assert watchdog_interval() is None  # meant for another process
    monkeypatch.delenv("WATCHDOG_PID")
    monkeypatch.setenv("WATCHDOG_USEC", "soon")
    assert watchdog_interval() is None


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("FP8KV_")}
    return subprocess.run(fp8kv_command() + list(args), check=False, capture_output=True, text=True,
                          env={**clean, **(env or {})}, cwd=REPO, timeout=120)


def test_run_help_documents_every_flag_and_its_variable():
    done = _cli("run", "--help")
    assert done.returncode == 0, done.stderr
    text = " ".join(done.stdout.split())  # click wraps help at 80 columns
    for flag in RUN_FLAGS:
        env = "FP8KV_" + flag.removeprefix("--").upper().replace("-", "_")
        assert re.search(rf"^\s+{re.escape(flag)}\b", done.stdout, re.MULTILINE), flag
        assert f"[env: {env}]" in text, env
    assert "default: 127.0.0.1" in text and "default: 8000" in text


def _exec_start(unit: str) -> list[str]:
    line = next(x for x in unit.splitlines() if x.startswith("ExecStart="))
    return shlex.split(line.removeprefix("ExecStart=").replace("%%", "%").replace("$$", "$"))


def _directives(unit: str) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for line in unit.splitlines():
        if "=" in line and not line.startswith("#"):
            key, value = line.split("=", 1)
            out.setdefault(key, []).append(value)
    return out


def test_systemd_unit_carries_the_run_flags(tmp_path):
    model = tmp_path / "my model 100%"
    model.mkdir()
    done = _cli("systemd-unit", str(model), "--kv-cache-dtype", "fp8", "--port", "8101", "--graceful-timeout",
                "45", "--no-enable-prefix-caching", "--api-key", "hunter2", "--calculate-kv-scales")
    assert done.returncode == 0, done.stderr
    unit = done.stdout
    argv = _exec_start(unit)
    i = argv.index("run")
    assert argv[i + 1] == str(model)
    flags = argv[i + 2:]
    assert flags == ["--kv-cache-dtype", "fp8", "--port", "8101", "--graceful-timeout", "45.0",
                     "--no-enable-prefix-caching", "--calculate-kv-scales"]
    assert "hunter2" not in unit and "FP8KV_API_KEY" in done.stderr  # never written into a unit
    d = _directives(unit)
    assert d["Type"] == ["notify"] and d["Restart"] == ["on-failure"]
    assert d["ExecStartPre"][0].endswith(" build")
    assert "-/etc/fp8kv/fp8kv.env" in d["EnvironmentFile"]
    assert d["DynamicUser"] == ["yes"] and d["StateDirectory"] and d["CacheDirectory"] == ["fp8kv"]
    environment = " ".join(d["Environment"])
    assert "FP8KV_CACHE_DIR=%C/fp8kv" in environment and "XDG_CACHE_HOME=%C/fp8kv" in environment
    assert d["ProtectSystem"] == ["strict"] and d["PrivateTmp"] == ["yes"] and d["NoNewPrivileges"] == ["yes"]
    assert d["ProtectHome"][0] in ("yes", "read-only")
    assert int(d["TimeoutStopSec"][0]) > 45
    assert int(d["WatchdogSec"][0]) > 0


def test_systemd_unit_reads_flags_from_the_environment():
    done = _cli("systemd-unit", "--template", env={"FP8KV_KV_CACHE_DTYPE": "fp8_e5m2", "FP8KV_PORT": "9001",
                                                   "FP8KV_ENABLE_PREFIX_CACHING": "false",
                                                   "FP8KV_LOG_FORMAT": "json"})
    assert done.returncode == 0, done.stderr
    argv = _exec_start(done.stdout)
    flags = argv[argv.index("run") + 1:]
    for pair in (["--kv-cache-dtype", "fp8_e5m2"], ["--port", "9001"], ["--log-format", "json"]):
        i = flags.index(pair[0])
        assert flags[i:i + 2] == pair
    assert "--no-enable-prefix-caching" in flags
    assert "-/etc/fp8kv/%i.env" in _directives(done.stdout)["EnvironmentFile"]


def _without_comments(text: str) -> str:
    return "\n".join(line for line in text.splitlines() if not line.startswith("#"))


def test_shipped_units_are_what_the_generator_writes():
    for name, template in (("fp8kv.service", False), ("fp8kv@.service", True)):
        want = render_unit(["/usr/local/bin/fp8kv"], ["run"], template=template, header=())
        assert _without_comments((UNITS / name).read_text()) == _without_comments(want), name
    assert _without_comments((UNITS / "fp8kv-gpu.conf").read_text()) == _without_comments(render_gpu_dropin())


def _systemd_analyze() -> str:
    found = shutil.which("systemd-analyze")
    if found:
        return found
    if os.environ.get("CI") != "true":
        pytest.skip("systemd-analyze is not installed (apt-get install systemd); with CI=true this test "
                    "installs it")
    subprocess.run(["apt-get", "update", "-q"], check=True, capture_output=True)
    subprocess.run(["apt-get", "install", "-y", "-q", "--no-install-recommends", "systemd"], check=True,
                   capture_output=True, env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"})
    found = shutil.which("systemd-analyze")
    assert found, "apt-get installed systemd but systemd-analyze is not on PATH"
    return found


def _verify(analyze: str, unit_text: str, folder: Path, name: str, instance: str | None = None) -> None:
    path = folder / name
    path.write_text(unit_text)
    target = folder / (name.replace("@", f"@{instance}") if instance else name)
    done = subprocess.run([analyze, "verify", "--man=no", str(target)], check=False, capture_output=True,
                          text=True, cwd=folder, timeout=120)
    complaints = [line for line in (done.stdout + done.stderr).splitlines() if name.split("@")[0] in line]
    assert done.returncode == 0 and not complaints, done.stdout + done.stderr


def test_units_pass_systemd_analyze_verify(tmp_path):
    analyze = _systemd_analyze()
    real = shlex.join(fp8kv_command())  # verify needs ExecStart= to name an existing executable
    generated = _cli("systemd-unit", "--kv-cache-dtype", "fp8", "--port", "8102")
    assert generated.returncode == 0, generated.stderr
    _verify(analyze, generated.stdout, tmp_path, "fp8kv-generated.service")
    template = _cli("systemd-unit", "--template", "--graceful-timeout", "10")
    _verify(analyze, template.stdout, tmp_path, "fp8kv-generated@.service", instance="smol")
    for name in ("fp8kv.service", "fp8kv@.service"):
        text = (UNITS / name).read_text().replace("/usr/local/bin/fp8kv", real)
        _verify(analyze, text, tmp_path, name, instance="smol" if "@" in name else None)


def test_verify_catches_a_broken_unit(tmp_path):
    # The check above would be worthless if verify accepted anything.
    analyze = _systemd_analyze()
    broken = (UNITS / "fp8kv.service").read_text().replace("/usr/local/bin/fp8kv", "/nonexistent/fp8kv")
    with pytest.raises(AssertionError):
        _verify(analyze, broken, tmp_path, "fp8kv-broken.service")


def _security(analyze: str, unit_text: str, folder: Path, name: str, dropin: str | None = None) -> float:
    """systemd-analyze's overall exposure (0 safest, 10 unsafe) for a unit file, with an optional drop-in."""
    (folder / name).write_text(unit_text)
    if dropin is not None:
        (folder / f"{name}.d").mkdir(exist_ok=True)
        (folder / f"{name}.d" / "gpu.conf").write_text(dropin)
    done = subprocess.run([analyze, "security", "--offline=yes", "--no-pager", str(folder / name)],
                          check=False, capture_output=True, text=True, timeout=120)
    match = re.search(r"Overall exposure level for \S+: ([0-9.]+)", done.stdout)
    assert match, done.stdout + done.stderr
    return float(match.group(1))


def _device_lines(unit: str) -> tuple[list[str], list[str]]:
    d = _directives(unit)
    return d.get("PrivateDevices", []), [v.split()[0] for v in d.get("DeviceAllow", [])]


GPU_NODES = ["/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools", "/dev/kfd"]


def _allows_gpu(unit: str) -> bool:
    private, allowed = _device_lines(unit)
    # For a setting given twice (unit, then drop-in), systemd takes the last one.
    return (private[-1:] == ["no"] and _directives(unit).get("DevicePolicy", [])[-1:] == ["closed"]
            and all(node in allowed for node in GPU_NODES)
            and any(a.startswith("char-nvidia") for a in allowed) and "char-drm" in allowed)


def test_cpu_units_score_ok_in_systemd_analyze_security(tmp_path):
    # <= 3.0 is systemd's "OK"; the units scored 6.5 MEDIUM before CapabilityBoundingSet=, SystemCallFilter=...
    analyze = _systemd_analyze()
    generated = _cli("systemd-unit", "--device", "cpu", "--port", "8103")
    assert generated.returncode == 0, generated.stderr
    scores = {"generated": _security(analyze, generated.stdout, tmp_path, "fp8kv-generated.service")}
    for name in ("fp8kv.service", "fp8kv@.service"):
        scores[name] = _security(analyze, (UNITS / name).read_text(), tmp_path, name)
    assert all(score <= 3.0 for score in scores.values()), scores


def test_gpu_units_keep_the_gpu_visible(tmp_path):
    # PrivateDevices=yes would hide /dev/nvidia* from a CUDA server (issue 23): a GPU unit lists the nodes.
    analyze = _systemd_analyze()
    gpu = _cli("systemd-unit", "--device", "cuda:1")
    cpu = _cli("systemd-unit", "--device", "cpu")
    assert gpu.returncode == 0 and cpu.returncode == 0, gpu.stderr + cpu.stderr
    assert _allows_gpu(gpu.stdout) and "PrivateUsers=yes" not in gpu.stdout
    assert _device_lines(cpu.stdout) == (["yes"], []) and not _allows_gpu(cpu.stdout)
    _verify(analyze, gpu.stdout, tmp_path, "fp8kv-gpu.service")
    dropin = (UNITS / "fp8kv-gpu.conf").read_text()
    template = (UNITS / "fp8kv@.service").read_text()
    assert _allows_gpu(template + dropin)  # the drop-in's lines come after the unit's, so they win
    # Still well hardened with the GPU nodes allowed, and systemd reads the drop-in (the score moves).
    (tmp_path / "plain").mkdir()
    cpu_score = _security(analyze, template, tmp_path / "plain", "fp8kv@.service")
    gpu_score = _security(analyze, template, tmp_path, "fp8kv@.service", dropin=dropin)
    assert cpu_score < gpu_score <= 3.0
    real = template.replace("/usr/local/bin/fp8kv", shlex.join(fp8kv_command()))
    _verify(analyze, real, tmp_path, "fp8kv@.service", instance="smol")  # with the drop-in beside it
    assert _security(analyze, gpu.stdout, tmp_path, "fp8kv-gpu.service") <= 3.0


@pytest.mark.parametrize("gpu_seen", [True, False])
def test_auto_device_unit_follows_the_gpu_torch_sees(monkeypatch, gpu_seen):
    import torch
    from click.testing import CliRunner

    from launcher.cli import main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpu_seen)
    for key in [k for k in os.environ if k.startswith("FP8KV_")]:
        monkeypatch.delenv(key)
    done = CliRunner().invoke(main, ["systemd-unit", "--device", "auto"])
    assert done.exit_code == 0, done.output
    assert _allows_gpu(done.stdout) == gpu_seen
    assert ("PrivateDevices=yes" in done.stdout) == (not gpu_seen)


def test_unit_warns_when_the_service_needs_tmp(tmp_path):
    # PrivateTmp=yes hands the service an empty /tmp: an fp8kv installed there cannot start.
    in_tmp = _cli("systemd-unit", "--device", "cpu", "--exec", "/tmp/venv/bin/fp8kv")
    assert in_tmp.returncode == 0, in_tmp.stderr
    assert "PrivateTmp" in in_tmp.stderr and "/tmp/venv/bin/fp8kv" in in_tmp.stderr
    assert "PrivateTmp=yes" in in_tmp.stdout
    elsewhere = _cli("systemd-unit", "--device", "cpu", "--exec", "/opt/fp8kv/bin/fp8kv")
    assert elsewhere.returncode == 0 and "PrivateTmp" not in elsewhere.stderr


def _bytes(systemd_size: str) -> int:
    number, unit = re.fullmatch(r"(\d+)([KMGT]?)", systemd_size).groups()
    return int(number) * 1024 ** " KMGT".index(unit or " ")


def test_memory_max_follows_the_kv_budget(tiny_llama_path):
    weights = sum(f.stat().st_size for f in Path(tiny_llama_path).glob("*.safetensors"))
    limits = {}
    for budget in ("1GiB", "3GiB"):
        done = _cli("systemd-unit", tiny_llama_path, "--device", "cpu", "--kv-cache-memory", budget)
        assert done.returncode == 0, done.stderr
        limits[budget] = _bytes(_directives(done.stdout)["MemoryMax"][0])
        assert limits[budget] > int(budget[0]) * 2**30 + weights  # room for the cache and the weights
    assert limits["3GiB"] - limits["1GiB"] == 2 * 2**30
    unknown = _cli("systemd-unit", tiny_llama_path, "--device", "cpu")  # budget sized at start: no limit
    on_gpu = _cli("systemd-unit", tiny_llama_path, "--device", "cuda", "--kv-cache-memory", "1GiB")
    assert "MemoryMax" not in unknown.stdout and "MemoryMax" not in on_gpu.stdout  # (GPU: cache in GPU memory)
    bad = _cli("systemd-unit", tiny_llama_path, "--device", "cpu", "--kv-cache-memory", "lots")
    assert bad.returncode == 2 and "--kv-cache-memory" in bad.stderr
