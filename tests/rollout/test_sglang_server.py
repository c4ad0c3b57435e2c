"""The sglang launcher and configuration, no server: the command line, the interpreter lookup, ports,
the log tail, the backend config rules and `find_engine_failure`.
"""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

import pytest

from miles.config.resolve import ResolvedJob, resolve
from miles.core.errors import ConfigError, EngineFailure, find_engine_failure
from miles.rollout.engines.sglang.server import ServerSpec, free_port
from miles.utils.sglang_env import PYTHON_ENV_VAR, gpus_present, resolve_sglang_python


def flag_values(argv: list[str], flag: str) -> list[str]:
    """The values after `flag` (up to the next `--` option); asserts the flag occurs exactly once."""
    assert argv.count(flag) == 1, f"{flag} occurs {argv.count(flag)} times in {argv}"
    start = argv.index(flag) + 1
    end = start
    while end < len(argv) and not argv[end].startswith("--"):
        end += 1
    return argv[start:end]


def job(job_name: str, recipe: str, **cli: Any) -> ResolvedJob:
    return resolve(job_name, recipe=recipe, cli=cli)


def config_error(job_name: str, recipe: str, **cli: Any) -> str:
    with pytest.raises(ConfigError) as excinfo:
        job(job_name, recipe, **cli)
    return str(excinfo.value)


@pytest.fixture
def fake_python(tmp_path: Path) -> Path:
    """An existing file to hand to --sglang-python (only its existence is checked)."""
    path = tmp_path / "env" / "bin" / "python"
    path.parent.mkdir(parents=True)
    path.write_text("#!/bin/sh\n")
    return path


# ---------------------------------------------------------------------------- server


def test_server_command_defaults(tmp_path: Path) -> None:
    python = tmp_path / "bin" / "python"
    spec = ServerSpec(
        python=str(python),
        model_path="/models/tiny-sd3",
        port=30000,
        model_id="stable-diffusion-3-medium-diffusers",
        precision="bf16",
        num_gpus=2,
        warmup=(128, 64),
    )
    argv = spec.command(scheduler_port=31000, master_port=32000)
    assert argv[:3] == [str(python), "-m", "sglang.cli.main"]  # no sglang script next to the python
    assert argv[3:6] == ["serve", "--model-path", "/models/tiny-sd3"]
    assert flag_values(argv, "--host") == ["127.0.0.1"]
    assert flag_values(argv, "--port") == ["30000"]
    assert flag_values(argv, "--scheduler-port") == ["31000"]
    assert flag_values(argv, "--master-port") == ["32000"]
    assert flag_values(argv, "--num-gpus") == ["2"]
    assert flag_values(argv, "--model-id") == ["stable-diffusion-3-medium-diffusers"]
    assert flag_values(argv, "--dit-precision") == ["bf16"]
    assert flag_values(argv, "--text-encoder-precisions") == ["bf16"] * 3
    assert flag_values(argv, "--vae-precision") == ["fp32"]
    assert flag_values(argv, "--vae-tiling") == ["false"]
    assert flag_values(argv, "--warmup-resolutions") == ["128x64"]
    assert spec.url == "http://127.0.0.1:30000"


def test_server_command_without_model_id_or_warmup(tmp_path: Path) -> None:
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "python").write_text("")
    (bindir / "sglang").write_text("")
    spec = ServerSpec(python=str(bindir / "python"), model_path="/m", precision="fp8")
    argv = spec.command(scheduler_port=1, master_port=2)
    assert argv[:4] == [str(bindir / "sglang"), "serve", "--model-path", "/m"]  # the env's sglang script
    assert "--model-id" not in argv
    assert "--warmup-resolutions" not in argv
    assert flag_values(argv, "--dit-precision") == ["fp32"]  # an unknown precision falls back to fp32


def test_server_command_passthrough_overrides_the_defaults() -> None:
    spec = ServerSpec(
        python="/nowhere/python",
        model_path="/m",
        port=5,
        warmup=(64, 64),
        passthrough={
            "vae_tiling": True,
            "warmup_resolutions": ["64x64", "128x128"],
            "attention_backend": "fa3",
            "enable_torch_compile": False,
            "dit_precision": "fp16",
        },
    )
    argv = spec.command(scheduler_port=7, master_port=8)
    assert flag_values(argv, "--vae-tiling") == []  # True: the bare flag (store_true flags take no value)
    assert "--vae-tiling" in argv
    assert flag_values(argv, "--warmup-resolutions") == ["64x64", "128x128"]
    assert flag_values(argv, "--attention-backend") == ["fa3"]
    assert flag_values(argv, "--enable-torch-compile") == ["false"]
    assert flag_values(argv, "--dit-precision") == ["fp16"]


def test_resolve_sglang_python_with_an_explicit_path(tmp_path: Path, fake_python: Path) -> None:
    assert resolve_sglang_python(str(tmp_path / "missing" / "python")) is None
    assert resolve_sglang_python(str(tmp_path)) is None  # a directory is no interpreter
    assert resolve_sglang_python(str(fake_python)) == str(fake_python)


def test_resolve_sglang_python_reads_the_environment_variable(
    fake_python: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(PYTHON_ENV_VAR, str(fake_python))
    assert resolve_sglang_python(None) == str(fake_python)
    assert resolve_sglang_python("") == str(fake_python)


def test_no_gpus_when_cuda_visible_devices_is_empty(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert gpus_present() is False


def test_free_port_pair() -> None:
    port = free_port(pair=True)
    assert 1024 <= port < 65535
    with socket.socket() as first, socket.socket() as second:
        first.bind(("127.0.0.1", port))
        second.bind(("127.0.0.1", port + 1))


def test_free_port_single() -> None:
    port = free_port()
    assert 1024 <= port <= 65535
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))  # raises if the port is taken
        assert sock.getsockname() == ("127.0.0.1", port)


# ---------------------------------------------------------------------------- config rules


def test_auto_backend_is_diffusers_without_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    args = job("rl", "tiny-digits-grpo", rollout_backend="auto").args
    assert (args.rollout_backend, args.source_of("rollout_backend")) == ("diffusers", "derived")
    assert args.use_miles_router is False


def test_auto_backend_on_this_machine() -> None:
    args = job("rl", "tiny-digits-grpo", rollout_backend="auto").args
    expected = "sglang" if resolve_sglang_python(None) is not None and gpus_present() else "diffusers"
    assert (args.rollout_backend, args.source_of("rollout_backend")) == (expected, "derived")


def test_an_explicit_diffusers_backend_stays_cli() -> None:
    args = job("rl", "tiny-digits-grpo", rollout_backend="diffusers").args
    assert (args.rollout_backend, args.source_of("rollout_backend")) == ("diffusers", "cli")


def test_sglang_with_a_missing_python_names_the_flag(tmp_path: Path) -> None:
    missing = tmp_path / "nonexistent"
    message = config_error("rl", "tiny-digits-grpo", rollout_backend="sglang", sglang_python=str(missing))
    assert "--sglang-python" in message
    assert str(missing) in message
    assert "no such file" in message


def test_sglang_is_rejected_for_dmd2(fake_python: Path) -> None:
    message = config_error("dmd2", "tiny-digits-4step", rollout_backend="sglang", sglang_python=str(fake_python))
    assert "train dmd2" in message
    assert "--rollout-backend" in message


def test_sglang_derives_the_miles_router(fake_python: Path) -> None:
    args = job("rl", "tiny-digits-grpo", rollout_backend="sglang", sglang_python=str(fake_python)).args
    assert (args.rollout_backend, args.source_of("rollout_backend")) == ("sglang", "cli")
    assert (args.use_miles_router, args.source_of("use_miles_router")) == (True, "derived")


def test_sglang_with_the_router_turned_off_is_rejected(fake_python: Path) -> None:
    message = config_error(
        "rl", "tiny-digits-grpo", rollout_backend="sglang", sglang_python=str(fake_python), use_miles_router=False
    )
    assert "--use-miles-router" in message
    assert "miles router" in message


def test_rollout_num_engines_sets_the_engine_count() -> None:
    from miles.placement.plan import num_engines

    args = job("rl", "tiny-digits-grpo", rollout_num_engines=3).args
    assert args.rollout_num_engines == 3
    assert num_engines(args) == 3


# ---------------------------------------------------------------------------- find_engine_failure


class EngineDied(EngineFailure):
    pass


class FakeRayTaskError(Exception):
    """Like Ray's task error: the original exception kept as `.cause`."""

    def __init__(self, text: str, cause: BaseException | None) -> None:
        super().__init__(text)
        self.cause = cause


def test_engine_failure_itself() -> None:
    assert find_engine_failure(EngineDied("engine 1 (pid 42) died")) == "engine 1 (pid 42) died"


def test_engine_failure_as_cause_attribute() -> None:
    wrapped = FakeRayTaskError("ray: task failed\nTraceback ...", EngineDied("engine 2 at http://h:1 died"))
    assert find_engine_failure(wrapped) == "engine 2 at http://h:1 died"


def test_engine_failure_two_levels_down() -> None:
    inner = FakeRayTaskError("inner", EngineDied("engine 0 hung"))
    assert find_engine_failure(FakeRayTaskError("outer", inner)) == "engine 0 hung"


def test_engine_failure_via_dunder_cause() -> None:
    try:
        try:
            raise EngineDied("engine 3 exited with code 1")
        except EngineDied as exc:
            raise RuntimeError("rollout failed") from exc
    except RuntimeError as outer:
        assert find_engine_failure(outer) == "engine 3 exited with code 1"


def test_engine_failure_text_marker() -> None:
    text = "ActorDiedError: the actor died\nTraceback:\n  ...\nRolloutEngineError: engine 4 never got healthy\nmore"
    assert find_engine_failure(RuntimeError(text)) == "engine 4 never got healthy"


def test_unrelated_errors_are_no_engine_failure() -> None:
    assert find_engine_failure(ValueError("bad value")) is None
    assert find_engine_failure(FakeRayTaskError("task failed", ValueError("bad"))) is None
    cyclic = RuntimeError("a")
    other = RuntimeError("b")
    cyclic.__cause__, other.__cause__ = other, cyclic
    assert find_engine_failure(cyclic) is None


def test_server_command_sleeps_on_idle_only_when_asked() -> None:
    cpu = ServerSpec(python="/nowhere/python", model_path="/m", port=5, sleep_on_idle=True)
    gpu = ServerSpec(python="/nowhere/python", model_path="/m", port=5)
    assert flag_values(cpu.command(scheduler_port=7, master_port=8), "--sleep-on-idle") == []
    assert "--sleep-on-idle" not in gpu.command(scheduler_port=7, master_port=8)


def test_log_tail_keeps_the_last_start_and_its_errors_first(tmp_path: Path) -> None:
    from miles.rollout.engines.sglang.server import SglangServer

    server = SglangServer(ServerSpec(python="/nowhere/python", model_path="/m", name="engine 3"), tmp_path)
    lines = ["$ first start", "ERROR: old failure", "$ second start"]
    lines += [f"line {i}" for i in range(30)]
    lines += ["ERROR:    [Errno 98] error while attempting to bind on address: address already in use"]
    lines += ["warnings.warn(noise)", "kill_process_tree called"]
    server.log_path.write_text("\n".join(lines) + "\n")
    tail = server.log_tail(lines=5).splitlines()
    assert tail[0].endswith("address already in use")
    assert "old failure" not in "\n".join(tail) and "warnings.warn" not in "\n".join(tail)
    assert tail[-1] == "kill_process_tree called" and len(tail) == 6
    from miles.rollout.engines.failure_text import with_cause

    exc = RuntimeError("sglang engine 3 exited with code 1 while starting (log x):\n" + "\n".join(tail))
    assert with_cause(exc).endswith("address already in use")
    assert with_cause(exc).startswith("sglang engine 3 exited with code 1")


def test_sglang_without_gpus_keeps_its_weights_under_colocate(
    fake_python: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # no GPU, whatever the machine has
    resolved = job("rl", "tiny-digits-grpo", rollout_backend="sglang", sglang_python=str(fake_python), colocate=True)
    assert resolved.args.offload_rollout is False and resolved.args.sources()["offload_rollout"] == "derived"
    assert resolved.args.offload_train is True  # the trainer still sleeps between phases
    assert any("/release_memory_occupation, which needs CUDA" in w for w in resolved.warnings)
    message = config_error(
        "rl", "tiny-digits-grpo", rollout_backend="sglang", sglang_python=str(fake_python), offload_rollout=True
    )
    assert message.startswith("--offload-rollout on (cli): sglang releases an engine's GPU memory")


def test_a_server_that_exits_reports_its_exit_code(tmp_path: Path) -> None:
    """What a failed rollout request checks to name a dead engine: the process's exit code, None while it runs."""
    from miles.rollout.engines.sglang.server import SglangServer

    bin_dir = tmp_path / "env" / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "python").write_text("")
    launcher = bin_dir / "sglang"  # stands in for sglang's launcher: sleeps, or exits with code 3
    launcher.write_text('#!/bin/sh\n[ -e "$0.exit" ] && exit 3\nexec sleep 30\n')
    launcher.chmod(0o755)
    spec = ServerSpec(python=str(bin_dir / "python"), model_path=str(tmp_path))
    running = SglangServer(spec, tmp_path / "logs")
    assert running.exit_code() is None and not running.alive()  # not started
    running.start()
    try:
        assert running.exit_code() is None and running.alive()
    finally:
        running.stop(grace=2.0)
    assert running.exit_code() is not None and not running.alive()
    (bin_dir / "sglang.exit").write_text("")
    exiting = SglangServer(ServerSpec(python=str(bin_dir / "python"), model_path=str(tmp_path)), tmp_path / "logs")
    exiting.start()
    assert exiting.proc is not None and exiting.proc.wait(timeout=10) == 3
    assert exiting.exit_code() == 3 and not exiting.alive()
