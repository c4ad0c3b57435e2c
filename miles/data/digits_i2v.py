"""The embedded digits image-to-video task (`digits-i2v`): the moving digits of `digits-video`, conditioned on their
first frame.

Each example of the digits split is the `digits-video` example (the same split, the same direction per example:
`assign_directions`, the same prompt "the digit 7 moving left") with the video's first frame as its condition image:
the digit, half the frame wide, at the edge it starts from. The model must keep that frame (the digit, its place)
and move it the prompted way. The reward that reads the task is `digit_i2v` (`miles.rewards.scorers.digit_i2v`).

Parts (a folder under `$MILES_HOME/data/digits-i2v`, written once by `write_digits_i2v_data`):
    train.jsonl       one prompt row per train example: {"input": "the digit 7 moving left",
                      "media": [{"role": "condition", "image": "frames/train_00000.png"}],
                      "metadata": {"label": 7, "direction": "left"}}
    test.jsonl        the same for the test split (eval)
    sft/train.jsonl   SFT rows: the prompt row plus its target video, {"video": "videos/train_00000.webp", ...};
                      the media path is relative to this file ("../frames/train_00000.png")
    sft/test.jsonl    the same for the test split
    frames/*.png      the first frames, 64x64 RGB (white ink on black)
    sft/videos/*.webp the digits-video SFT videos (NUM_FRAMES frames of 64x64 RGB, animated lossless WebP), rendered
                      by the same code
    digits-i2v.json   manifest
"""

from __future__ import annotations

import json
from pathlib import Path

from miles.builtin.names import DATASET_FILES
from miles.data.digits import SPLIT_SEED, load_digits_split, write_jsonl
from miles.data.digits_video import (
    DIRECTIONS,
    NUM_FRAMES,
    PROMPT_TEMPLATE,
    VIDEO_FPS,
    VIDEO_SIZE,
    assign_directions,
    prompt_for,
    render_video,
    video_to_rgb_uint8,
)

FORMAT_VERSION = 1
MANIFEST = "digits-i2v.json"
FILES = {part: DATASET_FILES[part] for part in ("train", "test", "sft", "sft-test")}


def write_digits_i2v_data(out_dir: str | Path, seed: int = SPLIT_SEED) -> dict[str, Path]:
    """Write the image-to-video task's prompt files, first frames and SFT videos into `out_dir`; return the parts."""
    from PIL import Image

    from miles.io.video import encode_video

    out = Path(out_dir)
    split = load_digits_split(seed)
    (out / "frames").mkdir(parents=True, exist_ok=True)
    (out / "sft" / "videos").mkdir(parents=True, exist_ok=True)
    for name, (x, y) in {"train": (split.train_x, split.train_y), "test": (split.test_x, split.test_y)}.items():
        prompts, sft = [], []
        for i, (x8, label, direction) in enumerate(zip(x, y.tolist(), assign_directions(y), strict=True)):
            frames = video_to_rgb_uint8(render_video(x8, direction))
            frame = f"frames/{name}_{i:05d}.png"
            Image.fromarray(frames[0]).save(out / frame)
            video = f"videos/{name}_{i:05d}.webp"
            (out / "sft" / video).write_bytes(encode_video(frames, "webp", fps=VIDEO_FPS))
            meta = {"label": int(label), "direction": direction}
            prompt = prompt_for(label, direction)
            prompts.append({"input": prompt, "media": [{"role": "condition", "image": frame}], "metadata": meta})
            media = [{"role": "condition", "image": f"../{frame}"}]
            sft.append({"video": video, "input": prompt, "media": media, "metadata": meta})
        write_jsonl(out / FILES[name], prompts)
        write_jsonl(out / FILES["sft" if name == "train" else "sft-test"], sft)
    manifest = {
        "format_version": FORMAT_VERSION,
        "source": "sklearn.datasets.load_digits, moving (digits_video.render_video), the first frame as condition",
        "split_seed": seed,
        "num_train": len(split.train_y),
        "num_test": len(split.test_y),
        "video_size": VIDEO_SIZE,
        "num_frames": NUM_FRAMES,
        "fps": VIDEO_FPS,
        "directions": list(DIRECTIONS),
        "prompt_template": PROMPT_TEMPLATE,
        "image_format": "PNG, RGB (white ink on black)",
        "video_format": "animated lossless WebP, RGB (white ink on black)",
        "files": FILES,
    }
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return {name: out / rel for name, rel in FILES.items()}
