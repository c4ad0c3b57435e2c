"""Condition media on data rows (torch-free): the records, the parser every row kind shares (prompt rows, SFT rows,
preference rows) and the file checks the preflight runs.

A row may carry a list of media at `--media-key` (default `media`), each entry an object with a role and one file:

    {"input": "make the digit a 7", "media": [{"role": "condition", "image": "src.png"}]}

A relative path is relative to the data file's folder (a `datasets.save_to_disk` folder: that folder); an absolute
path is kept. A row without the key (or with null) has no media. `MEDIA_ROLES` and `MEDIA_KINDS` are the names a
user types (an entry's `role`, and the key that names its file); a null value in an entry counts as absent (a
columnar file fills the fields a row lacks with null). Every problem is one line starting with `file:line` (or
`file:row N`) and quoting what the user wrote clipped.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from miles.core.errors import ConfigError
from miles.data.prompt_file import kind, show_keys, url_problem
from miles.utils.text import clip, clip_repr, first_line

# what a medium is for: the names an entry's "role" takes
MEDIA_ROLES: dict[str, str] = {
    "condition": "an input the model is conditioned on: the source image of an edit, the first frame (or clip) of "
    "an image- or video-to-video job; never noised, never in a loss",
}

# decoded pixels an image (or a video's first frame) may have: a header that claims more is a decompression bomb,
# or the wrong file; refused before any pixel is decoded
MAX_MEDIA_PIXELS = 8192 * 8192

# what PIL reads as a video: a file of another suffix (.mp4, ...) needs PyAV, and is checked to exist only
PIL_VIDEO_SUFFIXES = (".webp", ".gif", ".png", ".apng")


@dataclass(frozen=True)
class MediaRef:
    """One medium of a row: its role, its kind (a key of `MEDIA_KINDS`) and its file."""

    role: str
    kind: str
    path: Path  # absolute: a relative path as written, joined to the data file's folder
    written: str  # the path as the row wrote it, for messages


def pixels_problem(file: Path) -> str | None:
    """What keeps PIL from decoding `file` as an image (the first frame of an animation), or None: the header
    read, the size checked against `MAX_MEDIA_PIXELS`, the file verified (PNG checksums, which decoding skips) and
    every pixel decoded (`load`; a JPEG at 1/8 scale, which still reads every byte)."""
    from PIL import Image, UnidentifiedImageError

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # our own cap below is lower
            with Image.open(file) as image:
                width, height = image.size
                if width * height > MAX_MEDIA_PIXELS:
                    return _too_large(width, height)
                image.verify()
            with Image.open(file) as image:  # a verified image cannot be loaded: open it again
                if image.format == "JPEG":
                    image.draft("RGB", (max(1, width // 8), max(1, height // 8)))
                image.load()
    except Image.DecompressionBombError:  # a header past PIL's own limit (above ours): PIL refuses to open it
        return (
            f"claims more than MAX_MEDIA_PIXELS ({MAX_MEDIA_PIXELS:,}, miles.data.media) pixels: a decompression "
            "bomb, or the wrong file"
        )
    except UnidentifiedImageError:
        return "does not decode (not an image PIL knows)"
    except Exception as exc:  # a damaged file: OSError, SyntaxError, ValueError, struct.error, ...
        return f"does not decode ({clip(first_line(exc) or type(exc).__name__, 120)})"
    return None


def _too_large(width: int, height: int) -> str:
    return (
        f"is {width}x{height} pixels, more than MAX_MEDIA_PIXELS ({MAX_MEDIA_PIXELS:,}, miles.data.media): a "
        "decompression bomb, or the wrong file"
    )


def video_problem(file: Path) -> str | None:
    """A video's first frame must decode when PIL reads the file (animated WebP, GIF, APNG); another container
    (.mp4, ...) is read with PyAV at run time and only checked to exist here."""
    return pixels_problem(file) if file.suffix.lower() in PIL_VIDEO_SUFFIXES else None


# the key of an entry that names its file -> what the preflight checks the file's contents with
MEDIA_KINDS: dict[str, Callable[[Path], str | None]] = {
    "image": pixels_problem,
    "video": video_problem,
}


def file_problem(file: Path) -> str | None:
    """'not found', 'is a directory', ... for a path that is no regular file; None for a regular file."""
    if file.is_file():
        return None
    if file.is_dir():
        return "is a directory, not a file"
    if file.exists():
        return "is not a regular file (a device, FIFO or socket)"
    return "not found"


def _entry_path(where: str, label: str, entry: dict[str, Any]) -> tuple[str, str]:
    """(kind, path as written) of one entry; ConfigError naming `where` and the entry."""
    named = [key for key in MEDIA_KINDS if entry.get(key) is not None]
    if not named:
        keys = show_keys({k: v for k, v in entry.items() if v is not None})
        raise ConfigError(f"{where}: {label} names no file: give {_kinds_text()}; keys: {keys}")
    if len(named) > 1:
        raise ConfigError(f"{where}: {label} names both {named[0]!r} and {named[1]!r}; give one file per entry")
    key = named[0]
    value = entry[key]
    if not isinstance(value, str):
        raise ConfigError(f"{where}: {label}.{key} must be a file path, got {kind(value)}")
    if not value.strip():
        raise ConfigError(f"{where}: {label}.{key} is empty")
    url = url_problem(value, key)
    if url:
        raise ConfigError(f"{where}: {label}.{key} {url}")
    return key, value


def _kinds_text() -> str:
    names = [repr(k) for k in MEDIA_KINDS]
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"


def parse_media(where: str, row: dict[str, Any], key: str | None, root: Path) -> tuple[MediaRef, ...]:
    """The media of one row (empty when it has none); relative paths are joined to `root`. ConfigError naming
    `where`, the key and the entry for a malformed list."""
    if key is None or row.get(key) is None:
        return ()
    entries = row[key]
    if not isinstance(entries, list):
        raise ConfigError(f"{where}: {key!r} (--media-key) must be a list of media objects, got {kind(entries)}")
    media = []
    for i, entry in enumerate(entries):
        label = f"{key!r}[{i}]"
        if not isinstance(entry, dict):
            raise ConfigError(
                f"{where}: {label} must be an object like {{'role': 'condition', 'image': 'src.png'}}, "
                f"got {kind(entry)}"
            )
        role = entry.get("role")
        if role is None:
            raise ConfigError(f"{where}: {label} has no 'role' ({', '.join(MEDIA_ROLES)})")
        if not isinstance(role, str) or role not in MEDIA_ROLES:
            roles = ", ".join(MEDIA_ROLES)
            raise ConfigError(f"{where}: {label}.role {clip_repr(role)} is not a media role ({roles})")
        media_kind, written = _entry_path(where, label, entry)
        media.append(MediaRef(role, media_kind, Path(os.path.abspath(root / written)), written))
    return tuple(media)


def media_problem(where: str, key: str, index: int, ref: MediaRef) -> str | None:
    """The one-line problem of one medium's file (missing, not a regular file, does not decode), or None."""
    problem = file_problem(ref.path)
    if problem == "not found" and not os.path.isabs(ref.written):
        problem = f"not found (looked for {clip(str(ref.path), 160)})"
    problem = problem or MEDIA_KINDS[ref.kind](ref.path)
    if problem is None:
        return None
    return f"{where}: {key!r}[{index}].{ref.kind} {clip_repr(ref.written)} {problem}"


def check_media(where: str, key: str | None, media: tuple[MediaRef, ...]) -> None:
    """ConfigError (one line) at the first medium of a row whose file is missing or does not decode."""
    for i, ref in enumerate(media):
        problem = media_problem(where, str(key), i, ref)
        if problem:
            raise ConfigError(problem)


def check_image(where: str, file: Path, label: str) -> None:
    """ConfigError naming `where` and `label` unless `file` decodes as an image (the check the SFT and preference
    images share with the media; the file is known to exist)."""
    problem = pixels_problem(file)
    if problem:
        raise ConfigError(f"{where}: {label} {clip(str(file), 160)} {problem}")


def open_condition_images(paths: Any) -> list[Any]:
    """The condition images at `paths` (in order) as RGB PIL images, read once and closed: what a family's
    `encode_media` takes, for the engine's prompt rows and SFT's rows alike."""
    from PIL import Image

    images = []
    for path in paths:
        with Image.open(path) as image:
            images.append(image.convert("RGB"))
    return images
