"""A VLM judge reward: a vision-language model behind an OpenAI-compatible chat-completions server (the user's sglang
or vLLM server) rates each image, and the rating is normalised.

    score = N / max_score,   N = the first capture of `score_pattern` in the judge's answer

For each (image, prompt) the judge gets one POST `{url}/v1/chat/completions` with a user message of two content
parts, the image as `{"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}` (the uint8 RGB frame,
PNG, lossless) and the text of `prompt_template` with `{prompt}` replaced by the sample's prompt and `{max_score}` by
`max_score` (plain replacement, so other braces in a template are left alone). The default template asks for a 1-5
rating of prompt faithfulness and visual quality answered as `Score: N`; the default pattern takes the first number
after "Score:" (any case, markdown bold allowed). A VLM-as-judge reward in the style of flow_grpo's `unifiedreward` /
`qwenvl` rewards, which query MLLM servers the same way.

Temperature 0 and `max_tokens` (default 256) keep the answers short and repeatable. The request is retried, with
exponential backoff (`backoff * 2**k` seconds), after a connection error, a timeout, HTTP 429 or any 5xx, up to
`max_retries` times; another HTTP error fails at once, quoting the body (clipped). At most `max_concurrency` requests
are in flight per `score` call. An answer with no match, or a score outside [0, max_score], raises ValueError quoting
the answer (clipped): a misconfigured template or pattern fails loudly instead of training on a constant.

`model` None asks the server (`GET {url}/v1/models`) and uses its first model id. A video sample, (F, 3, H, W), is
judged on `num_frames` uniformly spaced frames (all when None), one request each, and the scores are averaged.
Torch-free: aiohttp and PIL only.
"""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import functools
import io
import json
import re
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from miles.rewards.scorers._model import model_scorer
from miles.rewards.scorers.clip_score import sample_frames
from miles.utils.text import clip

if TYPE_CHECKING:
    from miles.rewards.dispatch import RewardSettings, Scorer

DEFAULT_PROMPT_TEMPLATE = (
    "You are an expert judge of AI-generated images.\n"
    'The image was generated from the prompt: "{prompt}"\n'
    "Rate the image on a scale from 1 to {max_score}, considering both how faithfully it matches the prompt "
    "(objects, counts, attributes, spatial relations, any requested text) and its visual quality (sharpness, "
    "artifacts, anatomy, composition). 1 means unrelated or broken; {max_score} means faithful and high quality.\n"
    "Answer with a single line of the form: Score: N"
)
DEFAULT_SCORE_PATTERN = r"(?i)score\s*:\s*\**\s*(\d+(?:\.\d+)?)"
DEFAULT_MAX_SCORE = 5.0
RETRY_STATUSES = frozenset({408, 429})  # and every 5xx
ANSWER_QUOTE = 200  # characters of an answer an error message quotes


def chat_endpoint(url: str) -> str:
    """`{url}/v1/chat/completions`; a url already ending in /v1 or /v1/chat/completions is used as it is."""
    base = str(url).strip().rstrip("/")
    if not re.match(r"https?://", base):
        raise ValueError(f"the VLM judge url must start with http:// or https://, got {clip(base)!r}")
    if base.endswith("/chat/completions"):
        return base
    if base.endswith("/v1"):
        return base + "/chat/completions"
    return base + "/v1/chat/completions"


def format_max_score(max_score: float) -> str:
    return str(int(max_score)) if float(max_score).is_integer() else str(max_score)


def render_prompt(template: str, prompt: str, max_score: float) -> str:
    return template.replace("{prompt}", prompt).replace("{max_score}", format_max_score(max_score))


def png_data_url(frame: np.ndarray) -> str:
    """An (H, W, 3) uint8 frame as a `data:image/png;base64,...` url."""
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(frame).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


def parse_score(answer: str, pattern: str | re.Pattern[str], max_score: float) -> float:
    """The judge's answer -> score / max_score in [0, 1]; ValueError (quoting the answer) when the pattern does not
    match, the match is not a number, or the number is outside [0, max_score]."""
    regex = re.compile(pattern) if isinstance(pattern, str) else pattern
    match = regex.search(answer)
    quoted = clip(answer.strip(), ANSWER_QUOTE)
    if match is None:
        raise ValueError(f"the VLM judge's answer has no score matching {regex.pattern!r}: {quoted!r}")
    text = match.group(1) if regex.groups else match.group(0)
    try:
        value = float(text)
    except (TypeError, ValueError):
        raise ValueError(f"the VLM judge's score {text!r} is not a number; answer: {quoted!r}") from None
    if not 0.0 <= value <= max_score:
        raise ValueError(
            f"the VLM judge's score {value:g} is outside [0, {format_max_score(max_score)}] (--vlm-judge-max-score); "
            f"answer: {quoted!r}"
        )
    return value / max_score


def answer_text(reply: Any) -> str:
    """The assistant message's text of a chat-completions reply (a string, or the text parts of a list)."""
    try:
        content = reply["choices"][0]["message"]["content"]
    except (KeyError, IndexError, TypeError):
        content = None
    if isinstance(content, list):
        content = "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    if not isinstance(content, str):
        raise ValueError(f"the VLM judge's reply has no message content: {clip(json.dumps(reply), ANSWER_QUOTE)}")
    return content


class VlmJudge:
    """A chat-completions VLM judge. `score` is synchronous (it runs its own event loop); `ascore` is the
    coroutine. Thread-safe: each call has its own HTTP session."""

    def __init__(
        self,
        url: str,
        model: str | None = None,
        prompt_template: str = DEFAULT_PROMPT_TEMPLATE,
        score_pattern: str = DEFAULT_SCORE_PATTERN,
        max_score: float = DEFAULT_MAX_SCORE,
        *,
        timeout: float = 120.0,
        max_retries: int = 3,
        backoff: float = 1.0,
        max_concurrency: int = 8,
        max_tokens: int = 256,
        temperature: float = 0.0,
        num_frames: int | None = None,
        api_key: str | None = None,
    ) -> None:
        if not float(max_score) > 0:
            raise ValueError(f"max_score must be positive, got {max_score}")
        if int(max_retries) < 0 or int(max_concurrency) < 1 or float(timeout) <= 0 or float(backoff) < 0:
            raise ValueError(
                f"need max_retries >= 0, max_concurrency >= 1, timeout > 0 and backoff >= 0; got {max_retries}, "
                f"{max_concurrency}, {timeout}, {backoff}"
            )
        if num_frames is not None and int(num_frames) < 1:
            raise ValueError(f"num_frames must be at least 1 (None judges every frame), got {num_frames}")
        self.device = "cpu"  # the judge runs elsewhere; this process only encodes PNGs and waits on HTTP
        self.endpoint = chat_endpoint(url)
        self.models_endpoint = self.endpoint.removesuffix("/chat/completions") + "/models"
        self.model = model
        self.prompt_template = str(prompt_template)
        self.pattern = re.compile(score_pattern)
        self.max_score = float(max_score)
        self.timeout = float(timeout)
        self.max_retries = int(max_retries)
        self.backoff = float(backoff)
        self.max_concurrency = int(max_concurrency)
        self.max_tokens = int(max_tokens)
        self.temperature = float(temperature)
        self.num_frames = None if num_frames is None else int(num_frames)
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    # ---- HTTP ----
    async def _request(self, session: Any, semaphore: asyncio.Semaphore, method: str, url: str, body: Any) -> Any:
        """One JSON request with retries; -> the decoded JSON reply."""
        import aiohttp

        last = ""
        for attempt in range(self.max_retries + 1):
            if attempt:
                await asyncio.sleep(self.backoff * 2 ** (attempt - 1))
            try:
                async with semaphore, session.request(method, url, json=body, headers=self.headers) as response:
                    text = await response.text()
                    status = response.status
            except (TimeoutError, aiohttp.ClientError) as exc:
                last = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
                continue
            if status == 200:
                try:
                    return json.loads(text)
                except json.JSONDecodeError:
                    raise ValueError(f"the VLM judge at {url} replied with non-JSON: {clip(text)!r}") from None
            if status in RETRY_STATUSES or status >= 500:
                last = f"HTTP {status}: {clip(text)}"
                continue
            raise RuntimeError(f"the VLM judge at {url} refused the request: HTTP {status}: {clip(text)}")
        raise RuntimeError(f"the VLM judge at {url} failed {self.max_retries + 1} times; last: {last}")

    async def _model_name(self, session: Any, semaphore: asyncio.Semaphore) -> str:
        if self.model is None:
            reply = await self._request(session, semaphore, "GET", self.models_endpoint, None)
            try:
                self.model = str(reply["data"][0]["id"])
            except (KeyError, IndexError, TypeError):
                raise ValueError(
                    f"no model id in {self.models_endpoint}'s reply ({clip(json.dumps(reply))}); set the model name"
                ) from None
        return self.model

    async def _judge(self, session: Any, semaphore: asyncio.Semaphore, frame: np.ndarray, prompt: str) -> float:
        body = {
            "model": await self._model_name(session, semaphore),
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "image_url", "image_url": {"url": png_data_url(frame)}},
                        {"type": "text", "text": render_prompt(self.prompt_template, prompt, self.max_score)},
                    ],
                }
            ],
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
        }
        reply = await self._request(session, semaphore, "POST", self.endpoint, body)
        return parse_score(answer_text(reply), self.pattern, self.max_score)

    async def _judge_all(self, judge: Callable[..., Awaitable[float]], jobs: Sequence[tuple[Any, ...]]) -> list[float]:
        """`judge(session, semaphore, *job)` for every job, concurrently on one HTTP session (at most
        `max_concurrency` in flight); the first failure cancels the rest and is raised."""
        import aiohttp

        semaphore = asyncio.Semaphore(self.max_concurrency)
        timeout = aiohttp.ClientTimeout(total=self.timeout)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            await self._model_name(session, semaphore)
            tasks = [asyncio.ensure_future(judge(session, semaphore, *job)) for job in jobs]
            try:
                return list(await asyncio.gather(*tasks))
            except BaseException:
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                raise

    # ---- scoring ----
    async def ascore(self, images: Sequence[Any], prompts: Sequence[str]) -> list[float]:
        if len(images) != len(prompts):
            raise ValueError(f"{len(images)} images but {len(prompts)} prompts")
        frames = [sample_frames(image, self.num_frames) for image in images]
        jobs = [
            (frame, str(prompt)) for per_sample, prompt in zip(frames, prompts, strict=True) for frame in per_sample
        ]
        return frame_means(await self._judge_all(self._judge, jobs), [len(f) for f in frames])

    def score(self, images: Sequence[Any], prompts: Sequence[str]) -> list[float]:
        return run_coroutine(self.ascore(images, prompts))


def frame_means(flat: Sequence[float], counts: Sequence[int]) -> list[float]:
    """The mean of each sample's consecutive run of `counts[i]` values."""
    scores: list[float] = []
    start = 0
    for count in counts:
        scores.append(float(np.mean(flat[start : start + count])))
        start += count
    return scores


def run_coroutine(coro: Coroutine[Any, Any, list[float]]) -> list[float]:
    """Run `coro` to completion from synchronous code: on a fresh loop, or, when called from inside an event loop
    (not the reward pool's case), on a fresh loop in a helper thread."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()


@functools.lru_cache(maxsize=4)
def load_vlm_judge(
    url: str,
    model: str | None = None,
    prompt_template: str = DEFAULT_PROMPT_TEMPLATE,
    score_pattern: str = DEFAULT_SCORE_PATTERN,
    max_score: float = DEFAULT_MAX_SCORE,
    num_frames: int | None = None,
    timeout: float = 120.0,
    max_retries: int = 3,
    max_concurrency: int = 8,
    backoff: float = 1.0,
) -> VlmJudge:
    """A process-wide VLM judge per settings."""
    return VlmJudge(
        url,
        model,
        prompt_template,
        score_pattern,
        float(max_score),
        timeout=timeout,
        max_retries=max_retries,
        backoff=backoff,
        max_concurrency=max_concurrency,
        num_frames=num_frames,
    )


def build(settings: RewardSettings) -> Scorer:
    """`--rm-type vlm_judge`."""
    judge = load_vlm_judge(
        settings.get("vlm_judge_url"),
        settings.get("vlm_judge_model"),
        settings.get("vlm_judge_prompt_template", DEFAULT_PROMPT_TEMPLATE),
        settings.get("vlm_judge_score_pattern", DEFAULT_SCORE_PATTERN),
        float(settings.get("vlm_judge_max_score", DEFAULT_MAX_SCORE)),
        settings.get("vlm_judge_num_frames"),
        max_concurrency=int(settings.get("vlm_judge_max_concurrency", 8)),
    )
    return model_scorer(judge)
