"""The VLM-judge reward (`scorers.vlm_judge`) against a fake VLM: a real aiohttp server on loopback (in a thread) that
plays the OpenAI chat-completions endpoint of an sglang/vLLM server. It decodes the PNG of each request and answers
from its pixels, so the tests check the request's shape, the PNG round trip, the parsing and normalisation, retries
(after a 500 and a refused connection), the concurrency cap and the errors (unparseable or out-of-range answers,
refused requests)."""

from __future__ import annotations

import asyncio
import base64
import io
import re
import socket
import threading
from collections import Counter

import numpy as np
import pytest
import torch
from aiohttp import web

from miles.config.resolution import schema_args
from miles.core.sample import Sample
from miles.rewards.dispatch import batched_async_rm, score_samples
from miles.rewards.errors import RewardError
from miles.rewards.scorers.jpeg import image_to_uint8
from miles.rewards.scorers.vlm_judge import (
    DEFAULT_PROMPT_TEMPLATE,
    VlmJudge,
    chat_endpoint,
    load_vlm_judge,
    parse_score,
)

MODEL = "fake-vlm"
PROMPT_RE = re.compile(r'generated from the prompt: "(.*)"')


class FakeVlmServer:
    """POST /v1/chat/completions and GET /v1/models on 127.0.0.1, served from a loop in a daemon thread.

    The answer for a request whose prompt is P and whose image has mean pixel m (0-255):
      P starts with "flaky"    the first request for P gets HTTP 500, the next ones an answer
      P == "mumble"            "I would rather not say."
      P == "too high"          "Score: 9"
      P == "bad request"       HTTP 400
      a "RATING" template      "RATING=7"
      otherwise                "The image looks fine.\\n**Score:** N" with N = 1 + round(m / 255 * 4)
    """

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.reset()
        asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(timeout=30)

    def reset(self) -> None:
        self.bodies: list[dict] = []
        self.images: list[np.ndarray] = []
        self.attempts: Counter[str] = Counter()
        self.in_flight = 0
        self.max_in_flight = 0
        self.delay = 0.0

    async def _start(self) -> None:
        app = web.Application(client_max_size=64 * 1024**2)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_get("/v1/models", self._models)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{self.runner.addresses[0][1]}"

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

    async def _chat(self, request: web.Request) -> web.Response:
        from PIL import Image

        body = await request.json()
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            await asyncio.sleep(self.delay)
        finally:
            self.in_flight -= 1
        self.bodies.append(body)
        image_part, text_part = body["messages"][0]["content"]
        url = image_part["image_url"]["url"]
        assert url.startswith("data:image/png;base64,"), url[:40]
        image = np.asarray(Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1]))).convert("RGB"))
        self.images.append(image)
        text = text_part["text"]
        match = PROMPT_RE.search(text)
        prompt = match.group(1) if match else text
        self.attempts[prompt] += 1
        if prompt.startswith("flaky") and self.attempts[prompt] == 1:
            return web.Response(status=500, text="engine overloaded")
        if prompt == "bad request":
            return web.Response(status=400, text="image too large")
        if "RATING" in text:
            answer = "RATING=7"
        elif prompt == "mumble":
            answer = "I would rather not say."
        elif prompt == "too high":
            answer = "Score: 9"
        else:
            answer = f"The image looks fine.\n**Score:** {1 + round(float(image.mean()) / 255 * 4)}"
        return web.json_response(
            {
                "id": "x",
                "object": "chat.completion",
                "choices": [{"index": 0, "message": {"role": "assistant", "content": answer}}],
            }
        )

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(timeout=30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=30)


@pytest.fixture(scope="module")
def fake_vlm():
    server = FakeVlmServer()
    yield server
    server.close()


@pytest.fixture
def vlm(fake_vlm: FakeVlmServer) -> FakeVlmServer:
    fake_vlm.reset()
    return fake_vlm


def level_image(level: int, size: int = 24) -> torch.Tensor:
    """A flat grey image whose judged score is level + 1 (level 0-4), plus a little noise to check the PNG."""
    noise = torch.rand(3, size, size, generator=torch.Generator().manual_seed(level)) * 0.02
    return (torch.full((3, size, size), level / 4) + noise - 0.01).clamp(0, 1)


def test_vlm_judge_fake_vlm_server(vlm: FakeVlmServer):
    images = [level_image(k) for k in range(5)]
    prompts = [f"a photo of a cat {k}" for k in range(5)]
    judge = load_vlm_judge(vlm.url, backoff=0.01)  # no model name: asks /v1/models
    assert judge.device == "cpu"
    scores = judge.score(images, prompts)
    assert scores == pytest.approx([(k + 1) / 5 for k in range(5)])

    # the request: the model from /v1/models, an image_url part holding a PNG of the exact pixels, the template
    assert len(vlm.bodies) == 5
    by_prompt = {PROMPT_RE.search(b["messages"][0]["content"][1]["text"]).group(1): b for b in vlm.bodies}
    body = by_prompt["a photo of a cat 2"]
    assert body["model"] == MODEL and body["temperature"] == 0.0 and body["max_tokens"] == 256
    assert [m["role"] for m in body["messages"]] == ["user"]
    assert [p["type"] for p in body["messages"][0]["content"]] == ["image_url", "text"]
    expected_text = DEFAULT_PROMPT_TEMPLATE.replace("{prompt}", "a photo of a cat 2").replace("{max_score}", "5")
    assert body["messages"][0]["content"][1]["text"] == expected_text
    assert "from 1 to 5" in expected_text and "Score: N" in expected_text
    decoded = {tuple(im.reshape(-1)[:8]): im for im in vlm.images}
    for image in images:
        pixels = image_to_uint8(image)
        assert np.array_equal(decoded[tuple(pixels.reshape(-1)[:8])], pixels)  # lossless round trip

    # numpy input and a video (F, 3, H, W): frames 0 and 3 of 4, averaged
    vlm.reset()
    video = torch.stack([level_image(k) for k in (0, 1, 2, 4)])
    (both,) = VlmJudge(vlm.url, MODEL, num_frames=2).score([video.numpy()], ["a video"])
    assert both == pytest.approx((1 / 5 + 5 / 5) / 2) and len(vlm.bodies) == 2


def test_vlm_judge_retries_after_a_500(vlm: FakeVlmServer):
    judge = VlmJudge(vlm.url, MODEL, backoff=0.01)
    assert judge.score([level_image(3), level_image(1)], ["flaky cat", "steady dog"]) == pytest.approx([0.8, 0.4])
    assert vlm.attempts["flaky cat"] == 2 and vlm.attempts["steady dog"] == 1

    vlm.reset()
    no_retry = VlmJudge(vlm.url, MODEL, max_retries=0)
    with pytest.raises(RuntimeError, match="failed 1 times; last: HTTP 500: engine overloaded"):
        no_retry.score([level_image(0)], ["flaky again"])
    with pytest.raises(RuntimeError, match="refused the request: HTTP 400: image too large"):
        VlmJudge(vlm.url, MODEL, backoff=0.01).score([level_image(0)], ["bad request"])
    assert vlm.attempts["bad request"] == 1  # a 4xx is not retried


def test_vlm_judge_unparseable_and_out_of_range_answers_raise(vlm: FakeVlmServer):
    judge = VlmJudge(vlm.url, MODEL)
    with pytest.raises(ValueError, match=r"no score matching .*: 'I would rather not say\.'"):
        judge.score([level_image(0)], ["mumble"])
    with pytest.raises(ValueError, match=r"score 9 is outside \[0, 5\].*'Score: 9'"):
        judge.score([level_image(0)], ["too high"])
    with pytest.raises(ValueError, match=r"\(1,\d{3} chars\)"):  # a long answer is quoted clipped
        parse_score("blah " * 300, r"Score:\s*(\d+)", 5)


def test_vlm_judge_custom_template_pattern_and_max(vlm: FakeVlmServer):
    judge = VlmJudge(vlm.url, MODEL, "Rate '{prompt}' from 0 to {max_score}. Reply RATING=N", r"RATING=(\d+)", 10)
    assert judge.score([level_image(2)], ["a dog"]) == pytest.approx([0.7])
    assert vlm.bodies[0]["messages"][0]["content"][1]["text"] == "Rate 'a dog' from 0 to 10. Reply RATING=N"
    assert parse_score("score: 4.5 (out of 5)", VlmJudge(vlm.url).pattern, 5) == pytest.approx(0.9)
    assert parse_score("Score:** 3", VlmJudge(vlm.url).pattern, 5) == pytest.approx(0.6)
    assert chat_endpoint("http://h:1") == "http://h:1/v1/chat/completions"
    assert chat_endpoint("http://h:1/v1/") == "http://h:1/v1/chat/completions"
    with pytest.raises(ValueError, match="must start with http"):
        chat_endpoint("h:1")


def test_vlm_judge_caps_concurrency_and_retries_a_refused_connection(vlm: FakeVlmServer):
    vlm.delay = 0.05
    judge = VlmJudge(vlm.url, MODEL, max_concurrency=2)
    assert judge.score([level_image(4)] * 6, ["a cat"] * 6) == pytest.approx([1.0] * 6)
    assert vlm.max_in_flight == 2

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    down = VlmJudge(f"http://127.0.0.1:{port}", MODEL, max_retries=2, backoff=0.01, timeout=5)
    with pytest.raises(RuntimeError, match=r"failed 3 times; last: ClientConnectorError"):
        down.score([level_image(0)], ["a cat"])


def test_vlm_judge_score_from_inside_an_event_loop(vlm: FakeVlmServer):
    judge = VlmJudge(vlm.url, MODEL)

    async def inside() -> list[float]:
        return judge.score([level_image(1)], ["a cat"])  # a running loop here: scored on a helper thread

    assert asyncio.run(inside()) == pytest.approx([0.4])
    assert asyncio.run(judge.ascore([level_image(2)], ["a cat"])) == pytest.approx([0.6])


# ---- the job's flags, through the dispatch ----------------------------------------------------------------------


def judged(vlm: FakeVlmServer, samples: list[Sample], **flags) -> list[float]:
    """The rewards a job with `--rm-type vlm_judge --vlm-judge-url <the fake server>` and `flags` gives `samples`."""
    args = schema_args(rm_type=["vlm_judge"], vlm_judge_url=vlm.url, **flags)
    return asyncio.run(score_samples(args, samples))


def test_vlm_judge_model_template_pattern_and_max_score_flags_fake_vlm_server(vlm: FakeVlmServer):
    """--vlm-judge-model is the request's model; --vlm-judge-prompt-template its text (with {prompt} and
    {max_score}); --vlm-judge-score-pattern parses the answer it asks for ("RATING=7"), which the default pattern
    cannot; --vlm-judge-max-score divides the rating. As `load_vlm_judge` with the same values scores."""
    template = "Judge '{prompt}' from 0 to {max_score}. Reply RATING=N"
    pattern = r"RATING=(\d+)"
    images = [level_image(k) for k in range(3)]
    prompts = [f"a dog {k}" for k in range(3)]
    samples = [Sample(index=k, group_index=0, prompt=prompts[k], image=im) for k, im in enumerate(images)]
    flags = {"vlm_judge_model": "judge-7b", "vlm_judge_prompt_template": template, "vlm_judge_score_pattern": pattern}

    got = judged(vlm, samples, vlm_judge_max_score=10.0, **flags)
    assert got == pytest.approx([0.7] * 3) and [s.reward for s in samples] == got  # RATING=7 / 10
    assert {body["model"] for body in vlm.bodies} == {"judge-7b"}  # not /v1/models' fake-vlm
    texts = sorted(body["messages"][0]["content"][1]["text"] for body in vlm.bodies)
    assert texts == [f"Judge 'a dog {k}' from 0 to 10. Reply RATING=N" for k in range(3)]

    vlm.reset()
    direct = load_vlm_judge(vlm.url, "judge-7b", template, pattern, 10.0).score(images, prompts)
    assert direct == got
    assert sorted(body["messages"][0]["content"][1]["text"] for body in vlm.bodies) == texts

    vlm.reset()
    assert judged(vlm, samples, vlm_judge_max_score=20.0, **flags) == pytest.approx([0.35] * 3)  # 7 / 20
    assert "from 0 to 20." in vlm.bodies[0]["messages"][0]["content"][1]["text"]

    vlm.reset()  # the default pattern (a number after "Score:") finds nothing in "RATING=7"
    default_pattern = {k: v for k, v in flags.items() if k != "vlm_judge_score_pattern"}
    with pytest.raises(RewardError, match=r"no score matching .*'RATING=7'"):
        judged(vlm, samples[:1], vlm_judge_max_score=10.0, **default_pattern)


def test_vlm_judge_num_frames_flag_on_a_video_sample_fake_vlm_server(vlm: FakeVlmServer):
    """--vlm-judge-num-frames: a video sample [3, F, H, W] is judged on that many evenly spaced frames, one request
    each, the ratings averaged; unset, every frame. As `load_vlm_judge` with the same value scores the frames."""
    video = torch.stack([level_image(k) for k in range(5)], dim=1)  # [3, 5, H, W]: frame k is rated k + 1
    sample = Sample(index=0, group_index=0, prompt="a video", image=video)
    for num_frames, expected in ((2, (1 + 5) / 2 / 5), (3, (1 + 3 + 5) / 3 / 5), (None, 3 / 5)):
        vlm.reset()
        (got,) = judged(vlm, [sample], vlm_judge_model=MODEL, vlm_judge_num_frames=num_frames)
        assert got == pytest.approx(expected) and len(vlm.bodies) == (num_frames or 5), num_frames
        vlm.reset()
        (direct,) = load_vlm_judge(vlm.url, MODEL, num_frames=num_frames).score([video.permute(1, 0, 2, 3)], ["x"])
        assert direct == got and len(vlm.bodies) == (num_frames or 5)


def test_vlm_judge_max_concurrency_flag_caps_requests_in_flight_fake_vlm_server(vlm: FakeVlmServer):
    """--vlm-judge-max-concurrency: at most that many requests to the judge in flight at once (each held 50 ms by
    the server), as `load_vlm_judge` with the same value keeps them."""
    samples = [Sample(index=k, group_index=0, prompt="a cat", image=level_image(4)) for k in range(6)]
    for cap in (2, 3):
        vlm.reset()
        vlm.delay = 0.05
        got = asyncio.run(
            batched_async_rm(
                schema_args(
                    rm_type=["vlm_judge"], vlm_judge_url=vlm.url, vlm_judge_model=MODEL, vlm_judge_max_concurrency=cap
                ),
                samples,
            )
        )
        assert got == pytest.approx([1.0] * 6) and vlm.max_in_flight == cap and len(vlm.bodies) == 6
        vlm.reset()
        vlm.delay = 0.05
        direct = load_vlm_judge(vlm.url, MODEL, max_concurrency=cap).score([s.image for s in samples], ["a cat"] * 6)
        assert direct == got and vlm.max_in_flight == cap
