"""Hub ids and the local Hub cache: whether a model path names a Hub repository, whether the Hub is offline, where a
cached repository is. Plain Python (huggingface_hub is imported on use), for preflight, export and loading."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Optional

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes", "on")


def is_hub_id(value: str) -> bool:
    """An org/name that is no local path: not there, and not under an existing folder (there, it is a typo)."""
    local = Path(value)
    return not local.exists() and bool(_HUB_ID.match(value)) and not local.parent.is_dir()


def hub_snapshot(repo_id: str) -> Optional[Path]:
    """The local Hub cache's folder of model `repo_id` (its config.json's folder), when it is cached: then it loads by
    id with HF_HUB_OFFLINE=1."""
    from huggingface_hub import try_to_load_from_cache

    cached = try_to_load_from_cache(repo_id, "config.json")
    return Path(cached).parent if isinstance(cached, str) else None
