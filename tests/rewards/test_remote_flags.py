"""`--rm-type remote_rm` through the job's dispatch and its flags (`--rm-url`, `--rm-remote-name`, `--rm-batch-size`,
`--rm-max-in-flight`, `--rm-timeout`, `--rm-retries`, `--rm-fault-wait`), against a real service on loopback, and
the preflight's look at the service before a job starts."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from reward_service_helpers import CountingScorer, ServiceThread, free_port, grid_images, mean_pixel

from miles.config.resolution import schema_args
from miles.config.resolve import resolve
from miles.core.errors import ConfigError
from miles.core.sample import Sample
from miles.preflight import find_problems
from miles.rewards.dispatch import RewardError, batched_async_rm, score_items
from miles.rewards.scorers.remote import _CLIENTS
from miles.rewards.service.server import make_app

JOB = {
    "hf_checkpoint": "tiny-sd3",
    "prompt_data": "digits:labels",
    "rollout_batch_size": 2,
    "n_samples_per_prompt": 2,
    "diffusion_num_sde_steps": 2,
    "actor_num_gpus_per_node": 1,
    "num_gpus_per_node": 1,
}


@pytest.fixture
def service():
    started: list[ServiceThread] = []

    def start(scorers) -> ServiceThread:
        svc = ServiceThread(make_app(scorers))
        started.append(svc)
        return svc

    yield start
    for svc in started:
        svc.close()
    _CLIENTS.clear()


def samples(n: int) -> list[Sample]:
    return [Sample(index=i, group_index=0, prompt=f"p{i}", image=im) for i, im in enumerate(grid_images(n))]


def remote_args(url: str, **flags) -> object:
    return schema_args(rm_type=["remote_rm"], rm_url=url, **flags)


def test_remote_rm_scores_like_the_scorer_in_process(service) -> None:
    svc = service({"mean_pixel": mean_pixel})
    batch = samples(5)
    got = asyncio.run(batched_async_rm(remote_args(svc.url), batch))
    names = [f"sample {s.index}" for s in batch]
    expected = score_items(
        "mean_pixel", mean_pixel, [s.image for s in batch], [s.prompt for s in batch], [{}] * 5, names
    )
    assert got == expected


def test_rm_remote_name_chooses_among_several_and_is_needed_then(service) -> None:
    counting = CountingScorer()
    svc = service({"mean_pixel": mean_pixel, "counted": counting})
    with pytest.raises(ConfigError, match=r"serves mean_pixel, counted: choose one with --rm-remote-name"):
        asyncio.run(batched_async_rm(remote_args(svc.url), samples(2)))
    asyncio.run(batched_async_rm(remote_args(svc.url, rm_remote_name="counted"), samples(2)))
    assert sum(counting.sizes) == 2


def test_rm_batch_size_and_max_in_flight_shape_the_requests(service) -> None:
    counting = CountingScorer(delay=0.2)
    svc = service({"counted": counting})
    args = remote_args(svc.url, rm_batch_size=2, rm_max_in_flight=1)
    start = time.monotonic()
    asyncio.run(batched_async_rm(args, samples(6)))
    took = time.monotonic() - start
    assert counting.sizes == [2, 2, 2]  # 3 requests of --rm-batch-size, one at a time: never merged
    assert took >= 0.6


@pytest.mark.slow
def test_rm_timeout_and_rm_retries_end_in_one_line_naming_the_url(service) -> None:
    slow = CountingScorer(delay=3.0)
    svc = service({"slow": slow})
    args = remote_args(svc.url, rm_timeout=0.5, rm_retries=1)
    start = time.monotonic()
    with pytest.raises(RewardError) as info:
        asyncio.run(batched_async_rm(args, samples(1)))
    assert svc.url in str(info.value) and "\n" not in str(info.value)
    assert time.monotonic() - start < 6


@pytest.mark.slow
def test_rm_fault_wait_bounds_the_wait_for_a_service_that_is_down() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    args = remote_args(url, use_fault_tolerance=True, rm_fault_wait=1.0)
    start = time.monotonic()
    with pytest.raises(RewardError, match=url):
        asyncio.run(batched_async_rm(args, samples(1)))
    assert 1.0 <= time.monotonic() - start < 10


def test_remote_flags_without_remote_rm_are_refused() -> None:
    with pytest.raises(ConfigError, match=r"--rm-batch-size .* needs remote_rm among the rewards"):
        resolve("rl", cli={**JOB, "rm_type": "digit", "rm_batch_size": 8})


@pytest.mark.slow
def test_the_preflight_looks_at_the_service_before_the_job_starts(service) -> None:
    svc = service({"mean_pixel": mean_pixel})
    ok = resolve("rl", cli={**JOB, "rm_type": "remote_rm", "rm_url": svc.url})
    assert not [p for p in find_problems(ok) if "rm-url" in p]
    wrong = resolve("rl", cli={**JOB, "rm_type": "remote_rm", "rm_url": svc.url, "rm_remote_name": "digit"})
    (line,) = [p for p in find_problems(wrong) if "rm-url" in p]
    assert "does not serve reward 'digit': it serves mean_pixel" in line
    down = f"http://127.0.0.1:{free_port()}"
    start = time.monotonic()
    (line,) = [
        p for p in find_problems(resolve("rl", cli={**JOB, "rm_type": "remote_rm", "rm_url": down})) if down in p
    ]
    assert "unreachable" in line and time.monotonic() - start < 10


@pytest.mark.slow
def test_a_service_that_comes_back_is_waited_for_under_fault_tolerance() -> None:
    from miles.rewards.service.server import run_service

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    stop = asyncio.Event()
    loop = asyncio.new_event_loop()

    def late_start() -> None:
        time.sleep(1.0)
        loop.run_until_complete(run_service({"mean_pixel": mean_pixel}, "127.0.0.1", port, stop=stop, announce=None))

    thread = threading.Thread(target=late_start, daemon=True)
    thread.start()
    try:
        args = remote_args(url, use_fault_tolerance=True, rm_fault_wait=30.0)
        got = asyncio.run(batched_async_rm(args, samples(3)))
        assert len(got) == 3
    finally:
        loop.call_soon_threadsafe(stop.set)
        thread.join(10)
        _CLIENTS.clear()
