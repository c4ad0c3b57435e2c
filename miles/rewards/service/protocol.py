"""The wire format of the reward service (`server.py` serves it, `client.py` speaks it). No pickle, ever.

Request: `POST /score`, Content-Type `application/msgpack` (or `application/json`, bytes as base64 strings):

    {"version": PROTOCOL_VERSION,
     "reward": "digit",
     "items": [{"image": <PNG bytes> | [<PNG bytes>, ...],   # an image, or a video's frames in order
                "frames": 0 | F,            # 0: a still image; F >= 1: a video of F frames (a list of F PNGs)
                "dtype": "float32" | "uint8",   # what the server hands the scorer (default float32)
                "prompt": "...",
                "metadata": {...},          # plain values only (str, int, float, bool, None, list, map)
                "name": "sample 3 (prompt 'a cat')"},   # optional: how an error names the item
               ...]}

Answer: the same format as the request (msgpack for msgpack, else JSON):

    {"rewards": [float, ...]}                  200, one per item, in order
    {"error": "one line", "retryable": bool}   4xx / 5xx; `retryable: false` marks a reward that failed on
                                               its input (re-sending the same pixels fails the same way)

Pixels: every image travels as an 8-bit RGB PNG, lossless for uint8. A float image in [0, 1] is quantised
to uint8 on the client exactly as the in-process rewards quantise it (`scorers.jpeg.image_to_uint8`: x * 255,
rounded, clipped; a 1-channel image repeated to RGB), so in-process and remote scoring read the same pixels.
The server hands the scorer what a `RewardPool` worker gets: numpy arrays, channels first, the layout of a
`Sample`'s image: `[3, H, W]` (a video `[3, F, H, W]`, its frames `[3, H, W]` on the wire in order), float32
`uint8 / 255` (or the uint8 array itself when the client sent uint8, `dtype: "uint8"`).

Parity: a reward that quantises its input to uint8 itself (jpeg_compressibility, jpeg_incompressibility,
ocr, PickScore's processor) scores the same pixels either way, so remote rewards equal in-process ones bit for
bit. A reward that reads float pixels directly (the digit reward: gray = mean of RGB, pooled to 8x8, no
quantisation) sees each pixel moved by at most 1/510 when the sample was a float image off the uint8 grid: the
remote reward then differs from the in-process one in the last digits. Images already on the uint8 grid (uint8
arrays, PIL images, `u / 255` floats) score bit-identically with every reward.

Refused with HTTP 415: pickle (Content-Type `application/python-pickle` and its spellings; or a body that starts
with the pickle byte 0x80, whatever its Content-Type), any other Content-Type (`application/octet-stream` ...),
and msgpack extension types (including timestamps) anywhere in a body. Only plain values are read: no object
is ever built from the body but str, bytes, numbers, bools, None, lists and maps.
"""

from __future__ import annotations

import base64
import binascii
import io
import json
import math
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np

PROTOCOL_VERSION = 1
MSGPACK = "application/msgpack"
JSON = "application/json"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
PICKLE_MAGIC = 0x80
PNG_COMPRESS_LEVEL = 1  # lossless at every level; 1 is several times faster to write than PIL's default 6
PICKLE_TYPES = frozenset(
    {"application/python-pickle", "application/x-python-pickle", "application/pickle", "application/x-pickle"}
)
MSGPACK_TYPES = frozenset({MSGPACK, "application/x-msgpack", "application/vnd.msgpack"})
DTYPES = ("float32", "uint8")


class ProtocolError(ValueError):
    """A body the service cannot read: `status` is the HTTP status to answer (400 or 415), the message one line."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


class _ExtRefused(ValueError):
    pass


@dataclass
class ScoreItem:
    image: np.ndarray  # [3, H, W] or a video [3, F, H, W]; float32 in [0, 1] or uint8
    prompt: str
    metadata: dict[str, Any] = field(default_factory=dict)
    name: str | None = None


@dataclass
class ScoreRequest:
    reward: str
    items: list[ScoreItem]
    version: int = PROTOCOL_VERSION


# ---- content types -----------------------------------------------------------------------------
def media_type(content_type: str | None) -> str:
    """`application/msgpack; charset=...` -> `application/msgpack` (lower case; '' when missing)."""
    return (content_type or "").split(";", 1)[0].strip().lower()


def wire_format(content_type: str | None, body: bytes = b"") -> str:
    """MSGPACK or JSON for a body of this Content-Type; ProtocolError(415) for pickle or anything else."""
    kind = media_type(content_type)
    if body[:1] == bytes([PICKLE_MAGIC]) and len(body) > 1:  # as msgpack, 0x80 is `{}` alone: a pickle, whatever
        shown = kind or "none"  # the Content-Type says
        raise ProtocolError(
            f"pickle bodies are refused (Content-Type {shown}, body starts with the pickle byte 0x80); send "
            f"{MSGPACK} or {JSON}",
            415,
        )
    if kind in MSGPACK_TYPES:
        return MSGPACK
    if kind == JSON or kind.endswith("+json"):
        return JSON
    if kind in PICKLE_TYPES or "pickle" in kind:
        raise ProtocolError(f"pickle bodies are refused (Content-Type {kind}); send {MSGPACK} or {JSON}", 415)
    raise ProtocolError(f"unsupported Content-Type {kind or 'none'}; send {MSGPACK} or {JSON}", 415)


# ---- bodies ------------------------------------------------------------------------------------
def _refuse_ext(code: int, data: bytes) -> Any:
    raise _ExtRefused(f"msgpack extension types are refused (found ext type {code})")


def _plain(value: Any, where: str) -> None:
    """Refuse anything but plain values (msgpack decodes timestamps itself, past `ext_hook`)."""
    stack = [value]
    while stack:
        v = stack.pop()
        if v is None or isinstance(v, (str, bytes, bool, int, float)):
            continue
        if isinstance(v, list):
            stack.extend(v)
        elif isinstance(v, dict):
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, msgpack.Timestamp):
            raise ProtocolError(f"msgpack extension types are refused (a timestamp in {where})", 415)
        else:
            raise ProtocolError(f"{where} holds a {type(v).__name__}, not a plain value", 415)


def loads(body: bytes, fmt: str, what: str = "request") -> Any:
    """Decode a msgpack / JSON body into plain values; ProtocolError(400 malformed, 415 ext types)."""
    if fmt == MSGPACK:
        try:
            value = msgpack.unpackb(body, raw=False, ext_hook=_refuse_ext, strict_map_key=True)
        except _ExtRefused as exc:
            raise ProtocolError(str(exc), 415) from None
        except Exception as exc:  # msgpack raises several unrelated types on a bad body
            raise ProtocolError(f"the {what} is not valid msgpack ({type(exc).__name__}: {exc})") from None
        _plain(value, f"the {what}")
        return value
    try:
        return json.loads(body)
    except (UnicodeDecodeError, ValueError) as exc:
        raise ProtocolError(f"the {what} is not valid JSON ({exc})") from None


def _json_default(value: Any) -> Any:
    if isinstance(value, (bytes, bytearray, memoryview)):
        return base64.b64encode(bytes(value)).decode("ascii")
    raise TypeError(f"cannot send a {type(value).__name__} as JSON")


def dumps(value: Any, fmt: str) -> bytes:
    if fmt == MSGPACK:
        return msgpack.packb(value, use_bin_type=True)
    return json.dumps(value, default=_json_default, allow_nan=False, separators=(",", ":")).encode()


def encode_response(rewards: Sequence[float], fmt: str) -> bytes:
    return dumps({"rewards": [float(r) for r in rewards]}, fmt)


def encode_error(message: str, fmt: str = JSON, *, retryable: bool = True) -> bytes:
    return dumps({"error": one_line(message), "retryable": retryable}, fmt)


def one_line(text: str, limit: int = 2000) -> str:
    line = " ".join(str(text).split())
    return line if len(line) <= limit else line[: limit - 3] + "..."


def decode_response(body: bytes, content_type: str | None) -> dict[str, Any]:
    """An answer of the service -> its map; ProtocolError when it is not one (not msgpack/JSON, not a map)."""
    kind = media_type(content_type)
    fmt = MSGPACK if kind in MSGPACK_TYPES else JSON if (kind == JSON or kind.endswith("+json")) else None
    if fmt is None:
        text = one_line(body[:200].decode("utf-8", "replace")) or "an empty body"
        raise ProtocolError(f"answered Content-Type {kind or 'none'}, not a reward service answer: {text}")
    value = loads(body, fmt, "answer")
    if not isinstance(value, dict):
        raise ProtocolError(f"answered a {type(value).__name__}, expected a map")
    return value


def read_rewards(answer: Mapping[str, Any], count: int) -> list[float]:
    values = answer.get("rewards")
    if not isinstance(values, list) or len(values) != count:
        got = f"{len(values)} rewards" if isinstance(values, list) else repr(values)[:80]
        raise ProtocolError(f"answered {got} for {count} items")
    out = []
    for v in values:
        if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v):
            raise ProtocolError(f"answered a reward that is not a finite number: {v!r}")
        out.append(float(v))
    return out


# ---- images ------------------------------------------------------------------------------------
def _png(rgb: np.ndarray) -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(rgb).save(buffer, format="PNG", compress_level=PNG_COMPRESS_LEVEL)
    return buffer.getvalue()


def _is_uint8(image: Any) -> bool:
    if hasattr(image, "convert") and hasattr(image, "size"):  # PIL.Image
        return True
    return str(getattr(image, "dtype", "")).removeprefix("torch.") == "uint8"


def encode_image(image: Any) -> tuple[bytes | list[bytes], int, str]:
    """An image or a video -> (PNG bytes, or a list of one PNG per frame; frames (0 for an image); dtype).

    Images: what `image_to_uint8` reads ([3, H, W] / [H, W, 3] / 1-channel, float in [0, 1] or uint8, PIL).
    Videos: 4-D `[C, F, H, W]` with C 1 or 3, the layout of a video sample."""
    from miles.rewards.scorers.jpeg import image_to_uint8

    dtype = "uint8" if _is_uint8(image) else "float32"
    shape = tuple(getattr(image, "shape", ()))
    if len(shape) != 4:
        return _png(image_to_uint8(image)), 0, dtype
    if shape[0] not in (1, 3):
        raise ValueError(f"expected a video [3, F, H, W] (channels first), got shape {shape}")
    if hasattr(image, "detach"):  # torch.Tensor, without importing torch
        image = image.detach().cpu()
        image = image.float().numpy() if image.is_floating_point() else image.numpy()
    arr = np.asarray(image)
    return [_png(image_to_uint8(arr[:, f])) for f in range(shape[1])], shape[1], dtype


def _decode_png(data: Any, where: str) -> np.ndarray:
    from PIL import Image

    if not isinstance(data, (bytes, bytearray)) or not bytes(data[:8]) == PNG_MAGIC:
        raise ProtocolError(f"{where} is not a PNG")
    try:
        with Image.open(io.BytesIO(data), formats=["PNG"]) as im:
            return np.asarray(im.convert("RGB"), dtype=np.uint8)
    except Exception as exc:
        raise ProtocolError(f"{where} is not a readable PNG ({type(exc).__name__}: {exc})") from None


def _to_scorer(rgb: np.ndarray, dtype: str) -> np.ndarray:
    """(..., H, W, 3) uint8 -> channels first, as the scorer gets it: uint8, or float32 uint8 / 255."""
    chw = np.ascontiguousarray(np.moveaxis(rgb, -1, 0))
    return chw if dtype == "uint8" else chw.astype(np.float32) / np.float32(255.0)


def decode_image(data: Any, frames: int, dtype: str, where: str = "the image") -> np.ndarray:
    """The wire form of one item -> `[3, H, W]` (or a video `[3, F, H, W]`) as the scorer gets it."""
    if dtype not in DTYPES:
        raise ProtocolError(f"{where}: dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if frames == 0:
        if isinstance(data, list):
            raise ProtocolError(f"{where} is a list of {len(data)} PNGs with frames 0; a video sets frames")
        return _to_scorer(_decode_png(data, where), dtype)
    if not isinstance(data, list) or len(data) != frames:
        got = f"a list of {len(data)} PNGs" if isinstance(data, list) else "one PNG"
        raise ProtocolError(f"{where}: frames is {frames} but the image is {got}")
    rgb = [_decode_png(d, f"{where} frame {f}") for f, d in enumerate(data)]
    if len({a.shape for a in rgb}) != 1:
        raise ProtocolError(f"{where}: the video's frames differ in size ({sorted({a.shape[:2] for a in rgb})})")
    return _to_scorer(np.stack(rgb), dtype)  # [F, H, W, 3] -> [3, F, H, W]


# ---- metadata ----------------------------------------------------------------------------------
def _plain_metadata(value: Any) -> Any:
    """numpy / torch scalars and arrays -> Python values (what msgpack and JSON can hold)."""
    if value is None or isinstance(value, (str, bool, int, float)):
        return value
    if isinstance(value, Mapping):
        return {str(k): _plain_metadata(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain_metadata(v) for v in value]
    if hasattr(value, "tolist") and hasattr(value, "shape"):  # numpy / torch scalar or array
        return _plain_metadata(value.tolist())
    raise TypeError(f"a {type(value).__name__} value cannot be sent (plain values only)")


# ---- requests ----------------------------------------------------------------------------------
def encode_request(
    reward: str,
    images: Sequence[Any],
    prompts: Sequence[str],
    metadata: Sequence[Mapping[str, Any]],
    names: Sequence[str] | None = None,
    fmt: str = MSGPACK,
) -> bytes:
    """A `POST /score` body (ValueError naming the item when an image or metadata cannot be sent)."""
    items = []
    for i, (image, prompt, meta) in enumerate(zip(images, prompts, metadata, strict=True)):
        name = names[i] if names is not None else f"item {i}"
        try:
            data, frames, dtype = encode_image(image)
            plain = _plain_metadata(dict(meta or {}))
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{name}: {exc}") from exc
        item = {"image": data, "frames": frames, "dtype": dtype, "prompt": str(prompt), "metadata": plain}
        if names is not None:
            item["name"] = str(name)
        items.append(item)
    body = {"version": PROTOCOL_VERSION, "reward": reward, "items": items}
    try:
        return dumps(body, fmt)
    except (TypeError, ValueError, OverflowError) as exc:
        raise ValueError(f"the metadata cannot be sent as {fmt}: {exc}") from exc


def _field(item: Mapping[str, Any], key: str, kind: type | tuple[type, ...], default: Any, where: str) -> Any:
    value = item.get(key, default)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ProtocolError(f"{where}: {key!r} must be a {getattr(kind, '__name__', kind)}, got {value!r:.80}")
    return value


def _b64(value: Any, fmt: str, where: str) -> Any:
    if fmt != JSON:
        return value
    try:
        if isinstance(value, list):
            return [base64.b64decode(v, validate=True) for v in value]
        return base64.b64decode(value, validate=True)
    except (TypeError, ValueError, binascii.Error):
        raise ProtocolError(f"{where}: the image is not base64 (JSON bodies carry PNGs as base64 strings)") from None


def decode_request(body: bytes, content_type: str | None) -> ScoreRequest:
    """A `POST /score` body -> ScoreRequest with decoded pixels; ProtocolError (400 / 415) with one line."""
    fmt = wire_format(content_type, body)
    value = loads(body, fmt)
    if not isinstance(value, dict):
        raise ProtocolError(f"the request must be a map, got {type(value).__name__}")
    version = value.get("version")
    if version != PROTOCOL_VERSION:
        raise ProtocolError(
            f"protocol version {version!r}, this reward service speaks version {PROTOCOL_VERSION}; run the same "
            "miles version on both sides"
        )
    reward = value.get("reward")
    if not isinstance(reward, str) or not reward:
        raise ProtocolError(f"'reward' must be a reward name, got {reward!r:.80}")
    raw_items = value.get("items")
    if not isinstance(raw_items, list):
        raise ProtocolError(f"'items' must be a list, got {type(raw_items).__name__}")
    items = []
    for i, raw in enumerate(raw_items):
        where = f"item {i}"
        if not isinstance(raw, dict):
            raise ProtocolError(f"{where} must be a map, got {type(raw).__name__}")
        prompt = _field(raw, "prompt", str, "", where)
        meta = _field(raw, "metadata", dict, {}, where)
        name = raw.get("name")
        name = name if isinstance(name, str) and name else None
        where = name or where
        frames = _field(raw, "frames", int, 0, where)
        dtype = _field(raw, "dtype", str, "float32", where)
        if frames < 0:
            raise ProtocolError(f"{where}: frames must be 0 (an image) or the video's frame count, got {frames}")
        if "image" not in raw:
            raise ProtocolError(f"{where} has no image")
        image = decode_image(_b64(raw["image"], fmt, where), frames, dtype, where)
        items.append(ScoreItem(image=image, prompt=prompt, metadata=meta, name=name))
    return ScoreRequest(reward=reward, items=items, version=version)
