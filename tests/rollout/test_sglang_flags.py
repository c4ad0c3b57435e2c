"""The sglang engines' serving flags where miles reads them, without a server (fast):

  --rollout-engine-host, --sglang-start-timeout   each engine's server address and how long its start may take
  --sglang-server-concurrency, --miles-router-timeout, --miles-router-max-connections,
  --miles-router-health-check-failure-threshold  the miles router's settings (its behaviour under each setting is
                                                 tests/rollout/test_router.py's)
  --rollout-parser-num-workers                    how many Ray actors decode the responses

`SglangRollout` is built with stand-ins for Ray, the engine actors, the router and the poster; the real
`RouterConfig` records what the router would run with.
"""

from __future__ import annotations

import sys
import types
from pathlib import Path
from typing import Any, ClassVar

import pytest

from miles.config.resolve import resolve
from miles.rollout.engines.sglang import engine as engine_module
from miles.rollout.engines.sglang import rollout as rollout_module
from miles.rollout.engines.sglang.engine import SglangEngine, server_spec


def args_with(**cli: Any) -> Any:
    return resolve("rl", recipe="tiny-digits-grpo", cli=cli).args


class FakeServer:
    def __init__(self) -> None:
        self.timeouts: list[float] = []

    def start(self) -> None:
        pass

    def wait_ready(self, timeout: float) -> float:
        self.timeouts.append(timeout)
        return 1.5


def test_engine_serves_on_the_host_and_waits_the_start_timeout() -> None:
    from miles.utils.net import primary_ip

    args = args_with(rollout_engine_host="0.0.0.0", sglang_start_timeout=42)
    spec = server_spec(args, "engine 0", "python", "/models/tiny-sd3", {})
    spec.port = 30000
    command = spec.command(30001, 30002)
    assert command[command.index("--host") + 1] == "0.0.0.0"  # binds every interface
    assert spec.url == f"http://{primary_ip()}:30000"  # and is advertised on the node's own address
    assert spec.local_url == "http://127.0.0.1:30000"  # where its actor reaches it
    engine = SglangEngine.__new__(SglangEngine)
    engine.args, engine.spec, engine.server = args, spec, FakeServer()
    assert engine._launch() == 1.5 and engine.server.timeouts == [42.0]
    default = server_spec(args_with(), "engine 0", "python", "/models/tiny-sd3", {})
    assert args_with().rollout_engine_host == "auto"
    # auto on a one-node cluster (here: no Ray at all): loopback, reachable from this machine only
    assert (default.host, default.advertise_host) == ("127.0.0.1", "127.0.0.1")


class Recorder:
    """`ray.remote(cls).options(...).remote(*args)`, `actor.options(...).remote(*args)` and `x.info.remote()`."""

    def __init__(self, made: list, info: dict[str, Any] | None = None) -> None:
        self.made, self.info_value = made, info

    def options(self, **kwargs: Any) -> Recorder:
        return self

    def remote(self, *args: Any, _miles_tag: Any = None) -> Recorder:
        self.made.append(args)
        return Recorder(self.made, self.info_value)

    @property
    def info(self) -> Any:
        return types.SimpleNamespace(remote=lambda: self.info_value)


class FakeRouter:
    configs: ClassVar[list[Any]] = []

    def __init__(self, config: Any, on_engine_removed: Any) -> None:
        FakeRouter.configs.append(config)
        self.workers: list[str] = []

    def start(self) -> None:
        pass

    def add_worker(self, url: str) -> None:
        self.workers.append(url)


@pytest.fixture
def stand_ins(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> dict[str, list]:
    made: dict[str, list] = {"engines": [], "parsers": [], "posters": []}
    ray = types.ModuleType("ray")
    ray.is_initialized = lambda: False  # type: ignore[attr-defined]
    ray.get = lambda ref, **kwargs: ref  # type: ignore[attr-defined]
    ray.remote = lambda cls: Recorder(made["parsers"])  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "ray", ray)
    info = {"url": "http://127.0.0.1:30000", "pid": 1, "log": "log", "start_seconds": 1.0}
    monkeypatch.setattr(engine_module, "engine_actor_class", lambda: Recorder(made["engines"], info))
    monkeypatch.setattr("miles.utils.sglang_env.resolve_sglang_python", lambda explicit: "python")
    monkeypatch.setattr("miles.core.inputs.input_path", lambda args, value: tmp_path)
    monkeypatch.setattr("miles.models.tiny.metadata.max_sequence_length", lambda path, default: default)
    monkeypatch.setattr("miles.rollout.engines.sglang.router.MilesRouter", FakeRouter)
    monkeypatch.setattr(rollout_module, "served_checkpoint", lambda path, shift, root: path)
    monkeypatch.setattr(rollout_module, "make_poster", lambda args, **kwargs: made["posters"].append(kwargs))
    FakeRouter.configs = []
    return made


def test_router_and_parsers_follow_the_flags(stand_ins: dict[str, list]) -> None:
    args = args_with(
        sglang_server_concurrency=3,
        miles_router_timeout=7.5,
        miles_router_max_connections=11,
        miles_router_health_check_failure_threshold=4,
        rollout_parser_num_workers=3,
    )
    rollout_module.SglangRollout(args, 2)
    (config,) = FakeRouter.configs
    assert (config.concurrency, config.timeout, config.max_connections, config.failure_threshold) == (3, 7.5, 11, 4)
    assert len(stand_ins["engines"]) == 2 and len(stand_ins["parsers"]) == 3  # one parser actor per worker
    assert stand_ins["posters"] == [{"max_concurrency": 6}]  # the concurrency cap over both engines

    FakeRouter.configs.clear()
    rollout_module.SglangRollout(args_with(), 1)
    (config,) = FakeRouter.configs
    assert (config.concurrency, config.timeout, config.max_connections) == (
        args_with().sglang_server_concurrency,
        None,
        None,
    )  # the defaults: no request timeout and no connection cap


# ---------------------------------------------------------------------------- --rollout-engine-host


def _multi_node(monkeypatch: pytest.MonkeyPatch, nodes: int = 3, ip: str = "10.1.2.3", node: str = "node-a") -> None:
    """What `addresses` reads from Ray on a cluster of `nodes` alive nodes, this process on `node` at `ip`."""
    from miles.rollout.engines import addresses

    monkeypatch.setattr(addresses, "alive_nodes", lambda: nodes)
    monkeypatch.setattr(addresses, "node_ip", lambda: ip)
    monkeypatch.setattr(addresses, "node_id", lambda: node)


def test_the_router_binds_and_advertises_what_the_engine_host_says(
    stand_ins: dict[str, list], monkeypatch: pytest.MonkeyPatch
) -> None:
    rollout_module.SglangRollout(args_with(), 1)  # auto on one node (no Ray here): loopback
    (config,) = FakeRouter.configs
    assert (config.host, config.advertise_host) == ("127.0.0.1", "127.0.0.1")

    _multi_node(monkeypatch)
    FakeRouter.configs.clear()
    rollout_module.SglangRollout(args_with(), 1)  # auto on three nodes: the node's own address
    rollout_module.SglangRollout(args_with(rollout_engine_host="0.0.0.0"), 1)  # every interface, told the node's IP
    auto, wildcard = FakeRouter.configs
    assert (auto.host, auto.advertise_host) == ("10.1.2.3", "10.1.2.3")
    assert (wildcard.host, wildcard.advertise_host) == ("0.0.0.0", "10.1.2.3")


def test_an_explicit_loopback_with_an_engine_on_another_node_is_one_line(
    stand_ins: dict[str, list], monkeypatch: pytest.MonkeyPatch
) -> None:
    from miles.core.errors import ConfigError

    _multi_node(monkeypatch)
    info = {"url": "http://127.0.0.1:30000", "pid": 1, "log": "log", "start_seconds": 1.0, "node_id": "node-b"}
    monkeypatch.setattr(engine_module, "engine_actor_class", lambda: Recorder(stand_ins["engines"], info))
    with pytest.raises(ConfigError) as excinfo:
        rollout_module.SglangRollout(args_with(rollout_engine_host="127.0.0.1"), 1)
    message = str(excinfo.value)
    assert "\n" not in message
    assert message.startswith("--rollout-engine-host 127.0.0.1: sglang engine 0 runs on node node-b but the miles ")
    assert "router on node node-a" in message and "--rollout-engine-host auto" in message
    rollout_module.SglangRollout(args_with(), 1)  # auto: each node binds its own address, nothing to refuse

    class Placement:  # the plan knows the engine's node before it starts: refused before any actor exists
        def slots(self, role: str) -> list[str]:
            return ["slot"]

        def options(self, slot: str) -> dict[str, Any]:
            return {}

        def gpu_ids(self, slot: str) -> list[int]:
            return []

        def node_id(self, slot: str) -> str:
            return "node-c"

    stand_ins["engines"].clear()
    with pytest.raises(ConfigError, match=r"^--rollout-engine-host localhost: sglang engine 0 runs on node node-c"):
        rollout_module.SglangRollout(args_with(rollout_engine_host="localhost"), 1, Placement())
    assert stand_ins["engines"] == []


def test_distributed_post_refuses_a_loopback_router_on_several_nodes(
    stand_ins: dict[str, list], monkeypatch: pytest.MonkeyPatch
) -> None:
    from miles.core.errors import ConfigError

    args = args_with(rollout_engine_host="127.0.0.1")
    args.use_distributed_post = True  # (resolution refuses it with the diffusers backend this machine resolves)
    rollout_module.SglangRollout(args, 1)  # one node: every poster is on the router's host
    _multi_node(monkeypatch)
    with pytest.raises(ConfigError, match=r"--use-distributed-post posts to the miles router from all 3 alive nodes"):
        rollout_module.SglangRollout(args, 1)
