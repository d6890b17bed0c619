"""Kill -9 and truncation against fp8kv's cache artefacts, in child processes on scratch cache folders.

    python tests/crash_safety.py                       # 20 random points of each case (issue 39's loop)
    python tests/crash_safety.py --iterations 3 --cases ops-kill
    python tests/crash_safety.py --real --iterations 2 --cases ops-kill   # the real compiler (minutes each)

Cases:
  ops-kill       a first op build killed (SIGKILL) at a random moment, then a start: it succeeds, loads a whole
                 library that passed its self-check, and no process of the killed build is left running or
                 ran beside the new one
  ops-truncate   an installed op library cut short at a random length: the next start says so in one line,
                 moves it aside, rebuilds and loads a whole library (no SIGBUS)
  ops-legacy     the same for a library installed without a manifest (by an fp8kv before manifests)
  model-kill     the default model's first conversion killed at a random moment, then a start: it gets the
                 whole model, and no work folder is left
  model-truncate one file of the converted default model cut to a random length (a safetensors file or a
                 JSON one): the next start says so in one line, moves the folder aside and converts again

The op cases run a stand-in compiler (tests/standin_compiler.py: a real library written chunk by chunk)
unless --real is given; the self-check, the install and the load are the real ones. The model cases convert
with a stand-in too (a small safetensors model written file by file, chunk by chunk, as save_pretrained
writes), and check the result against it byte for byte and with safetensors' own reader. tests/launcher/test_crash_safety.py
runs a few points of each case in the test suite.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from standin_compiler import CHUNK_PAUSE_S, CHUNKS

REPO = Path(__file__).resolve().parents[1]
STANDIN = Path(__file__).with_name("standin_compiler.py")

# One start of the op library, as `fp8kv run` makes it (argv[1]: the stand-in compiler, if any).
OPS_START = """
import json, sys
from fp8cache.ops import _build
if len(sys.argv) > 1:
    _build.COMPILE_CHILD = [sys.executable, sys.argv[1]]
result = _build.load_library(device="cpu")
print(json.dumps({"compiled": result.compiled, "path": result.path}), flush=True)
"""


# One start's default model, converted by a stand-in that writes argv[1]'s files chunk by chunk.
MODEL_START = """
import os, sys, time
from fp8cache.model import default_model as d
template = sys.argv[1]
d._locate_wheel = lambda work, say: os.path.join(work, "standin.whl")
d._extract_gguf = lambda wheel, work: os.path.join(work, "standin.gguf")
def convert(gguf, out):
    os.makedirs(out)
    for name in sorted(os.listdir(template)):
        with open(os.path.join(template, name), "rb") as f:
            data = f.read()
        with open(os.path.join(out, name), "wb") as f:
            for i in range(8):
                f.write(data[i * len(data) // 8:(i + 1) * len(data) // 8])
                f.flush()
                time.sleep(0.02)
d._convert = convert
print(d.ensure_default_model(progress=False), flush=True)
"""


class CrashCheckFailed(AssertionError):
    pass


def _env(cache: Path, record: Path, real_library: Path | None) -> dict[str, str]:
    env = dict(os.environ, FP8KV_CACHE_DIR=str(cache), FP8KV_STANDIN_RECORD=str(record),
               PYTHONPATH=os.pathsep.join([str(REPO), *filter(None, os.environ.get("PYTHONPATH", "").split(
                   os.pathsep))]))
    if real_library is not None:
        env["FP8KV_STANDIN_LIBRARY"] = str(real_library)
    return env


def _ops_command(real_library: Path | None) -> list[str]:
    return [sys.executable, "-c", OPS_START, *([str(STANDIN)] if real_library is not None else [])]


def processes_of(cache: Path) -> list[int]:
    """Live processes (zombies left out) started for the scratch cache `cache`: their environment names it, as
    every process a start runs inherits (the compile child, ninja, the compilers, the probe)."""
    needle = f"FP8KV_CACHE_DIR={cache}".encode() + b"\0"
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if needle not in (entry / "environ").read_bytes() + b"\0":
                continue
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state not in ("Z", "X"):
            found.append(int(entry.name))
    return found


def wait_until_gone(cache: Path, limit_s: float = 60.0) -> None:
    """Every process of a killed start ends; `limit_s` only bounds the wait (the kernel's parent-death signal
    ends them at once: an orphaned compile of the old code ran on for minutes)."""
    deadline = time.monotonic() + limit_s
    while (left := processes_of(cache)) and time.monotonic() < deadline:
        time.sleep(0.2)
    if left:
        names = []
        for pid in left:
            try:
                command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")[:120]
                names.append(f"{pid} ({command.decode(errors='replace')})")
            except OSError:
                names.append(str(pid))
        for pid in left:  # do not leave them to the next case
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        raise CrashCheckFailed(f"{len(left)} process(es) of the killed start outlived it by {limit_s:g} s: "
                               + "; ".join(names))


def _run(command: list[str], env: dict[str, str], timeout: float = 1200) -> subprocess.CompletedProcess:
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout, check=False,
                          cwd=REPO)


def _started(result: subprocess.CompletedProcess, what: str) -> dict:
    if result.returncode != 0:
        how = (f"died of signal {-result.returncode} ({signal.Signals(-result.returncode).name})"
               if result.returncode < 0 else f"exited with status {result.returncode}")
        raise CrashCheckFailed(f"{what}: the start {how}:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def _sha256(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def _check_installed(cache: Path, started: dict, real_library: Path | None, record: Path) -> None:
    from fp8cache.ops import _build

    path = Path(started["path"])
    if path.parent.parent != cache / "ops":
        raise CrashCheckFailed(f"the start loaded {path}, not a library of its cache {cache}")
    problem = _build.installed_problem(path.parent)
    if problem is not None:
        raise CrashCheckFailed(f"the start loaded {path}, whose install is not whole: {problem}")
    if real_library is not None and _sha256(path) != _sha256(real_library):
        raise CrashCheckFailed(f"the start loaded {path}, which is not the library the compiler wrote")
    leftovers = [p.name for p in (cache / "ops").iterdir() if ".tmp-" in p.name]
    if leftovers:
        raise CrashCheckFailed(f"work folders left after a successful start: {leftovers}")
    for name, what in (("raced", "two compiles of one key ran at once"),
                       ("outlived", "a compile went on after the start that ran it was killed")):
        if (record / name).exists():
            raise CrashCheckFailed(f"{what} ({(record / name).read_text().strip()})")


def ops_first_build(work: Path, real_library: Path | None) -> tuple[Path, float]:
    """A whole first build in a fresh cache (the template the truncation cases copy); its duration."""
    cache, record = work / "template-cache", work / "template-record"
    record.mkdir(parents=True)
    start = time.monotonic()
    started = _started(_run(_ops_command(real_library), _env(cache, record, real_library)), "a first build")
    seconds = time.monotonic() - start
    _check_installed(cache, started, real_library, record)
    return cache, seconds


def _compiling(cache: Path) -> bool:
    return any((cache / "ops").glob("*.tmp-*/build.ninja"))


def ops_kill(work: Path, rng: random.Random, span_s: float, real_library: Path | None, index: int,
             compile_s: float = 1.0) -> str:
    """A first build killed at a random moment, then a start. Every other point is drawn inside the compile
    (counted from when its build.ninja appears; `compile_s`: how long the compile takes), the rest anywhere in
    a whole build's span (`span_s`: before the lock, during the self-check, around the install)."""
    cache, record = work / f"kill-{index}" / "cache", work / f"kill-{index}" / "record"
    record.mkdir(parents=True)
    env = _env(cache, record, real_library)
    in_compile = index % 2 == 0
    delay = rng.uniform(0, compile_s if in_compile else span_s)
    child = subprocess.Popen(_ops_command(real_library), env=env, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, cwd=REPO)
    if in_compile:
        while not _compiling(cache) and child.poll() is None:
            time.sleep(0.01)
    try:
        child.wait(timeout=delay)
        outcome = "finished before the kill"
    except subprocess.TimeoutExpired:
        child.kill()  # kill -9
        child.wait()
        outcome = "killed"
    when = f"{delay:.2f} s into the compile" if in_compile else f"{delay:.2f} s after the start"
    wait_until_gone(cache)
    started = _started(_run(_ops_command(real_library), env), f"the start after a kill {when}")
    _check_installed(cache, started, real_library, record)
    return f"kill {when} ({outcome}), then a start: ok"


def ops_truncate(work: Path, rng: random.Random, template: Path, real_library: Path | None, index: int,
                 manifest: bool = True) -> str:
    """The template's installed library cut to a random length; the next start must rebuild it."""
    case = work / f"truncate-{index}{'' if manifest else '-legacy'}"
    cache, record = case / "cache", case / "record"
    record.mkdir(parents=True)
    shutil.copytree(template, cache)
    installed = next(p for p in (cache / "ops").iterdir() if p.is_dir() and "." not in p.name)
    library = installed / f"{installed.name}.so"
    size = library.stat().st_size
    cut = rng.randrange(size)
    os.truncate(library, cut)
    if not manifest:
        (installed / "manifest.json").unlink()
    result = _run(_ops_command(real_library), _env(cache, record, real_library))
    started = _started(result, f"the start after the library was cut to {cut} of {size} bytes")
    said = [line for line in result.stderr.splitlines() if "damaged" in line]
    if len(said) != 1 or str(installed) not in said[0]:
        raise CrashCheckFailed(f"the damaged library was not named in exactly one line: {said}\n{result.stderr}")
    _check_installed(cache, started, real_library, record)
    return f"library cut to {cut} of {size} bytes{'' if manifest else ' (no manifest)'}: ok"


def model_template(folder: Path) -> Path:
    """What the stand-in conversion writes: a small model's files (several tensors, config, tokenizer)."""
    import torch
    from safetensors.torch import save_file

    folder.mkdir(parents=True)
    generator = torch.Generator().manual_seed(39)
    tensors = {f"model.layers.{i}.mlp.{name}.weight": torch.randn(96, 64 + 32 * i, generator=generator)
               for i in range(4) for name in ("gate_proj", "up_proj")}
    tensors["model.embed_tokens.weight"] = torch.randn(512, 64, generator=generator).to(torch.bfloat16)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 4}, indent=2))
    (folder / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 8192, "eos_token": "</s>"}))
    (folder / "tokenizer.json").write_text(json.dumps({"model": {"vocab": {f"t{i}": i for i in range(2000)}}}))
    (folder / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}\n")
    return folder


def _model_command(template: Path) -> list[str]:
    return [sys.executable, "-c", MODEL_START, str(template)]


def _check_model(cache: Path, result: subprocess.CompletedProcess, template: Path, what: str) -> None:
    from safetensors import safe_open

    if result.returncode != 0:
        raise CrashCheckFailed(f"{what}: the start exited with status {result.returncode}:\n{result.stderr[-3000:]}")
    folder = Path(result.stdout.strip().splitlines()[-1])
    for name in sorted(p.name for p in template.iterdir()):
        if not (folder / name).is_file() or (folder / name).read_bytes() != (template / name).read_bytes():
            raise CrashCheckFailed(f"{what}: {folder / name} is not the file the conversion wrote")
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        names = f.keys()  # a safe_open is not iterable
        for key in names:
            f.get_tensor(key)
    models = folder.parent
    leftovers = [p.name for p in models.iterdir() if p.name.startswith(".convert-")]
    if leftovers:
        raise CrashCheckFailed(f"{what}: conversion work folders left after a successful start: {leftovers}")


def model_first_conversion(work: Path, template: Path) -> tuple[Path, float]:
    cache = work / "model-template-cache"
    start = time.monotonic()
    result = _run(_model_command(template), _env(cache, work, None))
    seconds = time.monotonic() - start
    _check_model(cache, result, template, "a first conversion")
    return cache, seconds


def model_kill(work: Path, rng: random.Random, span_s: float, template: Path, index: int) -> str:
    cache = work / f"model-kill-{index}"
    env = _env(cache, work, None)
    delay = rng.uniform(0, span_s)
    child = subprocess.Popen(_model_command(template), env=env, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, cwd=REPO)
    try:
        child.wait(timeout=delay)
        outcome = "finished before the kill"
    except subprocess.TimeoutExpired:
        child.kill()
        child.wait()
        outcome = "killed"
    wait_until_gone(cache)
    _check_model(cache, _run(_model_command(template), env), template, f"the start after a kill at {delay:.2f} s")
    return f"kill at {delay:.2f} s ({outcome}), then a start: ok"


def model_truncate(work: Path, rng: random.Random, converted: Path, template: Path, index: int) -> str:
    cache = work / f"model-truncate-{index}"
    shutil.copytree(converted, cache)
    folder = next(p for p in (cache / "models").iterdir() if p.is_dir() and not p.name.startswith("."))
    victim = folder / rng.choice(["model.safetensors", "model.safetensors", "config.json", "tokenizer.json",
                                  "chat_template.jinja"])
    size = victim.stat().st_size
    cut = rng.randrange(size)
    os.truncate(victim, cut)
    result = _run(_model_command(template), _env(cache, work, None))
    what = f"the start after {victim.name} was cut to {cut} of {size} bytes"
    said = [line for line in result.stderr.splitlines() if "damaged" in line]
    if result.returncode == 0 and (len(said) != 1 or str(folder) not in said[0]):
        raise CrashCheckFailed(f"{what}: the damaged model was not named in exactly one line: {said}\n"
                               + result.stderr[-2000:])
    _check_model(cache, result, template, what)
    return f"{victim.name} cut to {cut} of {size} bytes: ok"


def _real_library() -> Path:
    from fp8cache import ops
    from fp8cache.ops import _build

    ops.load("cpu")
    return Path(_build.library_path())


def run_cases(cases: list[str], iterations: int, seed: int | None = None, real: bool = False,
              say: Callable[[str], None] = print, work: Path | None = None) -> None:
    """`iterations` random points of each case; raises CrashCheckFailed at the first failure."""
    seed = random.randrange(2**32) if seed is None else seed
    rng = random.Random(seed)
    say(f"seed {seed}")
    owned = work is None
    work = Path(tempfile.mkdtemp(prefix="fp8kv-crash-")) if work is None else work
    try:
        op_cases = [c for c in cases if c.startswith("ops-")]
        if op_cases:
            real_library = None if real else _real_library()
            template, span = ops_first_build(work, real_library)
            say(f"a whole first build took {span:.1f} s")
            compile_s = 0.8 * span if real else CHUNKS * CHUNK_PAUSE_S
            for i in range(iterations):
                if "ops-kill" in cases:
                    say(f"ops-kill {i + 1}/{iterations}: " + ops_kill(work, rng, span, real_library, i, compile_s))
                if "ops-truncate" in cases:
                    say(f"ops-truncate {i + 1}/{iterations}: " + ops_truncate(work, rng, template, real_library, i))
                if "ops-legacy" in cases:
                    say(f"ops-legacy {i + 1}/{iterations}: "
                        + ops_truncate(work, rng, template, real_library, i, manifest=False))
        model_cases = [c for c in cases if c.startswith("model-")]
        if model_cases:
            template = model_template(work / "model-files")
            converted, span = model_first_conversion(work, template)
            say(f"a whole first conversion took {span:.1f} s")
            for i in range(iterations):
                if "model-kill" in cases:
                    say(f"model-kill {i + 1}/{iterations}: " + model_kill(work, rng, span, template, i))
                if "model-truncate" in cases:
                    say(f"model-truncate {i + 1}/{iterations}: " + model_truncate(work, rng, converted, template, i))
    finally:
        if owned:
            shutil.rmtree(work, ignore_errors=True)


ALL_CASES = ["ops-kill", "ops-truncate", "ops-legacy", "model-kill", "model-truncate"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iterations", type=int, default=20, help="random points of each case (default 20)")
    parser.add_argument("--cases", default=",".join(ALL_CASES), help="comma-separated: " + ", ".join(ALL_CASES))
    parser.add_argument("--seed", type=int, help="the random points' seed (printed at the start)")
    parser.add_argument("--real", action="store_true", help="compile with the real compiler (minutes a build)")
    args = parser.parse_args(argv)
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = sorted(set(cases) - set(ALL_CASES))
    if unknown:
        parser.error(f"unknown case(s) {', '.join(unknown)}; the cases are {', '.join(ALL_CASES)}")
    try:
        run_cases(cases, args.iterations, args.seed, args.real)
    except CrashCheckFailed as exc:
        print(f"FAILED: {exc}", file=sys.stderr)
        return 1
    print("all passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
