"""The digit classifier the tiny builds fit and store, and the digit reward reads
(`miles.rewards.scorers.digit`): which digit a generated image shows.

The classifier (an RBF SVC, temperature-calibrated, from scikit-learn) is fitted at tiny-model build
time on the digits train split and stored in the checkpoint, `<ckpt>/digit_classifier/`:
    classifier.pkl    the pickled estimator (trusted: written by miles' own builder)
    classifier.json   metadata: test accuracy, split, feature spec, sklearn version
Its input is the 8x8 digit in [0, 1] (white ink on black), flattened to 64 features. Any image is
brought there the way the data was made, in reverse: to gray (mean of RGB), to [0, 1], then
adaptive average pooling to 8x8 (exact block means for 64x64, which undoes the upsampling).

Images: PIL images, or float tensors/arrays in [0, 1] or [-1, 1] (`value_range="auto"` picks [-1, 1]
when any value is below -0.05), or uint8 arrays; shapes (N,C,H,W), (N,H,W,C), (C,H,W), (H,W,C),
(H,W), or a list of those; any size. A 3-D array whose first dim is 1, 3 or 4 is one CHW image.
"""

from __future__ import annotations

import functools
import json
import pickle
from pathlib import Path
from typing import Any

import numpy as np

from miles.data.digits import DIGIT_SIZE, downsample_to_digits, load_digits_split

CLASSIFIER_DIRNAME = "digit_classifier"
CLASSIFIER_FILE = "classifier.pkl"
METADATA_FILE = "classifier.json"
_CHANNELS = (1, 3, 4)


# ---- images -> 8x8 digits ----------------------------------------------------------------------
def to_numpy(x: Any) -> np.ndarray:
    """An array of `x` (a torch tensor as float32 on the CPU, without importing torch)."""
    if hasattr(x, "detach"):  # torch.Tensor, without importing torch
        x = x.detach().float().cpu().numpy()
    return np.asarray(x)


def _as_nhwc(arr: np.ndarray) -> np.ndarray:
    if arr.ndim == 2:
        return arr[None, :, :, None]
    if arr.ndim == 3:
        if arr.shape[0] in _CHANNELS:
            return arr.transpose(1, 2, 0)[None]
        if arr.shape[-1] in _CHANNELS:
            return arr[None]
        return arr[..., None]  # (N, H, W) gray batch
    if arr.ndim == 4:
        return arr.transpose(0, 2, 3, 1) if arr.shape[1] in _CHANNELS else arr
    raise ValueError(f"cannot read images of shape {arr.shape}")


def _gray(nhwc: np.ndarray) -> np.ndarray:
    channels = nhwc.shape[-1]
    if channels == 4:
        nhwc = nhwc[..., :3]
    return nhwc.mean(axis=-1) if channels > 1 else nhwc[..., 0]


def images_to_digits(images: Any, value_range: str = "auto") -> np.ndarray:
    """Images (see the module docstring) -> (N, 8, 8) float32 in [0, 1]."""
    if value_range not in ("auto", "0,1", "-1,1"):
        raise ValueError(f"value_range must be 'auto', '0,1' or '-1,1', got {value_range!r}")
    items = list(images) if isinstance(images, (list, tuple)) else [images]
    arrays = []
    for item in items:
        if hasattr(item, "convert") and hasattr(item, "size"):  # PIL.Image
            arrays.append(np.asarray(item.convert("RGB"), dtype=np.uint8)[None])
        else:
            arrays.append(_as_nhwc(to_numpy(item)))
    floats = [a for a in arrays if a.dtype != np.uint8]
    lo = min((float(a.min()) for a in floats if a.size), default=0.0)
    signed = value_range == "-1,1" or (value_range == "auto" and lo < -0.05)
    out = []
    for a in arrays:
        if a.dtype == np.uint8:
            gray = _gray(a.astype(np.float32) / 255.0)
        else:
            gray = _gray(a.astype(np.float32))
            gray = (gray + 1.0) / 2.0 if signed else gray
        out.append(downsample_to_digits(np.clip(gray, 0.0, 1.0)))
    if not out:
        return np.zeros((0, DIGIT_SIZE, DIGIT_SIZE), dtype=np.float32)
    return np.concatenate(out, axis=0)


def videos_to_digits(videos: Any, value_range: str = "auto") -> np.ndarray:
    """Videos -> (N * F, 8, 8) float32 in [0, 1]: each frame's digit, cropped around its ink centroid
    (`miles.data.digits_video.crop_digits`, half the frame) and pooled to 8x8.

    `videos`: one video [3, F, H, W] / [F, H, W], a batch [N, 3, F, H, W], or a list of videos; float in
    [0, 1] or [-1, 1] (`value_range` as for images)."""
    from miles.data.digits_video import crop_digits

    if not isinstance(videos, (list, tuple)):
        arr = to_numpy(videos)
        videos = list(arr) if arr.ndim == 5 else [arr]
    arrays = [to_numpy(v).astype(np.float32) for v in videos]
    lo = min((float(a.min()) for a in arrays if a.size), default=0.0)
    signed = value_range == "-1,1" or (value_range == "auto" and lo < -0.05)
    out = []
    for a in arrays:
        a = (a + 1.0) / 2.0 if signed else a
        out.append(downsample_to_digits(crop_digits(np.clip(a, 0.0, 1.0))))
    if not out:
        return np.zeros((0, DIGIT_SIZE, DIGIT_SIZE), dtype=np.float32)
    return np.concatenate(out, axis=0)


def digits_to_features(x8: np.ndarray) -> np.ndarray:
    return np.asarray(x8, dtype=np.float64).reshape(len(x8), DIGIT_SIZE * DIGIT_SIZE)


# ---- the classifier ----------------------------------------------------------------------------
def moving_digit_crops(x8: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Every frame of each digit's moving video (directions in turn), read as `videos_to_digits` reads it."""
    from miles.data.digits_video import DIRECTIONS, NUM_FRAMES, render_video

    videos = [render_video(x, DIRECTIONS[i % len(DIRECTIONS)]) for i, x in enumerate(x8)]
    return videos_to_digits([v[None] for v in videos], "0,1"), np.repeat(y, NUM_FRAMES)


def fit_digit_classifier(seed: int = 0, video: bool = False) -> tuple[Any, dict[str, Any]]:
    """Fit the classifier on the digits train split; return it and its metadata (with test accuracy).

    `video`: fit it on the frames of moving digits as `videos_to_digits` reads them (centroid crops),
    the classifier a video checkpoint stores (metadata `input: "video"`)."""
    import sklearn
    from sklearn.calibration import CalibratedClassifierCV
    from sklearn.svm import SVC

    split = load_digits_split(seed)
    train_x, train_y, test_x, test_y = split.train_x, split.train_y, split.test_x, split.test_y
    if video:
        train_x, train_y = moving_digit_crops(train_x, train_y)
        test_x, test_y = moving_digit_crops(test_x, test_y)
    clf = CalibratedClassifierCV(SVC(C=5.0, gamma="scale"), method="temperature", ensemble=False, cv=5)
    clf.fit(digits_to_features(train_x), train_y)
    pred = clf.predict(digits_to_features(test_x))
    meta = {
        "input": "video" if video else "image",
        "kind": "CalibratedClassifierCV(SVC(C=5, gamma='scale', rbf), method='temperature')",
        "test_accuracy": float((pred == test_y).mean()),
        "num_train": len(train_y),
        "num_test": len(test_y),
        "split_seed": seed,
        "classes": [int(c) for c in clf.classes_],
        "features": "8x8 gray digit in [0,1], white ink on black, row-major (64 values)"
        + ("; per video frame: the half-frame square around the ink centroid, pooled to 8x8" if video else ""),
        "sklearn_version": sklearn.__version__,
    }
    return clf, meta


def save_digit_classifier(classifier: Any, metadata: dict[str, Any], out_dir: str | Path) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / CLASSIFIER_FILE, "wb") as f:
        pickle.dump(classifier, f, protocol=4)
    (out / METADATA_FILE).write_text(json.dumps(metadata, indent=2, sort_keys=True) + "\n")
    return out


def classifier_dir(path: str | Path | None = None) -> Path:
    """The classifier folder for a checkpoint dir, a classifier dir, or (None) the default tiny-sd3."""
    if path is None:
        from miles.builtin.names import TINY_SD3_NAME, builtin_path
        from miles.core.inputs import ensure_builtin

        path = ensure_builtin(TINY_SD3_NAME, builtin_path(TINY_SD3_NAME))
    path = Path(path)
    return path if (path / CLASSIFIER_FILE).exists() else path / CLASSIFIER_DIRNAME


def read_classifier_metadata(path: str | Path | None = None) -> dict[str, Any]:
    return json.loads((classifier_dir(path) / METADATA_FILE).read_text())


@functools.lru_cache(maxsize=8)
def _load_cached(resolved: str) -> Any:
    with open(Path(resolved) / CLASSIFIER_FILE, "rb") as f:
        return pickle.load(f)


def load_digit_classifier(path: str | Path | None = None) -> Any:
    """Load (and cache) the digit classifier of a checkpoint (default: tiny-sd3, built on first use)."""
    folder = classifier_dir(path)
    if not (folder / CLASSIFIER_FILE).exists():
        raise FileNotFoundError(f"no digit classifier at {folder} (build it with `miles models build tiny-sd3`)")
    return _load_cached(str(folder.resolve()))


def as_classifier(classifier: Any) -> Any:
    """The fitted classifier: `classifier` itself, or the one saved at that path (None: the default's)."""
    if classifier is None or isinstance(classifier, (str, Path)):
        return load_digit_classifier(classifier)
    return classifier
