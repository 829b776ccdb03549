"""Hub ids ("org/name") to local directories, through huggingface_hub's cache.

`snapshot_download` honours HF_HOME / HF_HUB_CACHE (where the cache lives) and HF_HUB_OFFLINE
(use the cache only, never the network); `revision` picks a branch, tag or commit.
"""

from __future__ import annotations

import os
import re

# The files a model needs: config, tokenizer, chat template and weights (safetensors preferred).
_PATTERNS = ["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja", "*.tiktoken"]
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def looks_like_repo_id(name: str) -> bool:
    return bool(_REPO_ID.match(name)) and not name.endswith((".gguf", "/")) and ".." not in name


def snapshot_dir(repo_id: str, revision: str | None = None) -> str:
    """The local snapshot of a hub model, downloaded (unless offline) into the HF cache."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError

    try:
        path = snapshot_download(repo_id, revision=revision, allow_patterns=_PATTERNS)
        if not any(f.endswith(".safetensors") for f in os.listdir(path)):  # older checkpoints
            path = snapshot_download(repo_id, revision=revision,
                                     allow_patterns=_PATTERNS + ["pytorch_model*.bin"])
    except HFValidationError as exc:
        raise ValueError(f"model: {repo_id!r} is not a valid hub id: {exc}") from exc
    except Exception as exc:
        from huggingface_hub import constants

        where = f"cache {constants.HF_HUB_CACHE}"
        offline = " with HF_HUB_OFFLINE=1" if constants.HF_HUB_OFFLINE else ""
        rev = f" at revision {revision!r}" if revision else ""
        raise ValueError(
            f"model: {repo_id!r}{rev} is not a local directory and could not be had from the hub"
            f"{offline} ({where}): {type(exc).__name__}: {exc}. Download it first "
            f"(`hf download {repo_id}`) or pass a local directory"
        ) from exc
    return path
