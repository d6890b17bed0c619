"""Hugging Face Hub model ids (`org/name`) as a MODEL: the local hub cache first, a download otherwise.

Resolution goes through huggingface_hub's snapshot_download, so the cache is the one every Hugging Face tool
shares (`$HF_HOME/hub`, or `--download-dir`), `HF_TOKEN` authenticates gated and private repositories, and
`HF_HUB_OFFLINE=1` never touches the network. Only what a run needs is fetched: the config, the tokenizer's
files, generation and chat-template files, ModelOpt's hf_quant_config.json and the safetensors weights (those
the index names, when there is one; never pickle `*.bin` files), plus `*.py` with --trust-remote-code.
"""

from __future__ import annotations

import json
import os
import re

# A repository id as the hub spells it: an optional namespace, a name; no path syntax.
_REPO_ID = re.compile(r"^(?:[A-Za-z0-9][A-Za-z0-9._-]{0,95}/)?[A-Za-z0-9][A-Za-z0-9._-]{0,95}$")
METADATA_PATTERNS = ["config.json", "generation_config.json", "tokenizer*", "special_tokens_map.json",
                     "added_tokens.json", "vocab.json", "vocab.txt", "merges.txt", "*.tiktoken", "chat_template*",
                     "hf_quant_config.json", "model.safetensors.index.json"]
TOKENIZER_PATTERNS = ["tokenizer*", "special_tokens_map.json", "added_tokens.json", "vocab.json", "vocab.txt",
                      "merges.txt", "*.tiktoken", "chat_template*", "config.json"]
_OFF = ("", "0", "false", "no", "off")


class HubError(ValueError):
    """A hub id that cannot be resolved; the message says why and what to do."""


def looks_like_repo_id(model: str) -> bool:
    """Whether `model` (not a local path) could be a hub repository id rather than a mistyped path."""
    return (bool(_REPO_ID.match(model)) and not model.startswith((".", "~")) and ".." not in model
            and not model.endswith((".json", ".safetensors")))


def offline() -> bool:
    """HF_HUB_OFFLINE, read now (huggingface_hub reads it once, at import)."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() not in _OFF


def resolve(repo_id: str, revision: str | None = None, download_dir: str | None = None,
            trust_remote_code: bool = False, progress: bool = True, tokenizer_only: bool = False) -> str:
    """The local folder (a snapshot in the hub cache) holding `repo_id` at `revision`, downloading what is
    missing unless offline. Raises HubError."""
    patterns = list(TOKENIZER_PATTERNS if tokenizer_only else METADATA_PATTERNS)
    if trust_remote_code:
        patterns.append("*.py")
    cached = cached_folder(repo_id, revision, download_dir, patterns, tokenizer_only)
    if cached is not None:
        return cached
    where = f"{repo_id}" + (f" at revision {revision}" if revision else "")
    cache = download_dir or _default_cache()
    if offline():
        raise HubError(f"{where} is not in the Hugging Face cache {cache} (complete), and HF_HUB_OFFLINE is set: "
                       "download it where the hub is reachable (`huggingface-cli download "
                       f"{repo_id}`), point --download-dir at its cache, or give a local model folder")
    folder = _download(repo_id, revision, download_dir, patterns, progress, where)
    if not tokenizer_only:
        folder = _download(repo_id, revision, download_dir, _weight_patterns(folder), progress, where)
    missing = _missing(folder, tokenizer_only)
    if missing:
        raise HubError(f"{where}: {missing}")
    return folder


def cached_folder(repo_id: str, revision: str | None = None, download_dir: str | None = None,
                  patterns: list[str] | None = None, tokenizer_only: bool = False) -> str | None:
    """The cached snapshot of `repo_id` when it holds everything a run needs, else None; never downloads."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    try:
        folder = snapshot_download(repo_id, revision=revision, cache_dir=download_dir, local_files_only=True,
                                   allow_patterns=patterns or METADATA_PATTERNS)
    except (LocalEntryNotFoundError, HFValidationError, OSError, ValueError):
        return None  # not cached (or not a valid id): the caller downloads or says so
    return folder if not _missing(folder, tokenizer_only) else None


def _download(repo_id: str, revision: str | None, download_dir: str | None, patterns: list[str],
              progress: bool, where: str) -> str:
    from huggingface_hub import snapshot_download
    from huggingface_hub import utils as hub_utils
    from huggingface_hub.errors import (
        GatedRepoError,
        HFValidationError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    if not progress:
        hub_utils.disable_progress_bars()
    try:
        return snapshot_download(repo_id, revision=revision, cache_dir=download_dir, allow_patterns=patterns)
    except GatedRepoError:
        raise HubError(f"{where} is a gated repository: accept its terms on the hub and set HF_TOKEN to a token "
                       "of that account") from None
    except RepositoryNotFoundError:
        raise HubError(f"{where} is not a local folder, and the hub has no repository by that name (or it is "
                       "private: set HF_TOKEN); check the spelling, or give a local model folder") from None
    except RevisionNotFoundError:
        raise HubError(f"{repo_id} has no revision {revision!r}: give a branch, tag or commit of it with "
                       "--revision") from None
    except HFValidationError as exc:
        raise HubError(f"{where} is neither a local folder nor a valid hub id ({exc})") from None
    except LocalEntryNotFoundError:
        raise HubError(f"{where} is not in the Hugging Face cache and the hub cannot be reached: download it where "
                       "the hub is reachable, or give a local model folder") from None
    except OSError as exc:
        raise HubError(f"downloading {where} failed ({exc})") from None
    finally:
        if not progress:
            hub_utils.enable_progress_bars()


def _weight_patterns(folder: str) -> list[str]:
    """The weight files to fetch: those the index lists (a repository may also hold consolidated copies in
    other layouts), else every top-level *.safetensors."""
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(index):
        try:
            with open(index, encoding="utf-8") as f:
                names = sorted(set(json.load(f)["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise HubError(f"the repository's model.safetensors.index.json is not readable ({exc})") from None
        return names
    return ["*.safetensors"]


def _missing(folder: str, tokenizer_only: bool) -> str | None:
    """What a run needs that `folder` lacks (None: nothing)."""
    if not os.path.isfile(os.path.join(folder, "config.json")):
        return "the repository has no config.json: is it a transformers model?"
    if tokenizer_only:
        return None
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(index):
        try:
            with open(index, encoding="utf-8") as f:
                names = set(json.load(f)["weight_map"].values())
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return "its model.safetensors.index.json is not readable"
        absent = sorted(n for n in names if not os.path.isfile(os.path.join(folder, n)))
        return f"weight file {absent[0]} is missing" if absent else None
    if not any(n.endswith(".safetensors") for n in os.listdir(folder)):
        return ("the repository has no safetensors weights: fp8kv loads safetensors only (unpickling *.bin files "
                "can run arbitrary code); convert it once with save_pretrained(out, safe_serialization=True)")
    return None


def _default_cache() -> str:
    from huggingface_hub import constants

    return str(constants.HF_HUB_CACHE)
