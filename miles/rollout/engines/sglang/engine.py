"""One sglang-diffusion engine: a Ray actor that owns a server process and speaks its admin endpoints.

The actor is placed like the diffusers engine (`--rollout-num-gpus-per-engine` GPUs on a GPU cluster,
none on a CPU machine) and pins its server to the GPUs Ray gave it. Rollout traffic does not go
through the actor: the client posts `/rollout/generate` to the miles router, which forwards to the
server's URL. The actor handles what is per engine: start, health, restart, weight updates and their
verification.

The server binds `--rollout-engine-host` as this actor resolves it on its own node (`addresses.py`) and is known
to the others by its advertised URL (`info()["url"]`); the actor's own admin requests and its local health check
(`local_health`, what the manager asks when the router cannot reach the server) use the server's own host.
"""

from __future__ import annotations

import os
import time
from typing import Any

import requests

from miles.rollout.engines.sglang.protocol import engine_family
from miles.rollout.engines.sglang.schedule import flow_shift_options
from miles.rollout.engines.sglang.server import ServerSpec, SglangServer, health_problem, server_precision


class EngineRequestError(RuntimeError):
    """An admin request to an engine failed; the message names the engine and the endpoint."""


class SglangEngine:
    """Launches the server in __init__ (returns once `/health` is 200)."""

    def __init__(
        self, args: Any, index: int, python: str, model_path: str, log_dir: str, gpu_ids: list[int] | None = None
    ) -> None:
        self.args = args
        self.index = index
        self.name = f"engine {index}"
        from miles.rollout.engines.addresses import node_ip

        self.spec = server_spec(args, self.name, python, model_path, _engine_env(args, gpu_ids))
        self.node_ip = node_ip()
        self.server = SglangServer(self.spec, log_dir)
        self.restarts = 0
        self.start_seconds = self._launch()

    def _launch(self, attempts: int = 3) -> float:
        """Start the server; a port another process took between choosing and binding it (several
        engines pick free ports at once) means a retry on fresh ports."""
        from miles.rollout.engines.sglang.server import EngineStartError

        for attempt in range(attempts):
            self.server.start()
            try:
                return self.server.wait_ready(timeout=float(self.args.sglang_start_timeout))
            except EngineStartError as exc:
                if "address already in use" not in str(exc) or attempt == attempts - 1:
                    raise
                self.server.stop(grace=2.0)
                self.spec.port = 0
        raise AssertionError("unreachable")

    # ---- identity and health --------------------------------------------------------------------
    def info(self) -> dict[str, Any]:
        from miles.rollout.engines.addresses import node_id

        return {
            "name": self.name,
            "url": self.spec.url,  # advertised: what the router and the manager use
            "local_url": self.spec.local_url,
            "bind": self.spec.host,
            "node_ip": self.node_ip,
            "node_id": node_id(),
            "pid": self.server.pid,
            "log": str(self.server.log_path),
            "start_seconds": self.start_seconds,
            "restarts": self.restarts,
        }

    def placement_info(self) -> dict[str, Any]:
        from miles.placement.ray_placement import actor_placement_info

        info = actor_placement_info("server")
        info["server_cuda_visible_devices"] = self.spec.env.get("CUDA_VISIBLE_DEVICES")
        return info

    def exit_code(self) -> int | None:
        return self.server.exit_code()

    def health(self) -> bool:
        return self.server.alive() and self.server.healthy(timeout=float(self.args.rollout_health_check_timeout))

    def local_health(self) -> dict[str, Any]:
        """The server as seen from its own host: process alive, and `GET /health` on its own address (what the
        manager asks when it cannot reach the server itself)."""
        return check_locally(
            self.spec.local_url,
            self.server.exit_code(),
            self.node_ip,
            float(self.args.rollout_health_check_timeout or 30.0),
            started=self.server.proc is not None,
        )

    def restart(self) -> dict[str, Any]:
        """Stop what is left of the server and start a new one on a fresh port."""
        self.server.stop(grace=2.0)
        self.spec.port = 0
        self.restarts += 1
        self.start_seconds = self._launch()
        return self.info()

    def shutdown(self) -> None:
        self.server.stop()

    # ---- weights --------------------------------------------------------------------------------
    def _post(self, path: str, body: dict[str, Any], timeout: float = 600.0) -> dict[str, Any]:
        try:
            resp = requests.post(self.spec.local_url + path, json=body, timeout=timeout)
        except requests.RequestException as exc:
            raise EngineRequestError(f"sglang {self.name} at {self.spec.url}: POST {path} failed: {exc}") from exc
        try:
            data = resp.json()
        except ValueError:
            data = {"message": resp.text[:500]}
        if resp.status_code != 200 or data.get("success") is False or data.get("status") == "error":
            raise EngineRequestError(
                f"sglang {self.name} at {self.spec.url}: POST {path} answered {resp.status_code}: "
                f"{data.get('message') or data.get('detail') or data}"
            )
        return data

    # ---- offload between phases (--offload-rollout) ---------------------------------------------
    def offload(self) -> dict[str, float]:
        """The server releases its GPU memory (`/release_memory_occupation`: its modules go to pinned CPU
        memory) until `onload`; sglang reports no byte count."""
        start = time.perf_counter()
        self._post("/release_memory_occupation", {})
        return {"bytes": 0.0, "seconds": time.perf_counter() - start}

    def onload(self) -> dict[str, float]:
        start = time.perf_counter()
        self._post("/resume_memory_occupation", {})
        return {"bytes": 0.0, "seconds": time.perf_counter() - start}

    def update_weights_from_disk(self, model_path: str, targets: tuple[str, ...] = ("transformer",)) -> float:
        """Load `<model_path>/<target>/*.safetensors` into each served module `targets` (the transformer; Wan2.2's
        two experts at once); seconds it took."""
        from miles.rollout.engines.sglang.sync import disk_update_body

        start = time.perf_counter()
        self._post("/update_weights_from_disk", disk_update_body(model_path, tuple(targets)))
        return time.perf_counter() - start

    def update_weights_from_ipc(self, payload: str, lora_alpha: int | None = None) -> float:
        """Load one bucket passed by handle (`miles.models.weight_ipc.serialize_b64`, --colocate) through
        `/update_weights_from_tensor`; with `lora_alpha` the bucket holds `<module>.lora_A|lora_B` pairs that
        the server merges into its transformer (`weight_update_mode="lora_merge"`). Seconds it took."""
        start = time.perf_counter()
        body: dict[str, Any] = {
            "serialized_named_tensors": [payload],
            "load_format": "flattened_bucket",
            "target_modules": ["transformer"],
        }
        if lora_alpha is not None:
            body.update(weight_update_mode="lora_merge", lora_alpha=int(lora_alpha))
        self._post("/update_weights_from_tensor", body)
        return time.perf_counter() - start

    def set_lora(self, adapters: dict[str, tuple[str, int]], nickname: str) -> float:
        """Activate the diffusers-format adapters `{target: (path, lora_alpha)}` (the transformer's; with
        experts one per expert), merged into the weights (`sync.set_lora_body`)."""
        from miles.rollout.engines.sglang.sync import set_lora_body

        start = time.perf_counter()
        self._post("/v1/set_lora", set_lora_body(adapters, nickname))
        return time.perf_counter() - start

    def active_lora(self, target: str = "transformer") -> list[dict[str, Any]]:
        resp = requests.get(self.spec.local_url + "/v1/list_loras", timeout=60)
        if resp.status_code != 200:
            return []
        return list((resp.json().get("active") or {}).get(target) or [])

    def verify_weights(self, expected_sha256: dict[str, str], target: str = "transformer") -> str:
        """Ask the server to compare the live tensors of module `target` with `expected_sha256` (per tensor:
        dtype, shape and bytes); raises naming the tensors that differ."""
        from miles.rollout.engines.sglang.sync import checker_body

        data = self._post("/update_weights_from_tensor_checker", checker_body(expected_sha256, target))
        return str(data.get("message", ""))

    def weights_checksum(self, targets: tuple[str, ...] = ("transformer",)) -> str:
        resp = requests.post(
            self.spec.local_url + "/get_weights_checksum", json={"module_names": list(targets)}, timeout=60
        )
        resp.raise_for_status()
        data = resp.json()
        return ",".join(str(data.get(t)) for t in targets)


def server_spec(args: Any, name: str, python: str, model_path: str, env: dict[str, str]) -> ServerSpec:
    """What a job's engine server is started with (`server.py` lists what miles sets)."""
    from miles.rollout.engines.addresses import serving_address
    from miles.utils.sglang_env import gpus_present

    family = engine_family(args)
    precision = server_precision(args.diffusion_forward_dtype)
    address = serving_address(args.rollout_engine_host)  # resolved here, on the engine's own node
    return ServerSpec(
        python=python,
        model_path=model_path,
        host=address.bind,
        advertise_host=address.advertised,
        model_id=None if (args.sglang_args or {}).get("model_id") else family.sglang_model_id,
        precision=args.diffusion_forward_dtype,
        family_options={
            **family.sglang_server_options(precision, float(args.diffusion_guidance_scale)),
            **flow_shift_options(args.diffusion_flow_shift),  # --flow-shift: the generation schedule's shift
        },
        num_gpus=int(args.rollout_num_gpus_per_engine),
        warmup=(int(args.diffusion_width), int(args.diffusion_height)),
        passthrough=dict(args.sglang_args or {}),
        env={**family.sglang_server_env, **env},
        sleep_on_idle=not gpus_present(),
        name=name,
    )


def _engine_env(args: Any, gpu_ids: list[int] | None = None) -> dict[str, str]:
    """Pin the server to the engine's GPUs (the plan's, which for a colocated engine over several GPUs are
    more than the one Ray accounts it on; else the actor's own); on a machine without GPUs share the cores
    between the engines."""
    from miles.utils.sglang_env import gpus_present

    env: dict[str, str] = {}
    if gpu_ids is None:
        try:
            import ray

            gpu_ids = [int(g) for g in ray.get_gpu_ids()] if ray.is_initialized() else []
        except Exception:  # pragma: no cover - outside Ray
            gpu_ids = []
    if gpu_ids:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(int(g)) for g in gpu_ids)
    if not gpus_present():
        engines = max(1, int(args.rollout_num_engines or 1))
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // engines))
    return env


def engine_actor_class() -> Any:
    from miles.utils.actors import owned_remote

    return owned_remote(SglangEngine)


def check_locally(
    local_url: str, exit_code: int | None, node_ip: str, timeout: float, started: bool = True
) -> dict[str, Any]:
    """What an engine's actor reports of its server (`SglangEngine.local_health`): `healthy` when the process runs
    (`exit_code` None) and `GET <local_url>/health` answers 200; `detail` says what is wrong otherwise."""
    if exit_code is not None or not started:
        detail = f"its server exited with code {exit_code}" if started else "its server was never started"
        return {"alive": False, "healthy": False, "detail": detail, "node_ip": node_ip, "local_url": local_url}
    problem = health_problem(local_url, timeout)
    return {
        "alive": True,
        "healthy": problem is None,
        "detail": "healthy" if problem is None else f"its server runs but {problem} on its own host ({local_url})",
        "node_ip": node_ip,
        "local_url": local_url,
    }
