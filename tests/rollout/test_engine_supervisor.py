"""`EngineSupervisor` on real Ray with a stand-in engine actor (no model: seconds, not minutes).

The stand-in answers like a diffusers engine actor (status on its "health" thread, generate, weight
pushes, digest) and misbehaves on cue, through files in a directory every incarnation of it reads:
`hang` (the process whose pid it holds stops answering, health checks included), `die` (it exits in
every generate call), `forget` (it drops pushed weights). Covered: a hung engine killed by the health
checks, restarted under fault tolerance or one error without; an engine that dies on every attempt; a
restart whose weights do not verify; an engine dead before a weight sync; the per-job restart cap
(--max-engine-restarts); a restart whose bundle's node is gone placed anywhere alive.
"""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from miles.rollout.engines.base import GenerateRequest
from miles.rollout.engines.supervisor import DiffusersEngineError, EngineSupervisor

pytestmark = pytest.mark.slow


def _stand_in_class() -> type:
    """A class made here, not at module level: Ray's workers cannot import a test module, so it travels by
    value."""

    class StandIn:
        def __init__(self, args: Any) -> None:
            self.cues = Path(args.cues)
            self.weights: dict[str, Any] = {"w": torch.tensor(0.0)}
            self.version = 0

        def _cue(self, name: str) -> bool:
            return (self.cues / name).exists()

        def _hangs(self) -> bool:
            path = self.cues / "hang"
            return path.exists() and path.read_text() == str(os.getpid())

        def status(self) -> dict[str, Any]:
            while self._hangs():
                time.sleep(0.05)
            return {"pid": os.getpid(), "weight_version": self.version}

        def generate(self, requests: list[GenerateRequest]) -> list[dict[str, Any]]:
            if self._cue("die"):
                os._exit(1)
            while self._hangs():
                time.sleep(0.05)
            time.sleep(0.2)
            return [{"seed": s, "version": self.version, "w": self.weights["w"]} for r in requests for s in r.seeds]

        def update_weights(self, state: dict[str, Any], version: int) -> int:
            if not self._cue("forget"):
                self.weights.update({k: float(v) for k, v in state.items()})
                self.version = version
            return len(state)

        def weights_digest(self) -> dict[str, Any]:
            sha = hashlib.sha256(repr(sorted(self.weights.items())).encode()).hexdigest()
            return {"sha256": sha, "version": self.version, "tensors": len(self.weights)}

        def placement_group(self) -> str | None:
            import ray.util

            group = ray.util.get_current_placement_group()
            return None if group is None else group.id.hex()

    return StandIn


@pytest.fixture(scope="module")
def actor_class(local_ray: Any) -> Any:
    from miles.utils.actors import owned_remote

    # made like the real engine actors: a `_miles_tag` (their log under <output-dir>/logs) and recorded failures
    return owned_remote(_stand_in_class(), concurrency_groups={"health": 1})


def _args(cues: Path, fault_tolerance: bool, **changes: Any) -> SimpleNamespace:
    args = SimpleNamespace(
        cues=str(cues),
        use_fault_tolerance=fault_tolerance,
        rollout_health_check_interval=0.3,
        rollout_health_check_timeout=1.0,
        rollout_health_check_first_wait=0.0,
        rollout_microgroup_size=2,
        update_weight_buffer_size=1 << 20,
        ci_test=False,
    )
    vars(args).update(changes)
    return args


def _supervisor(actor_class: Any, args: SimpleNamespace, num: int = 2) -> EngineSupervisor:
    return EngineSupervisor(args, num, lambda i: {"num_cpus": 0}, lambda i: "node 0, CPU", actor_class=actor_class)


def _shards(num_engines: int, calls_per_engine: int) -> list[list[GenerateRequest]]:
    def request(k: int) -> GenerateRequest:
        return GenerateRequest(
            "p", {}, k, [2 * k, 2 * k + 1], [100 + 2 * k, 101 + 2 * k], [[], []], 4, 1.0, 0.0, "ode", 8, 8
        )

    return [[request(e * calls_per_engine + c) for c in range(calls_per_engine)] for e in range(num_engines)]


def _seeds(results: list[dict[str, Any]]) -> list[int]:
    return [r["seed"] for r in results]


def _push(sup: EngineSupervisor):
    import ray

    def push(state: dict[str, Any], version: int) -> int:
        return sum(ray.get([e.update_weights.remote(state, version) for e in sup.engines]))

    return push


def test_a_hung_engine_is_killed_by_the_health_checks_and_restarted(actor_class: Any, tmp_path: Path) -> None:
    sup = _supervisor(actor_class, _args(tmp_path, True))
    try:
        sup.sync(_push(sup), {"w": torch.tensor(3.0)}, 1)
        (tmp_path / "hang").write_text(str(sup.pids[0]))
        shards = _shards(2, 3)
        start = time.monotonic()
        results = sup.run(shards)
        assert time.monotonic() - start < 30
        assert _seeds(results) == [s for shard in shards for r in shard for s in r.seeds]
        assert all(r["version"] == 1 and r["w"] == 3.0 for r in results)  # served with the re-pushed weights
        assert [entry["engine"] for entry in sup.restart_log] == [0]
        assert sup.restart_log[0]["reason"].startswith("no answer to a health check within 1 s")
    finally:
        sup.shutdown()


def test_without_fault_tolerance_a_hung_engine_is_one_error(actor_class: Any, tmp_path: Path) -> None:
    sup = _supervisor(actor_class, _args(tmp_path, False), num=1)
    try:
        (tmp_path / "hang").write_text(str(sup.pids[0]))
        with pytest.raises(DiffusersEngineError) as excinfo:
            sup.run(_shards(1, 2))
        message = str(excinfo.value)
        assert message.startswith(f"diffusers engine 0 (node 0, CPU, pid {sup.pids[0]}) failed: no answer to a health")
        assert "within 1 s (--rollout-health-check-timeout)" in message and "--use-fault-tolerance" in message
    finally:
        (tmp_path / "hang").unlink(missing_ok=True)
        sup.shutdown()


def test_an_engine_that_dies_on_every_attempt_gives_up_the_run(actor_class: Any, tmp_path: Path) -> None:
    sup = _supervisor(actor_class, _args(tmp_path, True, rollout_health_check_interval=0), num=1)
    try:
        (tmp_path / "die").touch()
        with pytest.raises(DiffusersEngineError, match=r"diffusers engine 0 .* failed again after 3 restarts"):
            sup.run(_shards(1, 2))
        assert len(sup.restart_log) == 3
    finally:
        (tmp_path / "die").unlink(missing_ok=True)
        sup.shutdown()


def test_a_restart_that_does_not_restore_the_synced_weights_is_an_error(actor_class: Any, tmp_path: Path) -> None:
    import ray

    sup = _supervisor(actor_class, _args(tmp_path, True, rollout_health_check_interval=0), num=1)
    try:
        push = _push(sup)
        sup.sync(push, {"w": torch.tensor(5.0)}, 7)
        (tmp_path / "forget").touch()
        ray.kill(sup.engines[0], no_restart=True)
        with pytest.raises(DiffusersEngineError, match=r"does not hold the weights of the last sync: version 0 .*"):
            sup.run(_shards(1, 1))
    finally:
        (tmp_path / "forget").unlink(missing_ok=True)
        sup.shutdown()


def _wait_dead(actor: Any, timeout: float = 30.0) -> None:
    import ray

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            ray.get(actor.weights_digest.remote(), timeout=5)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            return
        time.sleep(0.05)
    raise AssertionError(f"{actor} still answers {timeout} s after ray.kill")


def test_an_engine_dead_before_a_weight_sync_is_restarted_and_synced(actor_class: Any, tmp_path: Path) -> None:
    import ray

    sup = _supervisor(actor_class, _args(tmp_path, True, rollout_health_check_interval=0))
    try:
        push = _push(sup)
        sup.sync(push, {"w": torch.tensor(1.0)}, 1)
        ray.kill(sup.engines[1], no_restart=True)
        _wait_dead(sup.engines[1])  # ray.kill returns before the actor is gone: a sync could still reach it
        sup.sync(push, {"w": torch.tensor(2.0)}, 2)
        assert [entry["engine"] for entry in sup.restart_log] == [1]
        assert sup.restart_log[0]["reason"].startswith("its actor died")
        digests = ray.get([e.weights_digest.remote() for e in sup.engines])
        assert [d["version"] for d in digests] == [2, 2] and digests[0]["sha256"] == digests[1]["sha256"]
    finally:
        sup.shutdown()


def test_restarts_stop_at_the_per_job_cap(actor_class: Any, tmp_path: Path) -> None:
    import ray

    args = _args(tmp_path, True, rollout_health_check_interval=0, max_engine_restarts=1)
    sup = _supervisor(actor_class, args, num=1)
    try:
        ray.kill(sup.engines[0], no_restart=True)
        _wait_dead(sup.engines[0])
        assert len(sup.run(_shards(1, 1))) == 2  # the first death in the job: restarted, the call completed
        ray.kill(sup.engines[0], no_restart=True)
        _wait_dead(sup.engines[0])
        with pytest.raises(DiffusersEngineError) as excinfo:  # a later call: the job's restarts are spent
            sup.run(_shards(1, 1))
        message = str(excinfo.value)
        assert "\n" not in message and message.startswith("diffusers engine 0 (node 0, CPU")
        assert "failed again after 1 restarts in this job (--max-engine-restarts 1): its actor died" in message
        assert len(sup.restart_log) == 1
    finally:
        sup.shutdown()


def test_engines_started_by_the_driver_are_taken_over_and_restarted_like_its_own(
    actor_class: Any, tmp_path: Path
) -> None:
    """`started`: the driver's engine actors (`engine_start`) are the supervisor's engines, none started twice;
    one that dies is replaced by a new actor from the supervisor, synced like a first start."""
    import ray

    handles = [actor_class.options(num_cpus=0).remote(_args(tmp_path, True)) for _ in range(2)]
    pids = ray.get([h.status.remote() for h in handles])
    args = _args(tmp_path, True)
    sup = EngineSupervisor(
        args, 2, lambda i: {"num_cpus": 0}, lambda i: "node 0, CPU", actor_class=actor_class, started=handles
    )
    try:
        assert sup.engines == handles and sup.pids == [p["pid"] for p in pids]
        sup.sync(_push(sup), {"w": torch.tensor(2.0)}, 1)
        ray.kill(handles[1], no_restart=True)
        _wait_dead(handles[1])
        results = sup.run(_shards(2, 1))
        assert sup.engines[1] is not handles[1] and [e["engine"] for e in sup.restart_log] == [1]
        assert all(r["version"] == 1 and r["w"] == 2.0 for r in results)
    finally:
        sup.shutdown()
    with pytest.raises(ValueError, match="1 engine actors started for 2 engines"):
        EngineSupervisor(args, 2, lambda i: {}, lambda i: "", actor_class=actor_class, started=handles[:1])


def test_a_restart_whose_bundle_node_is_gone_goes_anywhere_alive(
    actor_class: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from miles.rollout.engines import relocation

    group = placement_group([{"CPU": 0.01}], strategy="STRICT_PACK")
    ray.get(group.ready(), timeout=60)
    options = {"num_cpus": 0, "scheduling_strategy": PlacementGroupSchedulingStrategy(group, 0)}
    args = _args(tmp_path, True, rollout_health_check_interval=0)
    sup = EngineSupervisor(args, 1, lambda i: dict(options), lambda i: "node 0, CPU", actor_class=actor_class)
    try:
        assert ray.get(sup.engines[0].placement_group.remote()) == group.id.hex()  # started in its bundle
        ray.kill(sup.engines[0], no_restart=True)
        _wait_dead(sup.engines[0])
        monkeypatch.setattr(relocation, "alive_node_ids", lambda: set())  # as if the bundle's node had died
        assert len(sup.run(_shards(1, 1))) == 2
        assert [entry["engine"] for entry in sup.restart_log] == [0]
        assert ray.get(sup.engines[0].placement_group.remote()) is None  # restarted outside the dead bundle
    finally:
        sup.shutdown()
        remove_placement_group(group)


def test_a_rollout_batch_leaves_an_actor_as_a_reference_and_a_preview(local_ray) -> None:
    """`RolloutBatch` out of an actor: the samples stay in the object store (packed) until read; the driver holds a
    reference the trainers take and a preview of the first 64 samples without trajectories."""
    from miles.core.sample import Sample, Trajectory
    from miles.rollout.manager import PREVIEW_SAMPLES, RolloutBatch

    ray = local_ray

    @ray.remote(num_cpus=0)
    class Maker:
        def make(self, n: int) -> RolloutBatch:
            samples = [
                Sample(
                    index=i,
                    group_index=i // 10,
                    prompt=f"p{i}",
                    trajectory=Trajectory(
                        latents=torch.full((3, 2), float(i)), timesteps=torch.ones(2), sigmas=torch.ones(3)
                    ),
                    image=torch.full((3, 2, 2), float(i)),
                )
                for i in range(n)
            ]
            return RolloutBatch(rollout_id=7, samples=samples, metrics={"m": 1.0})

    batch = ray.get(Maker.remote().make.remote(70))
    assert batch.rollout_id == 7 and batch.metrics == {"m": 1.0}
    assert batch._samples is None and isinstance(batch.trainer_input(), ray.ObjectRef)
    assert len(batch.preview) == PREVIEW_SAMPLES and batch.preview[5].trajectory is None
    assert float(batch.preview[5].image[0, 0, 0]) == 5.0
    fetched = ray.get(batch.trainer_input())
    assert [s.index for s in fetched] == list(range(70)) and torch.equal(
        fetched[9].trajectory.latents, torch.full((3, 2), 9.0)
    )
    assert [s.index for s in batch.samples] == list(range(70))  # read: fetched once, then kept
    assert batch.trainer_input() is batch.samples


def test_samples_leave_without_images_where_nothing_past_the_manager_reads_them(local_ray) -> None:
    """`without_images`: the trainers' samples carry trajectories but no images (the preview keeps its 64 images),
    and the object in the store shrinks by the images' bytes; `images_travel` says when images must go on."""
    from types import SimpleNamespace

    from miles.core.sample import Sample, Trajectory
    from miles.rollout.rollout_batch import PREVIEW_SAMPLES, RolloutBatch, images_travel, without_images

    ray = local_ray

    @ray.remote(num_cpus=0)
    class Maker:
        def make(self, n: int, images: bool) -> RolloutBatch:
            samples = [
                Sample(
                    index=i,
                    group_index=i // 10,
                    prompt=f"p{i}",
                    trajectory=Trajectory(torch.full((3, 2), float(i)), torch.ones(2), torch.ones(3)),
                    image=torch.full((3, 16, 16), float(i)),
                )
                for i in range(n)
            ]
            return RolloutBatch(7, samples, {"m": 1.0}) if images else without_images(7, samples, {"m": 1.0})

    maker = Maker.remote()
    full, lean = (ray.get(maker.make.remote(80, images)) for images in (True, False))
    assert [float(s.image[0, 0, 0]) for s in lean.preview] == [float(i) for i in range(PREVIEW_SAMPLES)]
    fetched = ray.get(lean.trainer_input())
    assert all(s.image is None for s in fetched) and torch.equal(
        fetched[70].trajectory.latents, torch.full((3, 2), 70.0)
    )
    assert all(s.image is not None for s in ray.get(full.trainer_input()))
    sizes = [len(ray.cloudpickle.dumps(ray.get(b.trainer_input()))) for b in (full, lean)]
    assert sizes[0] - sizes[1] >= 80 * 3 * 16 * 16 * 4 * 0.9  # the images' bytes, gone
    args = SimpleNamespace(save_debug_rollout_data=None, save_debug_train_data=None)
    assert not images_travel(args)
    assert images_travel(SimpleNamespace(save_debug_rollout_data="r_{rollout_id}.pt"))
    assert images_travel(SimpleNamespace(custom_convert_samples_to_train_data_path="my.hooks.convert"))
    assert images_travel(SimpleNamespace(custom_rollout_log_function_path="my.hooks.log"))


def test_an_actor_started_with_thread_options_has_its_threads_without_setting_them(local_ray) -> None:
    """Ray starts a fractional-CPU actor with OMP_NUM_THREADS=1; the hint starts it with 2, so torch has 2 threads
    and `use_threads(2)` has nothing to set."""
    from miles.utils.torch_threads import thread_options

    ray = local_ray

    @ray.remote(num_cpus=0.0001)
    class Probe:
        def threads(self) -> tuple[str | None, int]:
            import os

            import torch as t

            return os.environ.get("OMP_NUM_THREADS"), t.get_num_threads()

    plain = ray.get(Probe.remote().threads.remote())
    hinted = ray.get(Probe.options(**thread_options(2)).remote().threads.remote())
    assert plain == ("1", 1)
    assert hinted == ("2", 2)


def test_thread_options_here_hints_only_actors_on_the_callers_node(local_ray) -> None:
    """The caller knows its own node's cores only: an actor placed elsewhere gets no hint (it sets its threads)."""
    from miles.utils.torch_threads import thread_options_here

    here = local_ray.get_runtime_context().get_node_id()
    assert thread_options_here(here, 2) == {"runtime_env": {"env_vars": {"OMP_NUM_THREADS": "2"}}}
    assert thread_options_here("f" * len(here), 2) == {}
    assert thread_options_here(here, None) == {}
