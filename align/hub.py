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


# The licence ids the Hub accepts in a card's `license` (https://huggingface.co/docs/hub/repositories-licenses; the
# Hub adds ids now and then: a licence missing here is `other` with license_name and license_link).
HUB_LICENSES = (
    "apache-2.0", "mit", "openrail", "bigscience-openrail-m", "creativeml-openrail-m", "bigscience-bloom-rail-1.0",
    "bigcode-openrail-m", "afl-3.0", "artistic-2.0", "bsl-1.0", "bsd", "bsd-2-clause", "bsd-3-clause",
    "bsd-3-clause-clear", "c-uda", "cc", "cc0-1.0", "cc-by-2.0", "cc-by-2.5", "cc-by-3.0", "cc-by-4.0", "cc-by-sa-3.0",
    "cc-by-sa-4.0", "cc-by-nc-2.0", "cc-by-nc-3.0", "cc-by-nc-4.0", "cc-by-nd-4.0", "cc-by-nc-nd-3.0",
    "cc-by-nc-nd-4.0", "cc-by-nc-sa-2.0", "cc-by-nc-sa-3.0", "cc-by-nc-sa-4.0", "cdla-sharing-1.0",
    "cdla-permissive-1.0", "cdla-permissive-2.0", "wtfpl", "ecl-2.0", "epl-1.0", "epl-2.0", "etalab-2.0", "eupl-1.1",
    "agpl-3.0", "gfdl", "gpl", "gpl-2.0", "gpl-3.0", "lgpl", "lgpl-2.1", "lgpl-3.0", "isc", "lppl-1.3c", "ms-pl",
    "mpl-2.0", "odc-by", "odbl", "openrail++", "osl-3.0", "postgresql", "ofl-1.1", "ncsa", "unlicense", "zlib",
    "pddl", "lgpl-lr", "deepfloyd-if-license", "llama2", "llama3", "llama3.1", "llama3.2", "llama3.3", "gemma",
    "unknown", "other",
)
