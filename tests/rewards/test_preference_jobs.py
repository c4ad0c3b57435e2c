"""The preference models as `--rm-type` values of a job: each resolves (and shows in `inspect-config`), the config
refuses a missing flag, the preflight a missing file or folder, and the dispatch scores with the model's own scorer
(on the session's tiny random CLIP: names say so where weights are random)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from reward_helpers import noise_image

from miles.config.resolution import schema_args
from miles.config.resolve import resolve
from miles.core.errors import ConfigError
from miles.core.sample import Sample
from miles.preflight import find_problems
from miles.rewards import REWARD_TYPES
from miles.rewards.dispatch import batched_async_rm

JOB = {
    "hf_checkpoint": "tiny-sd3",
    "prompt_data": "digits:labels",
    "rollout_batch_size": 2,
    "n_samples_per_prompt": 2,
    "diffusion_num_sde_steps": 2,
    "actor_num_gpus_per_node": 1,
    "num_gpus_per_node": 1,
}
PREFERENCE = ("clip_score", "aesthetic", "hpsv2", "image_reward", "vlm_judge")


@pytest.mark.parametrize("rm_type", PREFERENCE)
def test_each_preference_model_refuses_a_job_without_its_flags(rm_type: str) -> None:
    needed = REWARD_TYPES[rm_type].required
    assert needed
    with pytest.raises(ConfigError, match=f"{rm_type} requires --{needed[0].replace('_', '-')}"):
        resolve("rl", cli={**JOB, "rm_type": rm_type})


# each preference model's required flags, spelled out: the config names the one a job misses
REQUIRED_FLAGS = [
    ("clip_score", "--clip-score-model-path"),
    ("aesthetic", "--aesthetic-model-path"),
    ("aesthetic", "--aesthetic-clip-path"),
    ("hpsv2", "--hps-model-path"),
    ("hpsv2", "--hps-tokenizer-path"),
    ("image_reward", "--image-reward-model-path"),
    ("image_reward", "--image-reward-tokenizer-path"),
    ("vlm_judge", "--vlm-judge-url"),
]


@pytest.mark.parametrize(("rm_type", "flag"), REQUIRED_FLAGS)
def test_a_preference_job_missing_one_required_flag_is_refused_naming_it(rm_type: str, flag: str) -> None:
    others = {f for t, f in REQUIRED_FLAGS if t == rm_type and f != flag}
    cli = {**JOB, "rm_type": rm_type, **{f.removeprefix("--").replace("-", "_"): f"/models{f}" for f in others}}
    with pytest.raises(ConfigError, match=f"{rm_type} requires {flag}$") as error:
        resolve("rl", cli=cli)
    assert not any(other in str(error.value) for other in others)


# each preference model's files and folders: the preflight names the one that is not there
MODEL_PATH_FLAGS = [
    ("clip_score", "--clip-score-model-path", "no such folder"),
    ("clip_score", "--clip-score-processor-path", "no such folder"),
    ("aesthetic", "--aesthetic-model-path", "no such file"),
    ("aesthetic", "--aesthetic-clip-path", "no such folder"),
    ("hpsv2", "--hps-model-path", "no such file"),
    ("hpsv2", "--hps-tokenizer-path", "no such folder"),
    ("image_reward", "--image-reward-model-path", "no such file"),
    ("image_reward", "--image-reward-tokenizer-path", "no such folder"),
]


@pytest.mark.parametrize(("rm_type", "flag", "problem"), MODEL_PATH_FLAGS)
def test_the_preflight_names_a_missing_model_file_or_folder(
    rm_type: str, flag: str, problem: str, tmp_path: Path
) -> None:
    """Only `flag`'s path is missing (the others name a weights file, or a folder with the files a model, processor
    or tokenizer folder holds): one problem, naming the flag and its path."""
    weights, folder = tmp_path / "weights.pt", tmp_path / "folder"
    weights.write_bytes(b"")
    folder.mkdir()
    for name in ("config.json", "preprocessor_config.json", "tokenizer_config.json"):
        (folder / name).write_text("{}")
    cli: dict[str, object] = {**JOB, "rm_type": rm_type}
    for other_type, other, what in MODEL_PATH_FLAGS:
        if other_type == rm_type:
            dest = other.removeprefix("--").replace("-", "_")
            present = weights if what == "no such file" else folder
            cli[dest] = str(tmp_path / "nowhere" / dest if other == flag else present)
    problems = [line for line in find_problems(resolve("rl", cli=cli)) if line.startswith("--")]
    missing = cli[flag.removeprefix("--").replace("-", "_")]
    assert len(problems) == 1 and problems[0].startswith(f"{flag} {missing}: {problem}"), problems


@pytest.mark.parametrize(
    ("flag", "value"),
    [
        ("--clip-score-scale", -1.0),
        ("--vlm-judge-max-score", 0.0),
        ("--vlm-judge-num-frames", 0),
        ("--vlm-judge-max-concurrency", 0),
    ],
)
def test_preference_flags_below_their_minimum_are_refused(flag: str, value: float) -> None:
    dest = flag.removeprefix("--").replace("-", "_")
    cli = {**JOB, "rm_type": "vlm_judge", "vlm_judge_url": "http://127.0.0.1:9", dest: value}
    with pytest.raises(ConfigError, match=f"{flag}: {value} is below the minimum"):
        resolve("rl", cli=cli)


def _missing_paths(tmp_path: Path, rm_type: str) -> dict[str, str]:
    return {
        dest: str(tmp_path / "nowhere" / dest) if dest != "vlm_judge_url" else "http://127.0.0.1:9"
        for dest in REWARD_TYPES[rm_type].required
    }


@pytest.mark.parametrize("rm_type", ["clip_score", "aesthetic", "hpsv2", "image_reward"])
def test_the_preflight_refuses_each_missing_model_path(rm_type: str, tmp_path: Path) -> None:
    cli = {**JOB, "rm_type": rm_type, **_missing_paths(tmp_path, rm_type)}
    problems = find_problems(resolve("rl", cli=cli))
    for dest, _ in REWARD_TYPES[rm_type].model_paths:
        if dest in cli:
            assert any(line.startswith(f"--{dest.replace('_', '-')} {cli[dest]}") for line in problems), problems


def test_a_weights_file_given_as_a_folder_is_named(tmp_path: Path) -> None:
    cli = {**JOB, "rm_type": "hpsv2", "hps_model_path": str(tmp_path), "hps_tokenizer_path": str(tmp_path)}
    problems = find_problems(resolve("rl", cli=cli))
    assert f"--hps-model-path {tmp_path}: is a folder; give the weights file in it" in problems
    assert any(line.startswith(f"--hps-tokenizer-path {tmp_path}: the folder holds no") for line in problems)


def test_inspect_config_shows_a_clip_score_job(tiny_clip: tuple[str, str], capsys: pytest.CaptureFixture) -> None:
    from miles_cli.main import main

    model_dir, processor_dir = tiny_clip
    argv = ["inspect-config", "--recipe", "tiny-digits-grpo", "--rm-type", "clip_score"]
    argv += ["--clip-score-model-path", model_dir, "--clip-score-processor-path", processor_dir]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "clip_score" in out and model_dir in out.replace("\n", "")


@pytest.mark.parametrize("rm_type", ["aesthetic", "hpsv2", "image_reward", "vlm_judge"])
def test_inspect_config_resolves_each_preference_job(
    rm_type: str, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """`inspect-config` (without --check) resolves and shows the job; the files are the preflight's business."""
    from miles_cli.main import main

    argv = ["inspect-config", "--recipe", "tiny-digits-grpo", "--rm-type", rm_type]
    for dest, value in _missing_paths(tmp_path, rm_type).items():
        argv += ["--" + dest.replace("_", "-"), value]
    assert main(argv) == 0
    out = capsys.readouterr().out.replace("\n", "")
    assert rm_type in out
    for dest in REWARD_TYPES[rm_type].required:
        assert "--" + dest.replace("_", "-") in out


def test_dispatch_scores_clip_score_with_its_scorer_tiny_random_weights(tiny_clip: tuple[str, str]) -> None:
    from miles.rewards.scorers.clip_score import CLIP_SCORE_SCALE, load_clip_score

    model_dir, processor_dir = tiny_clip
    args = schema_args(
        rm_type=["clip_score"], clip_score_model_path=model_dir, clip_score_processor_path=processor_dir
    )
    images = [noise_image(i) for i in range(3)]
    samples = [Sample(index=i, group_index=0, prompt=f"a photo {i}", image=im) for i, im in enumerate(images)]
    got = asyncio.run(batched_async_rm(args, samples))
    expected = load_clip_score(model_dir, processor_dir, CLIP_SCORE_SCALE).score(images, [s.prompt for s in samples])
    assert got == expected


def test_clip_score_and_jpeg_weighted_in_one_job_tiny_random_weights(tiny_clip: tuple[str, str]) -> None:
    from miles.rewards.dispatch import score_samples
    from miles.rewards.scorers.clip_score import load_clip_score
    from miles.rewards.scorers.jpeg import jpeg_incompressibility

    model_dir, processor_dir = tiny_clip
    args = schema_args(
        reward_weights={"clip_score": 2.0, "jpeg_incompressibility": 0.5},
        clip_score_model_path=model_dir,
        clip_score_processor_path=processor_dir,
        clip_score_scale=100.0,
    )
    images = [noise_image(i) for i in range(2)]
    samples = [Sample(index=i, group_index=0, prompt="a cat", image=im) for i, im in enumerate(images)]
    asyncio.run(score_samples(args, samples))
    clip = load_clip_score(model_dir, processor_dir, 100.0).score(images, ["a cat"] * 2)
    kb = jpeg_incompressibility(images)
    for i, sample in enumerate(samples):
        assert sample.reward_components == {"clip_score": clip[i], "jpeg_incompressibility": kb[i]}
        assert sample.reward == pytest.approx(2.0 * clip[i] + 0.5 * kb[i], abs=1e-12)


def test_a_video_sample_reaches_the_model_frames_first(tiny_clip: tuple[str, str]) -> None:
    from miles.rewards.scorers.clip_score import load_clip_score

    model_dir, processor_dir = tiny_clip
    args = schema_args(
        rm_type=["clip_score"], clip_score_model_path=model_dir, clip_score_processor_path=processor_dir
    )
    video = torch.stack([noise_image(i) for i in range(3)], dim=1)  # [3, F, H, W], a video sample
    (got,) = asyncio.run(batched_async_rm(args, [Sample(index=0, group_index=0, prompt="p", image=video)]))
    frames = load_clip_score(model_dir, processor_dir).score([video.permute(1, 0, 2, 3)], ["p"])
    assert got == frames[0]


@pytest.mark.slow
def test_clip_score_scale_scales_the_dispatched_score_tiny_random_weights(tiny_clip: tuple[str, str]) -> None:
    """--clip-score-scale: the dispatched score is scale x max(cos, 0), so twice the scale gives twice the score,
    as `load_clip_score` with the same scale does."""
    from miles.rewards.scorers.clip_score import load_clip_score

    model_dir, processor_dir = tiny_clip
    prompts = ["the number 1", "a photo of a cat", "the number 4"]  # cosines > 0, < 0, > 0 with the tiny CLIP
    images = [noise_image(i, 48, 40) for i in range(3)]
    samples = [Sample(index=i, group_index=0, prompt=prompts[i], image=im) for i, im in enumerate(images)]
    scores = {}
    for scale in (2.5, 5.0):
        args = schema_args(
            rm_type=["clip_score"],
            clip_score_model_path=model_dir,
            clip_score_processor_path=processor_dir,
            clip_score_scale=scale,
        )
        scores[scale] = asyncio.run(batched_async_rm(args, samples))
        assert scores[scale] == load_clip_score(model_dir, processor_dir, scale).score(images, prompts)
    assert scores[2.5][0] > 0.1 and scores[2.5][1] == 0.0 and scores[2.5][2] > 0.1  # a negative cosine is 0
    assert scores[5.0] == pytest.approx([2 * s for s in scores[2.5]], rel=1e-6)
