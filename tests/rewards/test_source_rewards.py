"""The rewards that score an edit against its source (`needs` "source" in the reward table): the dispatch hands their
scorers each sample's condition images (`Sample.sources`) and only theirs, refuses a sample without one in one line,
the pools send them to the workers, the service refuses to serve them; and the numbers of `clip_i`,
`clip_directional` (the session's tiny random CLIP) and `dino_i` (a tiny random DINOv2 built here), checked against
the formulas written out by hand."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from reward_helpers import noise_image, normalized, to_uint8

from miles.config.resolution import schema_args
from miles.config.resolve import resolve
from miles.core.errors import ConfigError
from miles.core.sample import Sample
from miles.rewards import REWARD_TYPES
from miles.rewards.dispatch import RewardSettings, batched_async_rm, check_reward_inputs, score_items, score_samples
from miles.rewards.errors import RewardError

SOURCED = ("clip_i", "clip_directional", "dino_i", "vlm_judge_edit", "digit_edit", "digit_i2v")
JOB = {
    "hf_checkpoint": "tiny-flux-kontext",  # a family that edits: the sourced rewards need one
    "prompt_data": "digits-edit:train",
    "rollout_batch_size": 2,
    "n_samples_per_prompt": 2,
    "diffusion_num_sde_steps": 2,
    "actor_num_gpus_per_node": 1,
    "num_gpus_per_node": 1,
}


def edit_sample(i: int, image: torch.Tensor, sources: list[torch.Tensor] | None, **meta: Any) -> Sample:
    return Sample(index=i, group_index=0, prompt=f"make it red {i}", metadata=dict(meta), image=image, sources=sources)


# ---- the table and the dispatch ---------------------------------------------------------------------------------
def test_the_sourced_types_are_rows_of_the_table() -> None:
    assert tuple(name for name, t in REWARD_TYPES.items() if t.sourced) == SOURCED
    assert not any(t.sourced for name, t in REWARD_TYPES.items() if name not in SOURCED)
    assert REWARD_TYPES["digit_edit"].needs == ("source", "label")
    with pytest.raises(ValueError, match=r"metadata\.label"):
        check_reward_inputs("digit_edit", "change the 3 into a 5", {"source_label": 3})
    check_reward_inputs("digit_edit", "change the 3 into a 5", {"label": 5, "source_label": 3})
    check_reward_inputs("clip_i", "anything", {})  # the row's media are the data reader's to check


class Recorder:
    """A stand-in scorer: records each call's keyword arguments and scores 1 + the mean of the first source."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []

    def __call__(
        self, images: Sequence[Any], prompts: Sequence[str], metadata: Sequence[Mapping[str, Any]], **kwargs: Any
    ) -> list[float]:
        self.calls.append(kwargs)
        if "sources" not in kwargs:
            return [0.5] * len(images)
        return [1.0 + float(per[0].mean()) for per in kwargs["sources"]]


def test_the_dispatch_passes_sources_only_to_sourced_types(monkeypatch: pytest.MonkeyPatch) -> None:
    import miles.rewards.dispatch as dispatch

    scorers = {"clip_i": Recorder(), "jpeg_compressibility": Recorder()}
    monkeypatch.setattr(dispatch, "_get_scorer", lambda settings, rm_type: scorers[rm_type])
    args = schema_args(rm_type=["clip_i", "jpeg_compressibility"], clip_score_model_path="/models/clip")
    sources = [[torch.full((3, 8, 8), 0.25)], [torch.full((3, 8, 8), 0.5), torch.zeros(3, 4, 4)]]
    samples = [edit_sample(i, torch.rand(3, 8, 8), sources[i]) for i in range(2)]
    rewards = asyncio.run(score_samples(args, samples))
    assert rewards == pytest.approx([1.25 + 0.5, 1.5 + 0.5])
    assert samples[1].reward_components == {"clip_i": 1.5, "jpeg_compressibility": 0.5}
    (sourced_call,) = scorers["clip_i"].calls
    assert sourced_call["sources"] == sources  # every condition image, in the row's order
    assert scorers["jpeg_compressibility"].calls == [{}]  # the other scorers' call is unchanged


def test_a_sample_without_a_source_is_refused_in_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    import miles.rewards.dispatch as dispatch

    monkeypatch.setattr(dispatch, "_get_scorer", lambda settings, rm_type: Recorder())
    args = schema_args(rm_type=["clip_i"], clip_score_model_path="/models/clip")
    for missing in (None, []):
        samples = [
            edit_sample(0, torch.rand(3, 8, 8), [torch.rand(3, 8, 8)]),
            edit_sample(1, torch.rand(3, 8, 8), missing),
        ]
        with pytest.raises(RewardError) as error:
            asyncio.run(batched_async_rm(args, samples))
        assert str(error.value) == (
            "reward 'clip_i': sample 1 (prompt 'make it red 1') has no source image; clip_i scores an edit against "
            "its source (give the prompt rows media)"
        )
    # a type that reads no source scores the same sample
    plain = asyncio.run(batched_async_rm(schema_args(rm_type=["jpeg_compressibility"]), samples))
    assert len(plain) == 2


def test_score_items_finds_the_failing_item_with_its_own_sources() -> None:
    seen: list[list[Any]] = []

    def scorer(images: Any, prompts: Any, metadata: Any, sources: list[list[Any]]) -> list[float]:
        seen.append(sources)
        if any(per[0] == "bad" for per in sources):
            raise ValueError("cannot read that source")
        return [1.0] * len(images)

    with pytest.raises(RewardError, match=r"reward 'clip_i' failed on b: ValueError: cannot read that source"):
        score_items("clip_i", scorer, [0, 1], ["p", "q"], [{}, {}], ["a", "b"], [["good"], ["bad"]])
    assert seen == [[["good"], ["bad"]], [["good"]], [["bad"]]]


def test_pools_send_each_chunk_its_sources() -> None:
    """`RewardPool._submit` (no Ray: fake workers record the remote call) and `RewardWorker.score`."""
    from miles.rewards.pool import RewardPool, RewardWorker

    class FakeRemote:
        def __init__(self) -> None:
            self.calls: list[tuple[tuple[Any, ...], dict[str, Any]]] = []

        def remote(self, *args: Any, **kwargs: Any) -> str:
            self.calls.append((args, kwargs))
            return "ref"

    class FakeWorker:
        def __init__(self) -> None:
            self.score = FakeRemote()

    def pool(rm_type: str) -> RewardPool:
        p = object.__new__(RewardPool)
        p.rm_type, p.settings, p.num_workers = rm_type, RewardSettings(), 2
        p.workers, p._turn = [FakeWorker(), FakeWorker()], itertools.count()
        return p

    sources = [[torch.full((3, 4, 4), k / 4)] for k in range(3)]
    samples = [edit_sample(k, torch.rand(3, 4, 4), sources[k]) for k in range(3)]
    sourced = pool("clip_i")
    assert len(sourced._submit(samples)) == 2  # chunks of 2 and 1
    (args0, kw0), (args1, kw1) = sourced.workers[0].score.calls[0], sourced.workers[1].score.calls[0]
    assert len(args0[0]) == 2 and len(args1[0]) == 1
    got = kw0["sources"] + kw1["sources"]
    assert all(isinstance(per[0], np.ndarray) for per in got)  # as float32 arrays on the wire
    assert [float(per[0].mean()) for per in got] == [0.0, 0.25, 0.5]
    plain = pool("clip_score")
    plain._submit(samples)
    assert plain.workers[0].score.calls[0][1] == {}  # no sources for a type that reads none
    with pytest.raises(RewardError, match=r"sample 2 .* has no source image"):
        sourced._submit([*samples[:2], edit_sample(2, torch.rand(3, 4, 4), None)])

    worker = object.__new__(RewardWorker)
    worker.rm_type, worker.scorer = "clip_i", Recorder()
    assert worker.score([0], ["p"], [{}], ["a"], [[np.full((3, 2, 2), 0.5)]]) == [1.5]
    worker.scorer = Recorder()
    assert worker.score([0], ["p"], [{}], ["a"]) == [0.5] and worker.scorer.calls == [{}]


def test_the_reward_service_refuses_a_sourced_type() -> None:
    from miles.rewards.service.server import builtin_scorers

    settings = RewardSettings(options=(("clip_score_model_path", "/models/clip"),))
    with pytest.raises(ConfigError, match="cannot serve clip_i: it scores an edit against its source image"):
        builtin_scorers(settings, ["clip_i"])


def test_a_sourced_job_resolves_and_refuses_missing_flags() -> None:
    resolve("rl", cli={**JOB, "rm_type": "digit_edit"})
    resolve("rl", cli={**JOB, "rm_type": "clip_i", "clip_score_model_path": "/models/clip"})
    for rm_type, flag in (
        ("clip_i", "--clip-score-model-path"),
        ("clip_directional", "--clip-score-model-path"),
        ("dino_i", "--dino-model-path"),
        ("vlm_judge_edit", "--vlm-judge-url"),
    ):
        with pytest.raises(ConfigError, match=f"{rm_type} requires {flag}$"):
            resolve("rl", cli={**JOB, "rm_type": rm_type})


def test_the_preflight_names_a_missing_dino_folder(tmp_path: Path) -> None:
    from miles.preflight import find_problems

    missing = tmp_path / "nowhere"
    problems = find_problems(resolve("rl", cli={**JOB, "rm_type": "dino_i", "dino_model_path": str(missing)}))
    assert any(line.startswith(f"--dino-model-path {missing}: no such folder") for line in problems), problems


@pytest.mark.parametrize(
    ("flag", "value"),
    [
        ("--source-reward-num-frames", 0),
        ("--vlm-judge-edit-max-score", 1.5),
        ("--vlm-judge-edit-quality-weight", -0.1),
    ],
)
def test_source_reward_flags_below_their_minimum_are_refused(flag: str, value: float) -> None:
    dest = flag.removeprefix("--").replace("-", "_")
    cli = {**JOB, "rm_type": "vlm_judge_edit", "vlm_judge_url": "http://127.0.0.1:9", dest: value}
    with pytest.raises(ConfigError, match=f"{flag}: {value} is below the minimum"):
        resolve("rl", cli=cli)


def test_the_quality_weight_above_one_is_refused() -> None:
    cli = {**JOB, "rm_type": "vlm_judge_edit", "vlm_judge_url": "http://127.0.0.1:9"}
    with pytest.raises(ConfigError, match=r"--vlm-judge-edit-quality-weight: 1\.5 is above the maximum"):
        resolve("rl", cli={**cli, "vlm_judge_edit_quality_weight": 1.5})


# ---- clip_i and clip_directional on the session's tiny random CLIP ----------------------------------------------
def hand_clip(model_dir: str, processor_dir: str, images: list[torch.Tensor], texts: list[str]):
    """(unit image embeddings, unit text embeddings), the projections written out."""
    from PIL import Image
    from transformers import CLIPModel, CLIPProcessor

    model = CLIPModel.from_pretrained(model_dir).eval()
    processor = CLIPProcessor.from_pretrained(processor_dir)
    pixels = processor.image_processor(
        images=[Image.fromarray(to_uint8(im)) for im in images], return_tensors="pt"
    ).pixel_values
    tokens = processor.tokenizer(texts, padding="max_length", truncation=True, max_length=77, return_tensors="pt")
    with torch.no_grad():
        v = model.vision_model(pixel_values=pixels).pooler_output @ model.visual_projection.weight.T
        t = model.text_model(**tokens).pooler_output @ model.text_projection.weight.T
    return normalized(v), normalized(t)


def clip_args(tiny_clip: tuple[str, str], rm_type: str, **flags: Any):
    model_dir, processor_dir = tiny_clip
    return schema_args(
        rm_type=[rm_type], clip_score_model_path=model_dir, clip_score_processor_path=processor_dir, **flags
    )


def test_clip_i_is_the_image_cosine_and_one_for_the_source_itself(tiny_clip: tuple[str, str]) -> None:
    source = noise_image(0, 40, 48)
    edited = [source.clone(), noise_image(1, 40, 48), noise_image(2, 32, 32)]
    samples = [edit_sample(i, im, [source]) for i, im in enumerate(edited)]
    got = asyncio.run(batched_async_rm(clip_args(tiny_clip, "clip_i"), samples))
    emb, _ = hand_clip(*tiny_clip, [source, *edited], ["x"])
    expected = (emb[1:] * emb[0]).sum(-1)
    assert got == pytest.approx(expected.tolist(), abs=1e-5)
    assert got[0] == pytest.approx(1.0, abs=1e-5) and got[1] < 0.9999


def test_clip_directional_is_the_cosine_of_the_two_steps_and_flips_with_the_captions(
    tiny_clip: tuple[str, str],
) -> None:
    source, edited = noise_image(6), noise_image(7)  # a directional cosine of about 0.47
    captions = {"source_caption": "a photo of a cat", "target_caption": "the number 4"}
    swapped = {"source_caption": "the number 4", "target_caption": "a photo of a cat"}
    samples = [
        edit_sample(0, edited, [source], **captions),
        edit_sample(1, edited, [source], **swapped),
        edit_sample(2, source.clone(), [source], **captions),  # no edit: no image direction
        edit_sample(3, edited, [source]),  # no captions: "" -> the instruction
        edit_sample(4, edited, [source], source_caption="", target_caption="make it red 3"),  # sample 3's prompt
    ]
    got = asyncio.run(batched_async_rm(clip_args(tiny_clip, "clip_directional"), samples))
    images, texts = hand_clip(*tiny_clip, [source, edited], ["a photo of a cat", "the number 4"])
    step_i, step_t = images[1] - images[0], texts[1] - texts[0]
    expected = float((step_i * step_t).sum() / (step_i.norm() * step_t.norm()))
    assert abs(expected) > 0.3
    assert got[0] == pytest.approx(expected, abs=1e-5)
    assert got[1] == pytest.approx(-got[0], abs=1e-6)
    assert got[2] == 0.0
    assert got[3] == pytest.approx(got[4], abs=1e-5)
    with pytest.raises(RewardError, match=r"metadata\.target_caption must be a string"):
        asyncio.run(
            batched_async_rm(
                clip_args(tiny_clip, "clip_directional"), [edit_sample(0, edited, [source], target_caption=3)]
            )
        )


def test_source_reward_num_frames_scores_video_frames_against_the_source(tiny_clip: tuple[str, str]) -> None:
    """--source-reward-num-frames: a video sample [3, F, H, W] is scored on that many evenly spaced frames, each
    against the source, averaged; unset, every frame."""
    source = noise_image(10)
    frames = [source.clone(), noise_image(11), noise_image(12), noise_image(13)]
    video = torch.stack(frames, dim=1)
    emb, _ = hand_clip(*tiny_clip, [source, *frames], ["x"])
    per_frame = (emb[1:] * emb[0]).sum(-1)
    for num_frames, expected in ((2, (per_frame[0] + per_frame[3]) / 2), (None, per_frame.mean())):
        args = clip_args(tiny_clip, "clip_i", source_reward_num_frames=num_frames)
        (got,) = asyncio.run(batched_async_rm(args, [edit_sample(0, video, [source])]))
        assert got == pytest.approx(float(expected), abs=1e-5), num_frames


# ---- dino_i on a tiny random DINOv2 -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_dino(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny random `Dinov2Model` and its image processor (resize 32, crop 28, ImageNet mean/std), saved."""
    from transformers import BitImageProcessorPil, Dinov2Config, Dinov2Model

    folder = tmp_path_factory.mktemp("tiny_dino")
    BitImageProcessorPil(
        size={"shortest_edge": 32},
        crop_size={"height": 28, "width": 28},
        image_mean=[0.485, 0.456, 0.406],
        image_std=[0.229, 0.224, 0.225],
    ).save_pretrained(folder)
    config = Dinov2Config(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, image_size=28, patch_size=14
    )
    torch.manual_seed(0)
    Dinov2Model(config).save_pretrained(folder)
    return str(folder)


def test_dino_i_is_the_cosine_of_the_last_layers_cls_tokens(tiny_dino: str) -> None:
    """--dino-model-path: the dispatch loads the folder's model and processor; the score is the cosine of the CLS
    tokens of the last layer after the final layer norm, 1 for the source itself."""
    from PIL import Image
    from transformers import AutoImageProcessor, Dinov2Model

    source = noise_image(20, 40, 40)
    edited = [source.clone(), noise_image(21, 40, 40), noise_image(22, 48, 36)]
    samples = [edit_sample(i, im, [source]) for i, im in enumerate(edited)]
    got = asyncio.run(batched_async_rm(schema_args(rm_type=["dino_i"], dino_model_path=tiny_dino), samples))

    model = Dinov2Model.from_pretrained(tiny_dino).eval()
    pixels = AutoImageProcessor.from_pretrained(tiny_dino)(
        images=[Image.fromarray(to_uint8(im)) for im in [source, *edited]], return_tensors="pt"
    ).pixel_values
    assert pixels.shape[-2:] == (28, 28)
    with torch.no_grad():
        last = model(pixel_values=pixels, output_hidden_states=True).hidden_states[-1]
        cls = normalized(model.layernorm(last)[:, 0])
    expected = (cls[1:] * cls[0]).sum(-1)
    assert got == pytest.approx(expected.tolist(), abs=1e-5)
    assert got[0] == pytest.approx(1.0, abs=1e-5) and max(got[1:]) < 0.9999
