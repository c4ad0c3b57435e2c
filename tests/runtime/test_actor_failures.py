"""One owner of actor failures, on a real local Ray: what each kind of failure inside an actor becomes on the
driver (`miles.runtime.failures.explain`), with the actor's log and registry (`miles.utils.actors`).

The actors are small classes of this module made by `owned_remote`, the same path the trainer ranks, engines,
reward workers and the rollout manager take; the job-level tests (the CLI, a subprocess each) are in
tests/e2e/test_job_failures.py.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from miles.config.resolution import schema_args
from miles.core.errors import ConfigError
from miles.runtime.failures import explain
from miles.utils.actors import ActorTag, owned_remote, tag_for


def _worker_class() -> type:
    """Defined in a function, so Ray ships the class by value (this test module is not importable in workers)."""

    class Worker:
        def __init__(self, fail_with: str | None = None) -> None:
            if fail_with == "config":
                raise ConfigError("bad.jsonl:3: malformed JSON (Expecting value at column 1)")
            if fail_with == "value":
                raise ValueError("the constructor broke")

        def pid(self) -> int:
            print("a line of library chatter")
            print("miles: a line the user should see")
            return os.getpid()

        def boom(self) -> None:
            raise ZeroDivisionError("division by zero\nwith a second line")

        def user_mistake(self) -> None:
            raise ConfigError("--prompt-data p.jsonl:2: 'input' must be a string, got int")

        def frozen(self) -> int:
            import gc

            return gc.get_freeze_count()

        def crash(self) -> None:
            import ctypes

            ctypes.string_at(0)  # a segmentation fault: faulthandler writes its fatal error to the log

        def cut_off(self) -> None:
            from miles.utils import actors

            actors._cut_off("the Ray head 10.9.9.9:6379 has been unreachable for 8 s (--host-timeout)")
            os._exit(1)  # what the lifeline does after its last words

        def sleep(self, seconds: float) -> None:
            time.sleep(seconds)

        def hook_that_hangs(self) -> None:
            from miles.utils.deadline import timed

            timed(time.sleep, "--custom-rm-path my.rm")(60)

        def warn(self) -> None:
            import logging

            logging.getLogger("miles.rollout.health").warning("engine health check failed: %s", "timeout")

        async def async_boom(self) -> None:
            raise RuntimeError("async failure")

    return Worker


_WORKER = _worker_class()


def _tag(tmp_path: Path, index: int, **kw) -> ActorTag:
    return ActorTag(role="worker", index=index, log_dir=str(tmp_path / "logs"), **kw)


def _start(local_ray, tmp_path: Path, index: int, *args, **kw):
    actor = owned_remote(_WORKER).options(num_cpus=0).remote(*args, _miles_tag=_tag(tmp_path, index, **kw))
    return actor


def _registry(tmp_path: Path) -> list[dict]:
    return [json.loads(line) for line in (tmp_path / "logs" / "actors.jsonl").read_text().splitlines()]


@pytest.mark.slow  # a local Ray for the module (~10 s to start): not in the fast tier
def test_an_exception_names_the_actor_its_last_line_and_its_log(local_ray, tmp_path: Path) -> None:
    actor = _start(local_ray, tmp_path, 0)
    pid = local_ray.get(actor.pid.remote())
    with pytest.raises(Exception) as caught:
        local_ray.get(actor.boom.remote())
    failure = explain(caught.value, tmp_path / "logs")
    log = tmp_path / "logs" / "worker-0.log"
    assert failure is not None and failure.code == 1
    assert failure.line == (
        f"worker 0 on node {_registry(tmp_path)[0]['node']} (pid {pid}) failed: ZeroDivisionError: with a second "
        f"line; full log: {log}"
    )
    text = log.read_text()
    assert "a line of library chatter" in text and "Traceback" in text and "ZeroDivisionError" in text
    errors = [r for r in _registry(tmp_path) if r["event"] == "error"]
    assert errors[-1]["where"] == "Worker.boom" and errors[-1]["type"] == "builtins.ZeroDivisionError"


@pytest.mark.slow  # a local Ray for the module (~10 s to start): not in the fast tier
def test_a_user_mistake_inside_an_actor_is_the_same_one_line(local_ray, tmp_path: Path) -> None:
    actor = _start(local_ray, tmp_path, 1)
    with pytest.raises(Exception) as caught:
        local_ray.get(actor.user_mistake.remote())
    failure = explain(caught.value, tmp_path / "logs")
    assert failure is not None
    assert (failure.code, failure.line) == (2, "--prompt-data p.jsonl:2: 'input' must be a string, got int")


@pytest.mark.slow  # a local Ray for the module (~10 s to start): not in the fast tier
def test_a_constructor_mistake_keeps_its_class_and_message(local_ray, tmp_path: Path) -> None:
    actor = _start(local_ray, tmp_path, 2, "config")
    with pytest.raises(Exception) as caught:
        local_ray.get(actor.pid.remote())
    failure = explain(caught.value, tmp_path / "logs")
    assert failure is not None
    assert (failure.code, failure.line) == (2, "bad.jsonl:3: malformed JSON (Expecting value at column 1)")


@pytest.mark.slow  # a local Ray for the module (~10 s to start): not in the fast tier
def test_a_constructor_error_names_the_actor(local_ray, tmp_path: Path) -> None:
    actor = _start(local_ray, tmp_path, 3, "value")
    with pytest.raises(Exception) as caught:
        local_ray.get(actor.pid.remote())
    failure = explain(caught.value, tmp_path / "logs")
    assert failure is not None and failure.code == 1
    assert failure.line.startswith("worker 3 on node ") and "failed: ValueError: the constructor broke" in failure.line
    assert failure.line.endswith(f"full log: {tmp_path / 'logs' / 'worker-3.log'}")


@pytest.mark.slow  # a local Ray for the module (~10 s to start): not in the fast tier
def test_a_killed_actor_is_named_at_once_while_another_call_still_runs(local_ray, tmp_path: Path) -> None:
    slow, victim = _start(local_ray, tmp_path, 4), _start(local_ray, tmp_path, 5)
    victim_pid = local_ray.get(victim.pid.remote())
    local_ray.get(slow.pid.remote())
    refs = [slow.sleep.remote(60), victim.sleep.remote(60)]
    time.sleep(0.5)
    os.kill(victim_pid, signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(Exception) as caught:
        local_ray.get(refs)  # a list: the first failure ends the wait, the sleeping call is not waited for
    assert time.monotonic() - start < 10
    failure = explain(caught.value, tmp_path / "logs")
    assert failure is not None and failure.code == 1
    assert failure.line.startswith("worker 5 on node ") and f"(pid {victim_pid}) died: its process ended" in (
        failure.line
    )
    assert failure.line.endswith(f"full log: {tmp_path / 'logs' / 'worker-5.log'}")


@pytest.mark.slow  # a local Ray for the module (~10 s to start): not in the fast tier
def test_an_actors_start_up_objects_are_out_of_the_garbage_collectors_walks(local_ray, tmp_path: Path) -> None:
    actor = _start(local_ray, tmp_path, 11)
    assert local_ray.get(actor.frozen.remote()) > 10_000  # Ray's worker and this module's imports, frozen


@pytest.mark.slow  # a local Ray for the module (~10 s to start): not in the fast tier
def test_a_crash_in_c_is_named_with_what_its_log_ends_with(local_ray, tmp_path: Path) -> None:
    actor = _start(local_ray, tmp_path, 9)
    pid = local_ray.get(actor.pid.remote())
    with pytest.raises(Exception) as caught:
        local_ray.get(actor.crash.remote(), timeout=60)
    failure = explain(caught.value, tmp_path / "logs")
    assert failure is not None and failure.code == 1
    assert f"worker 9 on node {_registry(tmp_path)[0]['node']} (pid {pid}) died: its process ended" in failure.line
    assert "; its log ends with: Segmentation fault; full log: " in failure.line


@pytest.mark.slow  # a local Ray for the module (~10 s to start): not in the fast tier
def test_an_actor_cut_off_from_the_head_is_named_with_its_lifelines_reason(local_ray, tmp_path: Path) -> None:
    actor = _start(local_ray, tmp_path, 10)
    pid = local_ray.get(actor.pid.remote())
    with pytest.raises(Exception) as caught:
        local_ray.get(actor.cut_off.remote(), timeout=60)
    failure = explain(caught.value, tmp_path / "logs")
    assert failure is not None and failure.code == 1
    assert failure.line == (
        f"worker 10 on node {_registry(tmp_path)[0]['node']} (pid {pid}) exited: the Ray head 10.9.9.9:6379 has "
        f"been unreachable for 8 s (--host-timeout); full log: {tmp_path / 'logs' / 'worker-10.log'}"
    )


@pytest.mark.slow  # a local Ray for the module (~10 s to start): not in the fast tier
def test_a_hook_past_its_deadline_ends_the_actor_and_names_the_hook(local_ray, tmp_path: Path) -> None:
    actor = _start(local_ray, tmp_path, 6, hook_timeout=1.0)
    local_ray.get(actor.pid.remote())
    start = time.monotonic()
    with pytest.raises(Exception) as caught:
        local_ray.get(actor.hook_that_hangs.remote(), timeout=30)
    assert time.monotonic() - start < 15
    failure = explain(caught.value, tmp_path / "logs")
    assert failure is not None and failure.code == 1
    assert failure.line.startswith("--custom-rm-path my.rm did not return within 1 s (--hook-timeout)")
    assert failure.line.endswith(f"(logs: {tmp_path / 'logs'})")
    assert "hook_that_hangs" in (tmp_path / "logs" / "worker-6.log").read_text()  # its stack, for the user


@pytest.mark.slow  # a local Ray for the module (~10 s to start): not in the fast tier
def test_an_async_method_failure_is_recorded(local_ray, tmp_path: Path) -> None:
    actor = _start(local_ray, tmp_path, 7)
    with pytest.raises(Exception) as caught:
        local_ray.get(actor.async_boom.remote())
    failure = explain(caught.value, tmp_path / "logs")
    assert failure is not None and "failed: RuntimeError: async failure" in failure.line


@pytest.mark.slow  # a local Ray for the module (~10 s to start): not in the fast tier
def test_only_the_users_lines_are_forwarded(local_ray, tmp_path: Path, capsys) -> None:
    """What an actor prints goes to its log; `miles: ` lines also to the stream Ray forwards to the driver,
    whose printer shows only those and writes everything to driver.log."""
    from miles.runtime import terminal

    actor = _start(local_ray, tmp_path, 8)
    local_ray.get(actor.pid.remote())
    local_ray.get(actor.warn.remote())
    log = (tmp_path / "logs" / "worker-8.log").read_text()
    assert "a line of library chatter" in log and "miles: a line the user should see" in log
    assert "miles: warning: engine health check failed: timeout\n" in log  # a `miles: ` line: shown too
    old = terminal._DRIVER_LOG
    terminal._DRIVER_LOG = tmp_path / "driver.log"
    try:
        terminal._forwarded({"pid": 1, "lines": ["chatter", "miles: engine ready"], "is_err": False})
        terminal._forwarded({"pid": "raylet", "lines": ["miles: not an actor's", "A worker died"], "is_err": False})
    finally:
        terminal._DRIVER_LOG = old
    assert capsys.readouterr().out == "miles: engine ready\n"
    assert (tmp_path / "driver.log").read_text().splitlines() == [
        "(1) chatter",
        "(1) miles: engine ready",
        "(raylet) miles: not an actor's",
        "(raylet) A worker died",
    ]


@pytest.mark.slow  # a local Ray for the module (~10 s to start): not in the fast tier
def test_verbose_keeps_the_actors_output_on_rays_streams(local_ray, tmp_path: Path) -> None:
    """--verbose: the actor's output stays on the streams Ray forwards (all of it reaches the terminal); the log
    holds only miles' own lines (start, failures)."""
    tag = tag_for(schema_args(output_dir=str(tmp_path), verbose=True, hook_timeout=None), "worker", 9)
    assert tag is not None and tag.verbose
    actor = owned_remote(_WORKER).options(num_cpus=0).remote(_miles_tag=tag)
    local_ray.get(actor.pid.remote())
    assert "a line of library chatter" not in (tmp_path / "logs" / "worker-9.log").read_text()
    quiet = _start(local_ray, tmp_path, 10)
    local_ray.get(quiet.pid.remote())
    assert "a line of library chatter" in (tmp_path / "logs" / "worker-10.log").read_text()


def test_no_tag_without_an_output_dir() -> None:
    assert tag_for(schema_args(output_dir=None), "actor") is None
    tag = tag_for(schema_args(output_dir="/tmp/run", hook_timeout=0.0, verbose=False), "engine", 2)
    assert tag is not None and tag.log_path == Path("/tmp/run/logs/engine-2.log") and tag.hook_timeout is None


def test_an_error_not_from_ray_is_not_explained(tmp_path: Path) -> None:
    assert explain(ValueError("x"), tmp_path) is None
