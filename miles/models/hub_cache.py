"""The local Hugging Face cache, read without the network, huggingface_hub or torch.

Layout (huggingface_hub's): `<cache>/models--<org>--<name>/snapshots/<revision>/...`, with `refs/main` naming
the revision a plain `from_pretrained(id)` loads. The cache is `$HF_HUB_CACHE`, else `$HUGGINGFACE_HUB_CACHE`,
else `$HF_HOME/hub`, else `$XDG_CACHE_HOME/huggingface/hub`, else `~/.cache/huggingface/hub`.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from pathlib import Path

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*(/[A-Za-z0-9][\w.\-]*)?$")
_TRUE = ("1", "true", "yes", "on")


def hub_cache_dir() -> Path:
    """Where huggingface_hub keeps downloaded repos."""
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(var):
            return Path(os.environ[var]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    xdg = os.environ.get("XDG_CACHE_HOME") or "~/.cache"
    return Path(xdg).expanduser() / "huggingface" / "hub"


def hub_offline() -> bool:
    """HF_HUB_OFFLINE is set to a true value (nothing is downloaded)."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in _TRUE


def describe_cache() -> str:
    """'the Hugging Face cache /root/.cache/huggingface/hub, HF_HUB_OFFLINE=1': for messages."""
    offline = os.environ.get("HF_HUB_OFFLINE")
    state = f"HF_HUB_OFFLINE={offline}" if offline else "HF_HUB_OFFLINE unset"
    return f"the Hugging Face cache {hub_cache_dir()}, {state}"


def looks_like_hub_id(text: str) -> bool:
    """`org/name` (or a bare `name`): what `from_pretrained` would look up on the Hub, not a path."""
    return bool(_HUB_ID.match(text)) and not text.startswith(".") and ".." not in text


def repo_folder(repo_id: str) -> Path:
    return hub_cache_dir() / ("models--" + repo_id.replace("/", "--"))


def snapshots(repo_id: str) -> list[Path]:
    """The cached snapshots of `repo_id`: the one `refs/main` names first, then the others, newest first."""
    folder = repo_folder(repo_id)
    root = folder / "snapshots"
    if not root.is_dir():
        return []
    found = sorted((p for p in root.iterdir() if p.is_dir()), key=lambda p: p.stat().st_mtime, reverse=True)
    try:
        main = (folder / "refs" / "main").read_text(encoding="utf-8").strip()
    except OSError:
        main = ""
    return sorted(found, key=lambda p: p.name != main)


def cached_snapshot(repo_id: str, complete: Callable[[Path], bool] = lambda path: True) -> Path | None:
    """The first snapshot of `repo_id` in the cache for which `complete(path)` holds, else None."""
    return next((path for path in snapshots(repo_id) if complete(path)), None)
