"""The reward service (`miles.rewards.service`): the wire format, a real server on loopback (in a thread,
or in a subprocess where a test kills it) and the client's batching, retries and fault tolerance.

Remote rewards are compared with in-process `score_items` results for exact (bit-identical) equality."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import pickle
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import aiohttp
import msgpack
import numpy as np
import pytest
from aiohttp import web
from reward_service_helpers import (
    ROOT,
    CountingScorer,
    ServiceProcess,
    ServiceThread,
    free_port,
    grid_images,
    mean_pixel,
)

from miles.core.errors import ConfigError
from miles.rewards.dispatch import RewardError, RewardSettings, build_scorer, score_items
from miles.rewards.service.client import RemoteRewardClient
from miles.rewards.service.protocol import (
    JSON,
    MSGPACK,
    PROTOCOL_VERSION,
    ProtocolError,
    decode_request,
    encode_request,
    encode_response,
)
from miles.rewards.service.server import BATCHERS, builtin_scorers, make_app, serve


# ---- helpers -----------------------------------------------------------------------------------
def names_of(n: int) -> list[str]:
    return [f"sample {i} (prompt 'p{i}')" for i in range(n)]


def in_process(name: str, scorer, images, prompts=None, metadata=None) -> list[float]:
    n = len(images)
    prompts = prompts or [f"p{i}" for i in range(n)]
    metadata = metadata or [{} for _ in range(n)]
    return score_items(name, scorer, images, prompts, metadata, names_of(n))


def remote(client: RemoteRewardClient, images, prompts=None, metadata=None, names=None) -> list[float]:
    """`client.score` in a fresh event loop (its session closed after)."""
    n = len(images)
    prompts = prompts or [f"p{i}" for i in range(n)]
    metadata = metadata or [{} for _ in range(n)]

    async def run() -> list[float]:
        try:
            return await client.score(images, prompts, metadata, names)
        finally:
            await client.aclose()

    return asyncio.run(run())


def bits(values: list[float]) -> list[str]:
    return [float(v).hex() for v in values]


@pytest.fixture
def service():
    """Start `make_app(scorers, **kw)` in a thread: `service(scorers, **kw) -> ServiceThread`."""
    started: list[ServiceThread] = []

    def start(scorers, **kwargs) -> ServiceThread:
        svc = ServiceThread(make_app(scorers, **kwargs))
        started.append(svc)
        return svc

    yield start
    for svc in started:
        svc.close()


async def good_health(request: web.Request) -> web.Response:
    return web.json_response(
        {"status": "ok", "version": PROTOCOL_VERSION, "miles_version": "test", "rewards": ["mean_pixel"]}
    )


def fake_service(handlers: dict[str, object]) -> ServiceThread:
    app = web.Application()
    for path, handler in handlers.items():
        app.router.add_route("*", path, handler)
    return ServiceThread(app)


# ---- the wire format ---------------------------------------------------------------------------
def test_protocol_round_trip_keeps_pixels_and_layout() -> None:
    from PIL import Image

    rng = np.random.default_rng(1)
    u8 = rng.integers(0, 256, (3, 6, 5), dtype=np.uint8)
    video_u8 = rng.integers(0, 256, (3, 4, 6, 5), dtype=np.uint8)
    off_grid = rng.random((3, 6, 5), dtype=np.float32)
    images = [
        u8.astype(np.float32) / 255,  # float on the grid: comes back bit-identical
        u8,  # uint8: comes back uint8
        Image.fromarray(u8.transpose(1, 2, 0)),  # PIL: uint8, channels first
        u8.transpose(1, 2, 0).astype(np.float32) / 255,  # HWC float: channels first
        off_grid,  # quantised as image_to_uint8 does
        video_u8.astype(np.float32) / 255,  # a video [3, F, H, W]
        video_u8,
        u8[:1],  # one channel: repeated to RGB
    ]
    grid = u8.astype(np.float32) / 255
    expected = [
        grid,
        u8,
        u8,
        grid,
        np.clip(np.round(off_grid * 255), 0, 255).astype(np.uint8).astype(np.float32) / 255,
        video_u8.astype(np.float32) / 255,
        video_u8,
        np.repeat(u8[:1], 3, axis=0),
    ]
    meta = [{"label": np.int64(3), "tags": ("a", 1)}] + [{} for _ in images[1:]]
    for fmt in (MSGPACK, JSON):
        body = encode_request("r", images, [f"p{i}" for i in range(8)], meta, names_of(8), fmt)
        request = decode_request(body, fmt + "; charset=utf-8")
        assert request.reward == "r" and request.version == PROTOCOL_VERSION
        assert [it.prompt for it in request.items] == [f"p{i}" for i in range(8)]
        assert [it.name for it in request.items] == names_of(8)
        assert request.items[0].metadata == {"label": 3, "tags": ["a", 1]}
        for item, want in zip(request.items, expected, strict=True):
            assert item.image.dtype == want.dtype and item.image.shape == want.shape
            assert item.image.tobytes() == want.tobytes()
    wire = msgpack.unpackb(encode_request("r", images[5:6], ["p"], [{}]))["items"][0]
    assert wire["frames"] == 4 and len(wire["image"]) == 4 and wire["dtype"] == "float32"
    assert Image.open(io.BytesIO(wire["image"][0])).format == "PNG"


def test_protocol_refuses_pickle_ext_types_and_bad_bodies() -> None:
    def status(body: bytes, content_type: str) -> tuple[int, str]:
        with pytest.raises(ProtocolError) as info:
            decode_request(body, content_type)
        assert "\n" not in str(info.value)
        return info.value.status, str(info.value)

    pickled = pickle.dumps({"version": 1, "reward": "r", "items": []})
    assert status(pickled, "application/python-pickle")[0] == 415
    assert status(pickled, "application/octet-stream")[0] == 415
    assert "0x80" in status(pickled, "application/octet-stream")[1]
    assert status(pickled, "")[0] == 415
    assert status(b"{}", "text/plain")[0] == 415
    ext = msgpack.packb({"version": 1, "reward": "r", "items": [msgpack.ExtType(3, b"x")]})
    assert status(ext, MSGPACK) == (415, "msgpack extension types are refused (found ext type 3)")
    stamp = msgpack.packb({"version": 1, "reward": "r", "items": [], "at": msgpack.Timestamp(1, 0)})
    assert status(stamp, MSGPACK)[0] == 415
    assert status(msgpack.packb({"version": 99, "reward": "r", "items": []}), MSGPACK)[0] == 400
    assert status(b"\x81\xc1", MSGPACK)[0] == 400  # not msgpack
    item = {"image": b"not a png", "frames": 0, "prompt": "p", "metadata": {}}
    code, message = status(msgpack.packb({"version": 1, "reward": "r", "items": [item]}), MSGPACK)
    assert (code, message) == (400, "item 0 is not a PNG")
    png = msgpack.unpackb(encode_request("r", grid_images(1), ["p"], [{}]))["items"][0]["image"]
    video = {"image": [png, png], "frames": 3, "prompt": "p"}
    code, message = status(msgpack.packb({"version": 1, "reward": "r", "items": [video]}), MSGPACK)
    assert code == 400 and "frames is 3" in message
    as_json = json.dumps({"version": 1, "reward": "r", "items": [{"image": "%%%", "frames": 0}]}).encode()
    assert status(as_json, JSON)[0] == 400
    ok = json.dumps({"version": 1, "reward": "r", "items": [{"image": base64.b64encode(png).decode()}]})
    assert decode_request(ok.encode(), JSON).items[0].image.shape == (3, 16, 16)


# ---- a real server -----------------------------------------------------------------------------
def test_pickle_body_is_refused_with_415(service) -> None:
    svc = service({"mean_pixel": mean_pixel})

    async def post(body: bytes, content_type: str) -> tuple[int, str]:
        url, headers = f"{svc.url}/score", {"Content-Type": content_type}
        async with aiohttp.ClientSession() as session, session.post(url, data=body, headers=headers) as r:
            return r.status, (await r.json())["error"]

    pickled = pickle.dumps({"version": 1, "reward": "mean_pixel", "items": []})
    for content_type in ("application/python-pickle", "application/octet-stream"):
        code, error = asyncio.run(post(pickled, content_type))
        assert code == 415 and "pickle" in error and "\n" not in error
    code, error = asyncio.run(post(msgpack.packb({"version": 1, "items": [msgpack.ExtType(1, b"")]}), MSGPACK))
    assert code == 415 and "extension types are refused" in error
    assert svc.app[BATCHERS]["mean_pixel"].calls == 0


@pytest.mark.parametrize("wire", [MSGPACK, JSON])
def test_remote_equals_in_process_for_a_pure_scorer(service, wire: str) -> None:
    svc = service({"mean_pixel": mean_pixel})
    rng = np.random.default_rng(2)
    images = [
        *grid_images(9),
        rng.integers(0, 256, (3, 16, 16), dtype=np.uint8),  # uint8 arrives as uint8
        rng.integers(0, 256, (3, 5, 16, 16), dtype=np.uint8).astype(np.float32) / 255,  # a video
    ]
    client = RemoteRewardClient(svc.url, "mean_pixel", batch_size=4, wire=wire)
    got = remote(client, images)
    assert bits(got) == bits(in_process("mean_pixel", mean_pixel, images))
    assert client.requests_sent == 3


@pytest.mark.slow
def test_remote_equals_in_process_for_jpeg_compressibility(service) -> None:
    """The built-in quantises its input itself, so even float images off the uint8 grid score bit-identically."""
    import torch

    settings = RewardSettings()
    svc = service(builtin_scorers(settings, ["jpeg_compressibility"]))
    rng = np.random.default_rng(3)
    images = [rng.random((3, 32, 32), dtype=np.float32) for _ in range(5)]
    images += [torch.rand(3, 24, 40, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    images += [rng.integers(0, 256, (3, 32, 32), dtype=np.uint8)]
    scorer = build_scorer(settings, "jpeg_compressibility")
    client = RemoteRewardClient(svc.url, "jpeg_compressibility", batch_size=4)
    assert bits(remote(client, images)) == bits(in_process("jpeg_compressibility", scorer, images))


@pytest.mark.slow
def test_digit_reward_is_bit_identical_remotely_for_float_images(service, tmp_path: Path) -> None:
    """The digit reward reads every image on the 8-bit grid (`scorers.digit.on_8_bits`), so a float image off the grid,
    quantised to a PNG on the wire, scores bit-identically remotely; uint8 images too."""
    from miles.data.digits import load_digits_split
    from miles.models.digit_classifier import CLASSIFIER_DIRNAME, fit_digit_classifier, save_digit_classifier

    save_digit_classifier(*fit_digit_classifier(), tmp_path / CLASSIFIER_DIRNAME)
    settings = RewardSettings(hf_checkpoint=str(tmp_path))
    svc = service(builtin_scorers(settings, ["digit"]))
    scorer = build_scorer(settings, "digit")
    split = load_digits_split(0)
    rng = np.random.default_rng(4)
    floats = []
    for x8 in split.test_x[:12]:
        img = np.kron(x8, np.ones((8, 8), dtype=np.float32))  # 64x64, as the tiny models draw digits
        img = np.clip(img + rng.normal(0, 0.05, img.shape).astype(np.float32), 0, 1)
        floats.append(np.repeat(img[None], 3, axis=0))
    metadata = [{"label": int(y)} for y in split.test_y[:12]]
    uint8 = [np.round(f * 255).astype(np.uint8) for f in floats]
    client = RemoteRewardClient(svc.url, "digit", batch_size=5)
    for images in (floats, uint8):
        assert bits(remote(client, images, metadata=metadata)) == bits(
            in_process("digit", scorer, images, metadata=metadata)
        )
    assert bits(in_process("digit", scorer, floats, metadata=metadata)) == bits(
        in_process("digit", scorer, uint8, metadata=metadata)
    )


def test_health_check_and_mismatches(service) -> None:
    svc = service({"mean_pixel": mean_pixel, "other": mean_pixel})
    health = RemoteRewardClient(svc.url, "mean_pixel").check_sync()
    assert health["status"] == "ok" and health["version"] == PROTOCOL_VERSION
    assert health["rewards"] == ["mean_pixel", "other"] and health["miles_version"]

    with pytest.raises(ConfigError) as info:
        RemoteRewardClient(svc.url, "digit").check_sync()
    message = str(info.value)
    assert svc.url in message and "mean_pixel, other" in message and f"version {PROTOCOL_VERSION}" in message

    with pytest.raises(ConfigError, match="does not serve reward 'digit'"):  # the first score() checks too
        remote(RemoteRewardClient(svc.url, "digit"), grid_images(1))

    async def served() -> list[str]:
        probe = RemoteRewardClient(svc.url, "")
        try:
            return await probe.served()
        finally:
            await probe.aclose()

    assert asyncio.run(served()) == ["mean_pixel", "other"]

    async def old_health(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "version": 99, "miles_version": "9.9", "rewards": ["mean_pixel"]})

    async def not_found(request: web.Request) -> web.Response:
        return web.Response(status=404, text="404: Not Found")

    old = fake_service({"/health": old_health})
    other = fake_service({"/health": not_found})
    try:
        with pytest.raises(ConfigError) as info:
            RemoteRewardClient(old.url, "mean_pixel").check_sync()
        message = str(info.value)
        assert old.url in message and "version 99" in message and "miles 9.9" in message and "mean_pixel" in message
        with pytest.raises(ConfigError, match="a miles reward service"):
            RemoteRewardClient(other.url, "mean_pixel").check_sync()
    finally:
        old.close()
        other.close()


def test_concurrent_requests_are_merged_into_batches(service) -> None:
    scorer = CountingScorer(delay=0.05)
    svc = service({"mean_pixel": scorer}, max_batch_size=16, batch_window_s=0.05)
    images = grid_images(16, seed=5)
    client = RemoteRewardClient(svc.url, "mean_pixel", batch_size=2, max_in_flight=8)
    assert bits(remote(client, images)) == bits(in_process("mean_pixel", mean_pixel, images))
    assert client.requests_sent == 8
    assert sum(scorer.sizes) == 16 and len(scorer.sizes) < 8  # 8 concurrent requests, fewer scorer calls
    assert max(scorer.sizes) > 2

    scorer.sizes.clear()
    small = service({"mean_pixel": scorer}, max_batch_size=4)
    assert bits(remote(RemoteRewardClient(small.url, "mean_pixel", batch_size=10), images[:10])) == bits(
        in_process("mean_pixel", mean_pixel, images[:10])
    )
    assert scorer.sizes == [4, 4, 2]  # one request larger than max_batch_size, scored in pieces


def test_reward_error_names_the_item_fails_only_its_request_and_is_not_retried(service) -> None:
    scorer = CountingScorer(delay=0.02)
    svc = service({"mean_pixel": scorer}, batch_window_s=0.05)
    good = RemoteRewardClient(svc.url, "mean_pixel", backoff_s=0.01)
    bad = RemoteRewardClient(svc.url, "mean_pixel", backoff_s=0.01)
    images = grid_images(4, seed=6)

    async def both():
        try:
            good_names = ["sample 0 (prompt 'a')", "sample 1 (prompt 'b')"]
            bad_names = ["sample 2 (prompt 'c')", "sample 3 (prompt 'd')"]
            return await asyncio.gather(
                good.score(images[:2], ["a", "b"], [{}, {}], good_names),
                bad.score(images[2:], ["c", "d"], [{}, {"bad": 7}], bad_names),
                return_exceptions=True,
            )
        finally:
            await good.aclose()
            await bad.aclose()

    ok, failure = asyncio.run(both())
    assert bits(ok) == bits(mean_pixel(images[:2], [], []))
    assert isinstance(failure, RewardError)
    assert str(failure) == (
        f"reward 'mean_pixel' failed on sample 3 (prompt 'd'): ValueError: bad item 7 (reward service {svc.url})"
    )
    assert bad.requests_sent == 1  # a reward failing on its input is not re-sent
    assert scorer.sizes[0] == 4  # the two requests were merged, then re-scored apart


def test_a_transient_5xx_is_retried(service) -> None:
    answers = ["html", "json"]

    async def flaky(request: web.Request) -> web.Response:
        body = await request.read()
        if answers:
            kind = answers.pop(0)
            if kind == "html":
                return web.Response(status=503, text="<html>bad gateway</html>", content_type="text/html")
            return web.json_response({"error": "CUDA hiccup", "retryable": True}, status=500)
        parsed = decode_request(body, request.headers["Content-Type"])
        rewards = mean_pixel([it.image for it in parsed.items], [], [])
        return web.Response(body=encode_response(rewards, MSGPACK), content_type=MSGPACK)

    svc = fake_service({"/score": flaky, "/health": good_health})
    try:
        images = grid_images(3, seed=7)
        client = RemoteRewardClient(svc.url, "mean_pixel", backoff_s=0.01)
        assert bits(remote(client, images)) == bits(in_process("mean_pixel", mean_pixel, images))
        assert client.requests_sent == 3

        answers.extend(["json"] * 3)
        client = RemoteRewardClient(svc.url, "mean_pixel", backoff_s=0.01, retries=2)
        with pytest.raises(RewardError) as info:
            remote(client, images)
        assert str(info.value) == (
            f"reward service {svc.url} failed on 3 samples: sample 0 (prompt 'p0'), sample 1 (prompt 'p1'), "
            "sample 2 (prompt 'p2') after 3 tries: HTTP 500: CUDA hiccup"
        )
    finally:
        svc.close()


# ---- a service that goes away ------------------------------------------------------------------
@pytest.mark.slow
def test_unreachable_service_fails_in_one_line_within_30_s() -> None:
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    client = RemoteRewardClient(url, "mean_pixel")  # the default retries and backoff
    start = time.monotonic()
    with pytest.raises(RewardError) as info:
        remote(client, grid_images(3))
    elapsed = time.monotonic() - start
    message = str(info.value)
    assert elapsed < 30
    assert "\n" not in message and url in message and "connection refused" in message
    assert "after 4 tries" in message and "--use-fault-tolerance" in message


@pytest.mark.slow
def test_killed_service_without_fault_tolerance_fails_within_30_s(tmp_path: Path) -> None:
    proc = ServiceProcess(free_port(), tmp_path / "ready", delay=0.5)
    try:
        client = RemoteRewardClient(proc.url, "mean_pixel", batch_size=2)
        outcome: list[BaseException | list[float]] = []

        def run() -> None:
            try:
                outcome.append(remote(client, grid_images(16)))
            except BaseException as exc:
                outcome.append(exc)

        start = time.monotonic()
        worker = threading.Thread(target=run)
        worker.start()
        time.sleep(0.3)
        assert worker.is_alive()  # mid-scoring
        proc.kill()
        worker.join(60)
        elapsed = time.monotonic() - start
    finally:
        proc.kill()
    assert len(outcome) == 1 and isinstance(outcome[0], RewardError), outcome
    message = str(outcome[0])
    assert elapsed < 30 and "\n" not in message
    assert message.startswith(f"reward service {proc.url} is unreachable (")


@pytest.mark.slow
def test_killed_service_with_fault_tolerance_is_waited_for_and_every_item_scored(tmp_path: Path) -> None:
    port = free_port()
    ready = tmp_path / "ready"
    first = ServiceProcess(port, ready, delay=0.3)
    images = grid_images(32, seed=8)
    client = RemoteRewardClient(
        first.url, "mean_pixel", batch_size=4, max_in_flight=2, fault_tolerant=True, wait_s=60, poll_s=0.1
    )
    outcome: list[BaseException | list[float]] = []

    def run() -> None:
        try:
            outcome.append(remote(client, images))
        except BaseException as exc:
            outcome.append(exc)

    second = None
    worker = threading.Thread(target=run)
    worker.start()
    try:
        time.sleep(0.7)
        assert worker.is_alive()  # mid-scoring
        sent_before_kill = client.requests_sent
        first.kill()
        time.sleep(1.0)
        assert worker.is_alive()  # waiting for the service
        second = ServiceProcess(port, ready, delay=0.0)  # back on the same port
        worker.join(60)
    finally:
        first.kill()
        if second is not None:
            second.kill()
    assert not worker.is_alive()
    assert len(outcome) == 1 and not isinstance(outcome[0], BaseException), outcome
    assert bits(outcome[0]) == bits(in_process("mean_pixel", mean_pixel, images))
    assert 0 < sent_before_kill < 8 and client.requests_sent > 8  # some batches were re-sent


# ---- serve() -----------------------------------------------------------------------------------
def test_serve_refuses_an_unknown_reward() -> None:
    with pytest.raises(ConfigError, match="unknown reward type 'nope'"):
        serve(RewardSettings(), ["nope"], "127.0.0.1", 0)


@pytest.mark.slow
def test_serve_announces_itself_and_stops_on_sigterm(tmp_path: Path) -> None:
    ready = tmp_path / "ready"
    code = (
        "from miles.rewards.dispatch import RewardSettings\n"
        "from miles.rewards.service.server import serve\n"
        f"serve(RewardSettings(), ['jpeg_compressibility', 'jpeg_incompressibility'], '127.0.0.1', 0, "
        f"ready_file={str(ready)!r})\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        line = proc.stdout.readline().strip()
        url = ready.read_text().strip()
        assert url.startswith("http://127.0.0.1:") and not url.endswith(":0")
        assert line == f"miles: reward service on {url} serving jpeg_compressibility, jpeg_incompressibility"
        images = grid_images(2)
        client = RemoteRewardClient(url, "jpeg_incompressibility")
        assert client.check_sync()["rewards"] == ["jpeg_compressibility", "jpeg_incompressibility"]
        scorer = build_scorer(RewardSettings(), "jpeg_incompressibility")
        assert bits(remote(client, images)) == bits(in_process("jpeg_incompressibility", scorer, images))
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(15) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        proc.stdout.close()
