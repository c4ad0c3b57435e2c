"""The VLM judge of an edit (`vlm_judge_edit`) against a fake VLM: a real aiohttp server on loopback (in a thread)
playing an OpenAI chat-completions endpoint. It decodes every image of a request, in order, and rates the edit from
their pixels (instruction following from the last image, quality from the first), so the tests check that the
request carries the source(s) then the edited image, the parsing of the two ratings, their combination and the
flags."""

from __future__ import annotations

import asyncio
import base64
import io
import re
import threading

import numpy as np
import pytest
import torch
from aiohttp import web

from miles.config.resolution import schema_args
from miles.core.sample import Sample
from miles.rewards.dispatch import batched_async_rm
from miles.rewards.errors import RewardError
from miles.rewards.scorers.jpeg import image_to_uint8
from miles.rewards.scorers.vlm_judge_edit import (
    DEFAULT_EDIT_PROMPT_TEMPLATE,
    edit_reward,
    load_vlm_edit_judge,
    parse_edit_scores,
)

MODEL = "fake-edit-vlm"
INSTRUCTION_RE = re.compile(r'with the instruction: "(.*)"')


def rating(image: np.ndarray) -> int:
    """1..4 from an image's mean pixel (0-255)."""
    return 1 + round(float(image.mean()) / 255 * 3)


class FakeEditJudge:
    """POST /v1/chat/completions on 127.0.0.1, served from a loop in a daemon thread. Each request's images are
    decoded in order and kept (`requests`); the answer, for images I_1..I_k:
      text holds "RATE"        "Instruction following: 7\\nQuality: 2"   (a custom template's 1-10 scale)
      instruction "mumble"      "Looks edited."
      instruction "too high"    "Instruction following: 5\\nQuality: 2"
      otherwise                 a sentence of reasoning naming both labels, then
                                "**Instruction following:** F\\n**Quality:** Q", F = rating(I_k), Q = rating(I_1)
    """

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.requests: list[tuple[list[np.ndarray], str, dict]] = []
        asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(timeout=30)

    async def _start(self) -> None:
        app = web.Application(client_max_size=64 * 1024**2)
        app.router.add_post("/v1/chat/completions", self._chat)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{self.runner.addresses[0][1]}"

    async def _chat(self, request: web.Request) -> web.Response:
        from PIL import Image

        body = await request.json()
        (message,) = body["messages"]
        images, texts = [], []
        for part in message["content"]:
            if part["type"] == "image_url":
                data = base64.b64decode(part["image_url"]["url"].removeprefix("data:image/png;base64,"))
                images.append(np.asarray(Image.open(io.BytesIO(data)).convert("RGB")))
            else:
                texts.append(part["text"])
        text = "".join(texts)
        self.requests.append((images, text, body))
        match = INSTRUCTION_RE.search(text)
        instruction = match.group(1) if match else ""
        if "RATE" in text:
            answer = "Instruction following: 7\nQuality: 2"
        elif instruction == "mumble":
            answer = "Looks edited."
        elif instruction == "too high":
            answer = "Instruction following: 5\nQuality: 2"
        else:
            answer = (
                "The instruction following looks fine and the quality is decent.\n"
                f"**Instruction following:** {rating(images[-1])}\n**Quality:** {rating(images[0])}"
            )
        return web.json_response({"choices": [{"index": 0, "message": {"role": "assistant", "content": answer}}]})

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(timeout=30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=30)


@pytest.fixture(scope="module")
def server():
    judge = FakeEditJudge()
    yield judge
    judge.close()


@pytest.fixture
def judge(server: FakeEditJudge) -> FakeEditJudge:
    server.requests = []
    return server


def level_image(level: int, seed: int, size: int = 20) -> torch.Tensor:
    """A grey image rated level + 1 (level 0-3), with a little noise so every image is distinct."""
    noise = torch.rand(3, size, size, generator=torch.Generator().manual_seed(seed)) * 0.02
    return (torch.full((3, size, size), level / 3) + noise - 0.01).clamp(0, 1)


def edit(i: int, image: torch.Tensor, sources: list[torch.Tensor], prompt: str = "make the sky red") -> Sample:
    return Sample(index=i, group_index=0, prompt=prompt, image=image, sources=sources)


def judged(judge: FakeEditJudge, samples: list[Sample], **flags) -> list[float]:
    args = schema_args(rm_type=["vlm_judge_edit"], vlm_judge_url=judge.url, vlm_judge_model=MODEL, **flags)
    return asyncio.run(batched_async_rm(args, samples))


def test_the_request_carries_the_source_then_the_edited_image_fake_vlm_server(judge: FakeEditJudge) -> None:
    sources = [level_image(1, 0), level_image(3, 1)]
    edited = [level_image(3, 2), level_image(0, 3)]
    got = judged(judge, [edit(k, edited[k], [sources[k]]) for k in range(2)])
    # F from the edited image, Q from the source: (F, Q) = (4, 2) and (1, 4); w = 0.5, N = 4
    assert got == pytest.approx([0.5 * 3 / 3 + 0.5 * 1 / 3, 0.5 * 0 / 3 + 0.5 * 3 / 3])
    assert len(judge.requests) == 2
    for images, text, body in judge.requests:
        k = 0 if rating(images[-1]) == 4 else 1
        assert len(images) == 2
        assert np.array_equal(images[0], image_to_uint8(sources[k]))  # the source first, losslessly
        assert np.array_equal(images[1], image_to_uint8(edited[k]))  # then the edited image
        assert text == DEFAULT_EDIT_PROMPT_TEMPLATE.replace("{prompt}", "make the sky red").replace("{max_score}", "4")
        assert body["model"] == MODEL and body["temperature"] == 0.0
        parts = body["messages"][0]["content"]
        assert [p["type"] for p in parts] == ["image_url", "image_url", "text"]  # the images, then the text
        assert all(p["image_url"]["url"].startswith("data:image/png;base64,") for p in parts[:2])

    # several condition images: all of them, in the row's order, then the edited image
    judge.requests = []
    reference = level_image(2, 4)
    (reward,) = judged(judge, [edit(0, edited[0], [sources[0], reference])])
    ((images, _, _),) = judge.requests
    assert [rating(im) for im in images] == [2, 3, 4]
    assert np.array_equal(images[1], image_to_uint8(reference))
    assert reward == pytest.approx(0.5 * 3 / 3 + 0.5 * 1 / 3)


def test_edit_answers_are_parsed_leniently_and_checked() -> None:
    assert parse_edit_scores("Instruction following: 3\nQuality: 4", 4) == (3.0, 4.0)
    assert parse_edit_scores("**Instruction Following:** 2\n**Visual quality:** 3.5", 4) == (2.0, 3.5)
    assert parse_edit_scores('{"instruction_following": 4, "quality": 1}', 4) == (4.0, 1.0)
    assert parse_edit_scores("Instruction following (1-4): 2, quality score = 3", 4) == (2.0, 3.0)
    reasoning = "Draft: Instruction following: 1, Quality: 1. On reflection:\nInstruction following: 4\nQuality: 3"
    assert parse_edit_scores(reasoning, 4) == (4.0, 3.0)  # the last verdict counts
    with pytest.raises(ValueError, match=r"no instruction following rating .*'Quality: 3'"):
        parse_edit_scores("Quality: 3", 4)
    with pytest.raises(ValueError, match=r"no quality rating"):
        parse_edit_scores("Instruction following: 3", 4)
    with pytest.raises(ValueError, match=r"quality rating 0 is outside \[1, 4\]"):
        parse_edit_scores("Instruction following: 3\nQuality: 0", 4)
    assert edit_reward(1, 1, 4, 0.5) == 0.0 and edit_reward(4, 4, 4, 0.5) == 1.0
    assert edit_reward(4, 1, 4, 0.25) == pytest.approx(0.75)


def test_unparseable_and_out_of_range_answers_name_the_sample(judge: FakeEditJudge) -> None:
    source, edited = level_image(1, 0), level_image(2, 1)
    with pytest.raises(RewardError, match=r"sample 0 .*no instruction following rating .*'Looks edited\.'"):
        judged(judge, [edit(0, edited, [source], "mumble")])
    with pytest.raises(RewardError, match=r"instruction following rating 5 is outside \[1, 4\]"):
        judged(judge, [edit(0, edited, [source], "too high")])


def test_vlm_judge_edit_template_max_score_and_quality_weight_flags_fake_vlm_server(judge: FakeEditJudge) -> None:
    """--vlm-judge-edit-prompt-template is the request's text ({prompt}, {max_score}); --vlm-judge-edit-max-score the
    scale the answer's ratings are read on (7 and 2 of 10); --vlm-judge-edit-quality-weight the weight of quality.
    As `load_vlm_edit_judge` with the same values scores."""
    template = "Edit: '{prompt}', rate 1-{max_score}. RATE"
    flags = {"vlm_judge_edit_prompt_template": template, "vlm_judge_edit_max_score": 10.0}
    source, edited = level_image(1, 0), level_image(2, 1)
    (got,) = judged(judge, [edit(0, edited, [source])], vlm_judge_edit_quality_weight=0.25, **flags)
    assert got == pytest.approx(0.75 * 6 / 9 + 0.25 * 1 / 9)
    assert judge.requests[0][1] == "Edit: 'make the sky red', rate 1-10. RATE"
    judge.requests = []
    direct = load_vlm_edit_judge(judge.url, MODEL, template, 10.0, 0.25).score_edits([edited], [[source]], ["x"])
    assert direct == [got]
    (even,) = judged(judge, [edit(0, edited, [source])], **flags)  # default weight 0.5
    assert even == pytest.approx(0.5 * 6 / 9 + 0.5 * 1 / 9)
    with pytest.raises(RewardError, match=r"rating 7 is outside \[1, 4\]"):  # the default scale refuses a 7
        judged(judge, [edit(0, edited, [source])], vlm_judge_edit_prompt_template=template)


def test_a_video_is_judged_frame_by_frame_against_the_source_fake_vlm_server(judge: FakeEditJudge) -> None:
    """--vlm-judge-num-frames: each of that many evenly spaced frames is judged against the source, averaged."""
    source = level_image(3, 9)
    video = torch.stack([level_image(k, 10 + k) for k in range(4)], dim=1)  # [3, F, H, W]: frame k rates k + 1
    (got,) = judged(judge, [edit(0, video, [source])], vlm_judge_num_frames=2)
    assert got == pytest.approx(((0.5 * 0 / 3 + 0.5) + (0.5 * 3 / 3 + 0.5)) / 2)  # frames 0 and 3, Q = 4 each
    assert len(judge.requests) == 2
    assert all(np.array_equal(images[0], image_to_uint8(source)) for images, _, _ in judge.requests)
