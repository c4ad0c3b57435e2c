"""The sglang side of the rollout manager: engines, the miles router, the client, weight sync and
fault tolerance.

    engines   one `SglangEngine` Ray actor per engine, each owning a server process
    router    `MilesRouter` in this process: least-loaded over the engines, at most
              --sglang-server-concurrency requests each, health checks every
              --rollout-health-check-interval s (after --rollout-health-check-first-wait), an engine
              out after --miles-router-health-check-failure-threshold failed checks or a refused connection
    client    one `POST /rollout/generate` per microgroup through the router (all in flight at once up
              to the concurrency cap), responses decoded in --rollout-parser-num-workers Ray actors,
              each microgroup's rewards started as soon as it is parsed
    sync      full weights from disk or the LoRA adapter, then every engine's tensors checked (`sync.py`)

Addresses: the router binds `--rollout-engine-host` as resolved on the manager's node and hands out its advertised
URL (what `--use-distributed-post` actors on other nodes post to); every engine is known by its advertised URL,
resolved on its own node (`miles.rollout.engines.addresses`). An explicit loopback address with an engine (or a
posting actor) on another node than the router is refused at the start, in one line.

When the router takes an engine out, its actor is asked how its server looks from its own host (`recovery.py`):
an engine healthy there but unreachable from here ends the job in one line (a restart cannot mend an address),
a passing failure puts it back. Otherwise, with --use-fault-tolerance, a removed engine is restarted (new
process, new port; a new actor, on a live node, when its actor or node is gone), brought to the last synced
weights, verified and put back in the router, at most --max-engine-restarts times per engine and job; its
requests were already re-sent to the others by the router. Without it the rollout stops with one error naming
the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from pathlib import Path
from typing import Any

from miles.core.errors import EngineFailure
from miles.core.sample import Sample
from miles.rollout.engines import addresses
from miles.rollout.engines.base import GenerateRequest
from miles.rollout.engines.failure_text import with_cause
from miles.rollout.engines.sglang.posting import make_poster
from miles.rollout.engines.sglang.protocol import (
    GENERATE_PATH,
    engine_family,
    parse_response,
    rollout_payload,
    server_requests,
)
from miles.rollout.engines.sglang.recovery import ActorUnanswered, EngineRecovery
from miles.rollout.engines.sglang.schedule import served_checkpoint
from miles.utils.actors import owned_remote, tag_for

logger = logging.getLogger("miles.rollout.sglang")


_PLACE_SECONDS = 300.0  # how long a replacement actor may wait for a node with its resources free


class RolloutEngineError(EngineFailure):
    """An engine failed and the run cannot go on; the message names the engine."""


class _Parser:
    """A Ray actor that decodes responses off the manager's event loop (into the family's layout)."""

    def __init__(self, args: Any) -> None:
        self.family = engine_family(args)

    def parse(self, request: GenerateRequest, body: bytes) -> list[Sample]:
        return parse_response(request, body, self.family)


class SglangRollout:
    def __init__(self, args: Any, num: int, placement: Any = None) -> None:
        import ray

        from miles.core.inputs import input_path
        from miles.models.tiny.metadata import max_sequence_length
        from miles.rollout.engines.sglang.engine import engine_actor_class
        from miles.rollout.engines.sglang.router import MilesRouter, RouterConfig
        from miles.utils.sglang_env import resolve_sglang_python

        self.args = args
        self.generation_end: float | None = None  # when the last response of `run` was parsed
        python = resolve_sglang_python(args.sglang_python)
        if python is None:
            raise RolloutEngineError(
                "--rollout-backend sglang: no sglang environment found "
                f"(--sglang-python {args.sglang_python}, $MILES_SGLANG_PYTHON, ~/.cache/miles/sglang-env); "
                "build one with scripts/build_sglang_env.sh"
            )
        self.root = Path(args.output_dir or ".") / "engines"
        model_path = str(input_path(args, args.hf_checkpoint))
        self.family = engine_family(args)  # what differs per family: payloads, parsing, weight layout
        self.family.bind_checkpoint(model_path)  # the layout may depend on the checkpoint (cosmos3's MLP kind)
        self.max_sequence_length = max_sequence_length(model_path, default=self.family.max_sequence_length)
        # --diffusion-flow-shift: the server samples a view whose scheduler config has the shift (`schedule.py`)
        model_path = str(served_checkpoint(Path(model_path), args.diffusion_flow_shift, self.root))
        # the router's addresses, resolved on this (the manager's) node; each engine resolves its own on its node
        self.address = addresses.serving_address(args.rollout_engine_host)
        self.node_id = addresses.node_id()
        self._check_posting_nodes()
        self._actor = engine_actor_class()
        self._start_args = (python, model_path)
        self._options: list[dict[str, Any]] = []
        self._gpu_ids: list[list[int] | None] = []
        for i in range(num):
            if placement is not None:
                slot = placement.slots("engine")[i]
                options, gpu_ids = placement.options(slot), placement.gpu_ids(slot) or None
                self._check_engine_node(i, placement.node_id(slot))
            else:
                options, gpu_ids = {"num_gpus": 0, "num_cpus": 0}, None
            self._options.append(options)
            self._gpu_ids.append(gpu_ids)
        self.engines = [self._new_actor(i, self._options[i], self._gpu_ids[i]) for i in range(num)]
        self.infos: list[dict[str, Any]] = []
        for i, engine in enumerate(self.engines):
            try:
                self.infos.append(ray.get(engine.info.remote()))
            except Exception as exc:
                self.shutdown()
                raise RolloutEngineError(f"sglang engine {i} failed to start: {with_cause(exc)}") from None
        try:
            for i, info in enumerate(self.infos):
                self._check_engine_node(i, info.get("node_id"))
        except Exception:
            self.shutdown()
            raise
        for i, info in enumerate(self.infos):
            print(
                f"miles: sglang engine {i} at {info['url']} (pid {info['pid']}) ready in "
                f"{info['start_seconds']:.1f} s; log {info['log']}",
                flush=True,
            )
        self.lock = threading.Lock()
        self.recovery = EngineRecovery(
            self,
            num,
            fault_tolerant=lambda: bool(self.args.use_fault_tolerance),
            max_restarts=int(getattr(args, "max_engine_restarts", 3)),
            timeout=float(args.rollout_health_check_timeout or 30.0),
            manager_ip=self.address.node_ip,
        )
        self.restart_log: list[dict[str, Any]] = []
        self.last_sync: tuple[str, Any] | None = None
        self.awaiting_sync: set[int] = set()  # restarted after an in-place sync: out of the router until the next
        self.sync_metrics: dict[str, float] = {}
        # per synced module (the transformer; Wan2.2's two experts): base digests for LoRA, where those weights
        # are, its parameter and linear-module names
        self._base_sha: dict[str, dict[str, str]] = {}
        self._base_dir: dict[str, Path] = {}
        self._layouts: dict[str, tuple[frozenset[str], frozenset[str]]] = {}
        self.router = MilesRouter(
            RouterConfig(
                host=self.address.bind,
                advertise_host=self.address.advertised,
                concurrency=int(args.sglang_server_concurrency),
                timeout=args.miles_router_timeout,
                max_connections=args.miles_router_max_connections,
                health_check_interval=float(args.rollout_health_check_interval),
                health_check_timeout=float(args.rollout_health_check_timeout),
                health_check_first_wait=float(args.rollout_health_check_first_wait),
                failure_threshold=int(args.miles_router_health_check_failure_threshold),
            ),
            on_engine_removed=self._on_removed,
        )
        self.router.start()
        for info in self.infos:
            self.router.add_worker(info["url"])
        workers = max(1, int(args.rollout_parser_num_workers))
        parser = owned_remote(_Parser).options(num_cpus=0)
        self.parsers = [parser.remote(args, _miles_tag=tag_for(args, "parser", i)) for i in range(workers)]
        self._next_parser = 0
        # who sends the POSTs: this process, or per-node Ray actors (--use-distributed-post, `posting.py`)
        self.poster = make_poster(args, max_concurrency=int(args.sglang_server_concurrency) * len(self.engines))

    # ---- engines ------------------------------------------------------------------------------
    def _new_actor(self, i: int, options: dict[str, Any], gpu_ids: list[int] | None) -> Any:
        python, model_path = self._start_args
        return self._actor.options(**options, max_concurrency=4).remote(
            self.args, i, python, model_path, str(self.root), gpu_ids, _miles_tag=tag_for(self.args, "engine", i)
        )

    def _check_engine_node(self, i: int, node: str | None) -> None:
        """An explicit loopback `--rollout-engine-host` with engine i on another node than the router: one line."""
        setting = self.args.rollout_engine_host
        if node and self.node_id and node != self.node_id and addresses.explicit_loopback(setting):
            raise addresses.loopback_across_nodes(setting, f"sglang engine {i}", node[:12], self.node_id[:12])

    def _check_posting_nodes(self) -> None:
        """--use-distributed-post posts from every alive node: the router must not listen on loopback then."""
        setting = self.args.rollout_engine_host
        if not (self.args.use_distributed_post and addresses.explicit_loopback(setting)):
            return
        nodes = addresses.alive_nodes()
        if nodes > 1:
            raise addresses.loopback_refused(
                setting, f"--use-distributed-post posts to the miles router from all {nodes} alive nodes"
            )

    def _index_of(self, url: str) -> int | None:
        for i, info in enumerate(self.infos):
            if info["url"].rstrip("/") == url.rstrip("/"):
                return i
        return None

    def _describe(self, i: int) -> str:
        info = self.infos[i]
        return f"sglang engine {i} at {info['url']} (pid {info['pid']}, log {info['log']})"

    # what `EngineRecovery` asks of the engines (`recovery.EngineSide`)
    def describe(self, i: int) -> str:
        return self._describe(i)

    def engine_url(self, i: int) -> str:
        return str(self.infos[i]["url"])

    def local_health(self, i: int) -> dict[str, Any]:
        import ray
        from ray.exceptions import GetTimeoutError

        timeout = float(self.args.rollout_health_check_timeout or 30.0) + 10.0
        try:
            return dict(ray.get(self.engines[i].local_health.remote(), timeout=timeout))
        except GetTimeoutError:
            raise ActorUnanswered(f"its actor did not answer within {timeout:g} s") from None
        except Exception as exc:  # the actor died (with its node, or its process)
            raise ActorUnanswered(f"its actor is gone: {with_cause(exc)}") from None

    def restart_engine(self, i: int, reason: str, replace_actor: bool) -> None:
        self._restart(i, reason, replace_actor)

    def readd_engine(self, i: int) -> None:
        with self.lock:
            waiting = i in self.awaiting_sync
        if not waiting:
            self.router.add_worker(self.infos[i]["url"])

    def _on_removed(self, url: str, reason: str) -> None:
        """Router callback (its own thread): the engine's diagnosis, then its restart or the failure."""
        i = self._index_of(url)
        if i is not None:
            self.recovery.on_removed(i, reason)

    def _replace_actor(self, i: int) -> tuple[dict[str, Any], str]:
        """A new actor for engine i: in its bundle while the bundle's node lives, else on any alive node."""
        import ray

        from miles.rollout.engines.relocation import start_placed

        with contextlib.suppress(Exception):
            ray.kill(self.engines[i], no_restart=True)
        wait = float(self.args.sglang_start_timeout) + _PLACE_SECONDS

        def make(options: dict[str, Any]) -> Any:  # elsewhere than its bundle: the GPUs Ray gives the new actor
            return self._new_actor(i, options, self._gpu_ids[i] if options is self._options[i] else None)

        try:
            actor, info, moved = start_placed(self._options[i], make, lambda h: h.info.remote(), timeout=wait)
        except TimeoutError:
            raise RolloutEngineError(
                f"a new actor for sglang engine {i} did not start within {wait:.0f} s (--sglang-start-timeout plus "
                f"{_PLACE_SECONDS:.0f} s to be placed): no alive node may have its resources free"
            ) from None
        self.engines[i] = actor
        info = dict(info)
        self._check_engine_node(i, info.get("node_id"))
        info["restarts"] = int(self.infos[i].get("restarts", 0)) + 1
        return info, f"a new actor ({moved})" if moved else "a new actor"

    def _restart(self, i: int, reason: str, replace_actor: bool = False) -> None:
        import ray
        from ray.exceptions import RayActorError

        start = time.perf_counter()
        old = self.infos[i]
        how = "its server restarted"
        if replace_actor:
            info, how = self._replace_actor(i)
        else:
            try:
                info = ray.get(self.engines[i].restart.remote())
            except RayActorError:  # the actor died meanwhile
                info, how = self._replace_actor(i)
        self.infos[i] = info
        restored = "checkpoint weights (no sync yet)"
        if self.last_sync is not None and self.last_sync[0] == "ipc":
            # the last sync passed handles to memory the trainer has freed: nothing to replay here
            with self.lock:
                self.awaiting_sync.add(i)
            restored = "out of the router until the next (in-place) weight sync gives it the trained weights"
        elif self.last_sync is not None:
            verified = self._apply_sync([i], *self.last_sync)
            restored = f"weights of the last sync restored and verified ({verified} tensors)"
        if i not in self.awaiting_sync:
            self.router.add_worker(info["url"])
        seconds = time.perf_counter() - start
        self.restart_log.append(
            {"engine": i, "reason": reason, "old_url": old["url"], "new_url": info["url"], "seconds": seconds}
        )
        print(
            f"miles: restarted sglang engine {i} ({how}): {old['url']} (pid {old['pid']}) -> {info['url']} "
            f"(pid {info['pid']}) in {seconds:.1f} s; {restored}",
            flush=True,
        )

    def _raise_failures(self) -> None:
        line = self.recovery.first_failure()
        if line is not None:
            raise RolloutEngineError(line)

    def offload(self) -> float:
        import ray

        return sum(r["bytes"] for r in ray.get([engine.offload.remote() for engine in self.engines]))

    def onload(self) -> float:
        import ray

        return sum(r["bytes"] for r in ray.get([engine.onload.remote() for engine in self.engines]))

    def placement_info(self) -> list[dict[str, Any]]:
        import ray

        return ray.get([engine.placement_info.remote() for engine in self.engines])

    def shutdown(self) -> None:
        import ray

        router = getattr(self, "router", None)
        if router is not None:
            router.stop()
        poster = getattr(self, "poster", None)
        if poster is not None:
            poster.shutdown()
        for engine in self.engines:
            with contextlib.suppress(Exception):
                ray.get(engine.shutdown.remote(), timeout=30)

    # ---- rollout ------------------------------------------------------------------------------
    def run(self, requests: list[GenerateRequest], score: bool = True) -> list[Sample]:
        """Generate every request; with `score`, each microgroup's rewards are computed as it arrives."""
        self._raise_failures()
        self.generation_end = None
        samples = asyncio.run(self._run(requests, score))
        self._raise_failures()
        return samples

    async def _run(self, requests: list[GenerateRequest], score: bool) -> list[Sample]:
        cap = int(self.args.sglang_server_concurrency) * len(self.engines)
        semaphore = asyncio.Semaphore(cap)
        async with self.poster as client:
            tasks = [
                self._one(client, semaphore, sub, score) for request in requests for sub in server_requests(request)
            ]
            results = await asyncio.gather(*tasks)
        return [sample for result in results for sample in result]

    async def _one(self, client: Any, semaphore: asyncio.Semaphore, request: GenerateRequest, score: bool) -> Any:
        from miles.rewards.dispatch import score_samples

        payload = rollout_payload(request, self.args.diffusion_generator_device, self.family, self.max_sequence_length)
        url = self.router.url + GENERATE_PATH
        async with semaphore:
            body = await self._post(client, url, payload, request)
        parser = self.parsers[self._next_parser % len(self.parsers)]
        self._next_parser += 1
        samples = await parser.parse.remote(request, body)
        self.generation_end = time.perf_counter()  # the last parsed response marks the end of generation
        if score and not self.args.group_rm and not request.evaluation:
            await score_samples(self.args, samples)
        return samples

    async def _post(self, client: Any, url: str, payload: dict[str, Any], request: GenerateRequest) -> bytes:
        """POST through the router (from `client`, a `posting` poster); while a restart is under way, wait for
        it instead of failing."""
        deadline = time.monotonic() + float(self.args.sglang_start_timeout) + 60.0
        while True:
            resp = await client.post(url, payload)
            body = resp.body
            if resp.status == 200:
                return body
            engine = resp.engine or "the router"
            self._raise_failures()  # an engine already known lost (unreachable, out of restarts): no waiting
            exited = await self._exited_engines()
            if self.args.use_fault_tolerance and time.monotonic() < deadline:
                pending = self.recovery.pending()
                # a dead server: the health checker removes it and restarts it; the request waits for that
                if exited or (resp.status == 503 and (pending or not self.router.workers())):
                    await asyncio.sleep(0.5)
                    continue
            for i, code in exited.items():  # name the dead server, not only the request it broke
                who = self._describe(i)
                self.recovery.record(
                    who,
                    f"{who} failed: its server exited with code {code}. Pass --use-fault-tolerance to restart dead "
                    "engines and go on.",
                )
            self._raise_failures()
            raise RolloutEngineError(
                f"rollout request for prompt {request.prompt!r} (seed {request.seeds[0]}) failed at {engine}: "
                f"HTTP {resp.status}: {body[:500].decode(errors='replace')}"
            )

    async def _exited_engines(self) -> dict[int, int]:
        """Engines whose server process has exited, with its exit code (an actor that does not answer is the
        recovery's to diagnose, not named here)."""
        codes = await asyncio.gather(*(engine.exit_code.remote() for engine in self.engines), return_exceptions=True)
        return {i: code for i, code in enumerate(codes) if isinstance(code, int)}

    # ---- weights ------------------------------------------------------------------------------
    def update_weights(self, state: dict[str, Any], version: int) -> int:
        """Sync `state` (full weights or a LoRA payload; with experts, names start with the expert) to every
        engine and verify every parameter of each synced module there."""
        from miles.models.lora_sync import is_lora_entry
        from miles.rollout.engines.sglang import sync as wsync

        start = time.perf_counter()
        self._raise_failures()
        root = self.root / "weights"
        dtype = _dtype(self.args.diffusion_forward_dtype)
        targets = wsync.sync_targets(self.family)
        expected: dict[str, dict[str, str]] = {}
        if state and all(is_lora_entry(name) for name in state):
            if len(targets) == 1:
                path, alpha = wsync.write_lora_adapter(state, root, version)
                written = {targets[0]: (path, alpha)}
            else:
                written = wsync.write_expert_lora_adapters(state, root, version, targets)
            for target, (path, alpha) in written.items():
                expected[target] = wsync.lora_expected_sha256(
                    self._base_files(target),
                    self._lora_base_sha(target),
                    path,
                    alpha,
                    self._linear_names(target),
                    dtype,
                    self.family,
                )
            adapters = {t: (str(path), alpha) for t, (path, alpha) in written.items()}
            sync: tuple[str, Any] = ("lora", (adapters, f"miles-v{version}", expected))
            files = len(adapters)  # one adapter file per module
        else:
            buffer_bytes = int(self.args.update_weight_buffer_size)  # the shard size of what the engines load
            if len(targets) == 1:
                path = wsync.write_transformer(state, root, version, dtype, buffer_bytes)
            else:
                path, _ = wsync.write_expert_weights(state, root, version, dtype, targets, buffer_bytes)
            for target, tensors in wsync.split_targets(state, targets).items():
                params = self._param_names(target)
                expected[target] = wsync.engine_sha256(
                    {k: v for k, v in tensors.items() if k in params}, dtype, self.family
                )
                # a later LoRA adapter is set on top of these weights
                self._base_sha[target], self._base_dir[target] = expected[target], path / target
            sync = ("disk", (str(path), expected))
            files = sum(len(list((path / target).glob("*.safetensors"))) for target in expected)
        written_at = time.perf_counter()
        verified = self._apply_sync(list(range(len(self.engines))), *sync)
        self.last_sync = sync
        checksums = self._checksums()
        self.sync_metrics = {
            "sync/buckets": float(files),  # the files the engines loaded (full weights: shards of the buffer size)
            "sync/verified_tensors": float(verified),
            "sync/engines": float(len(self.engines)),
            "sync/engines_agree": float(len(set(checksums)) == 1),
            "sync/write_time": written_at - start,
            "sync/engine_time": time.perf_counter() - written_at,
        }
        return len(state)

    def in_place_synced(self, version: int, metrics: dict[str, float]) -> None:
        """The trainer passed every engine the weights of `version` by handle and verified each one
        (`miles.training.in_place_sync`, --colocate): the engines must agree, and one restarted since the
        last sync (it came back with the checkpoint's weights) rejoins the router now."""
        self._raise_failures()
        self.last_sync = ("ipc", version)
        with self.lock:
            rejoin = sorted(self.awaiting_sync)
            self.awaiting_sync.clear()
        for i in rejoin:
            self.router.add_worker(self.infos[i]["url"])
            print(f"miles: sglang engine {i} got the weights of sync {version}; back in the router", flush=True)
        checksums = self._checksums()
        self.sync_metrics = {
            **metrics,
            "sync/engines": float(len(self.engines)),
            "sync/engines_agree": float(len(set(checksums)) == 1),
        }

    def _apply_sync(self, indices: list[int], kind: str, data: Any) -> int:
        """Load one sync into the engines `indices` and verify every parameter of each synced module bit for
        bit; returns the number of tensors verified per engine."""
        import ray

        if kind == "disk":
            path, expected = data
            targets = tuple(expected)
            ray.get([self.engines[i].update_weights_from_disk.remote(path, targets) for i in indices])
        else:
            adapters, nickname, expected = data
            ray.get([self.engines[i].set_lora.remote(adapters, nickname) for i in indices])
            for i in indices:
                for target in adapters:
                    active = ray.get(self.engines[i].active_lora.remote(target))
                    names = [a.get("nickname") for a in active]
                    want = nickname if list(adapters) == ["transformer"] else f"{nickname}-{target}"
                    if names != [want]:
                        raise RolloutEngineError(
                            f"{self._describe(i)} runs LoRA adapters {names} on {target} after set_lora, "
                            f"expected [{want!r}]"
                        )
        try:
            ray.get(
                [
                    self.engines[i].verify_weights.remote(digests, target)
                    for i in indices
                    for target, digests in expected.items()
                ]
            )
        except Exception as exc:
            raise RolloutEngineError(f"weight sync verification failed: {with_cause(exc)}") from None
        return sum(len(digests) for digests in expected.values())

    def _base_files(self, target: str = "transformer") -> list[Path]:
        """The safetensors files of the weights a LoRA adapter goes on: the last full sync's, else the
        checkpoint's (of module `target`)."""
        if target not in self._base_dir:
            from miles.core.inputs import input_path

            self._base_dir[target] = input_path(self.args, self.args.hf_checkpoint) / target
        return sorted(self._base_dir[target].glob("*.safetensors"))

    def _lora_base_sha(self, target: str = "transformer") -> dict[str, str]:
        """Digests of module `target`'s base parameters (sglang's names: renamed, fused modules fused), read
        once from `_base_files(target)`."""
        if target not in self._base_sha:
            from miles.rollout.engines.sglang.sync import files_engine_sha256

            dtype = _dtype(self.args.diffusion_forward_dtype)
            self._base_sha[target] = files_engine_sha256(
                self._base_files(target), self._param_names(target), dtype, self.family
            )
        return self._base_sha[target]

    def _param_names(self, target: str = "transformer") -> frozenset[str]:
        return self._param_layout(target)[0]

    def _linear_names(self, target: str = "transformer") -> frozenset[str]:
        return self._param_layout(target)[1]

    def _param_layout(self, target: str) -> tuple[frozenset[str], frozenset[str]]:
        if target not in self._layouts:
            from miles.core.inputs import input_path
            from miles.rollout.engines.sglang.sync import transformer_layout

            self._layouts[target] = transformer_layout(input_path(self.args, self.args.hf_checkpoint), target)
        return self._layouts[target]

    def _checksums(self) -> list[str]:
        import ray

        from miles.rollout.engines.sglang.sync import sync_targets

        targets = sync_targets(self.family)
        return ray.get([engine.weights_checksum.remote(targets) for engine in self.engines])


def _dtype(name: str) -> Any:
    from miles.models.loading import torch_dtype

    return torch_dtype(name)
