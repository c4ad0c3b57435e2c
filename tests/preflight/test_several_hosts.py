"""The several-hosts check: a job joining the Ray cluster at $RAY_ADDRESS is told, in one warning line each, which
path flags every host must share and that this host's name resolves to loopback; nothing without $RAY_ADDRESS, and
nothing is ever refused."""

from __future__ import annotations

import re
import socket
from pathlib import Path

import pytest
from preflight_helpers import Job, digit_prompts, make_pipeline, write_lines

from miles.preflight import PreflightWarning, passed_line, run_checks
from miles.preflight.several_hosts import check_several_hosts

ADDRESS = "10.0.0.1:6379"
_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def _host_address(monkeypatch: pytest.MonkeyPatch, address: str | None) -> None:
    """What this host's name resolves to (None: it does not resolve)."""

    def resolve(name: str) -> str:
        if address is None:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return address

    monkeypatch.setattr(socket, "gethostbyname", resolve)


def _shared(flags: str) -> str:
    return (
        f"the job joins the Ray cluster at RAY_ADDRESS={ADDRESS}, whose actors run on its other hosts too: {flags} "
        "must be on a filesystem every host shares (the same absolute path on each)"
    )


LOOPBACK = (
    "this host's name resolves to 127.0.1.1 (loopback); miles gives gloo each node's own interface "
    "(GLOO_SOCKET_IFNAME); set it in --train-env-vars if your nodes need another"
)


def test_quiet_without_ray_address(
    job: Job, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _host_address(monkeypatch, "127.0.1.1")
    resolved = job("rl", save=str(tmp_path / "ckpt"))
    assert check_several_hosts(resolved) == []
    report = run_checks(resolved)
    assert (report.problems, report.warned, report.warnings) == ([], [], 0)
    assert "warning" not in capsys.readouterr().err


def test_the_shared_paths_of_the_job_in_one_line(job: Job, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _host_address(monkeypatch, "10.0.0.2")
    monkeypatch.setenv("RAY_ADDRESS", ADDRESS)
    monkeypatch.chdir(tmp_path)
    data = write_lines(tmp_path / "prompts.jsonl", digit_prompts(8))
    pipeline = make_pipeline(tmp_path / "sd3-pipeline")
    resolved = job("rl", save="ckpt", load="ckpt", prompt_data=str(data), hf_checkpoint=str(pipeline))
    (line,) = check_several_hosts(resolved)
    assert isinstance(line, PreflightWarning)
    assert line == _shared("--output-dir, --save, --load, --prompt-data, --hf-checkpoint")


def test_built_in_names_are_built_on_each_host(job: Job, monkeypatch: pytest.MonkeyPatch) -> None:
    """tiny-digits-grpo reads a built-in model and built-in data sets: only its output folder is shared."""
    _host_address(monkeypatch, "10.0.0.2")
    monkeypatch.setenv("RAY_ADDRESS", ADDRESS)
    assert check_several_hosts(job("rl")) == [_shared("--output-dir")]


def test_the_dumps_and_the_eval_sets(job: Job, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _host_address(monkeypatch, "10.0.0.2")
    monkeypatch.setenv("RAY_ADDRESS", ADDRESS)
    monkeypatch.chdir(tmp_path)
    evals = write_lines(tmp_path / "eval.jsonl", digit_prompts(4))
    resolved = job("rl", dump_details="dumps", eval_prompt_data=["mine", str(evals)])
    assert check_several_hosts(resolved) == [_shared("--output-dir, --dump-details, --eval-prompt-data")]


def test_sglang_engines_read_their_python_and_the_sync_folder(
    job: Job, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _host_address(monkeypatch, "10.0.0.2")
    monkeypatch.setenv("RAY_ADDRESS", ADDRESS)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "python").write_text("")  # what --sglang-python names (the config checks it is a file)
    resolved = job("rl", rollout_backend="sglang", sglang_python="python")
    assert resolved.args.sglang_python == str(tmp_path / "python")
    flags = "--output-dir (with the sglang engines' weight-sync folder), --sglang-python"
    assert check_several_hosts(resolved) == [_shared(flags)]


def test_loopback_host_name(job: Job, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RAY_ADDRESS", ADDRESS)
    _host_address(monkeypatch, "127.0.1.1")
    assert check_several_hosts(job("rl")) == [_shared("--output-dir"), LOOPBACK]
    # an interface the user names is theirs to give
    assert check_several_hosts(job("rl", train_env_vars='{"GLOO_SOCKET_IFNAME": "eth1"}')) == [_shared("--output-dir")]
    for address in ("10.1.2.3", None):  # a routable address, or a name that does not resolve: nothing to say
        _host_address(monkeypatch, address)
        assert check_several_hosts(job("rl")) == [_shared("--output-dir")]


def test_warnings_are_said_and_counted_never_refused(
    job: Job, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("RAY_ADDRESS", ADDRESS)
    _host_address(monkeypatch, "127.0.1.1")
    resolved = job("rl")
    capsys.readouterr()
    report = run_checks(resolved)
    assert report.problems == []
    assert report.warned == [_shared("--output-dir"), LOOPBACK]
    assert report.warnings == len(resolved.warnings) + 2
    err = capsys.readouterr().err
    assert f"miles: warning: {_shared('--output-dir')}\n" in err
    assert f"miles: warning: {LOOPBACK}\n" in err
    assert ", 2 warnings above, " in passed_line(report)


def test_inspect_config_check_with_ray_address(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from miles_cli.main import main

    monkeypatch.setenv("COLUMNS", "200")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("RAY_ADDRESS", ADDRESS)
    _host_address(monkeypatch, "127.0.1.1")
    argv = ["inspect-config", "--recipe", "tiny-digits-grpo", "--output-dir", "out", "--save", "ckpt", "--check"]
    assert main(argv) == 0
    captured = capsys.readouterr()
    out, err = _ANSI.sub("", captured.out), _ANSI.sub("", captured.err)
    assert re.search(r"^miles: preflight passed \(13 checks, 2 warnings above, \d+\.\d\d s\)$", out, re.MULTILINE)
    assert f"miles: warning: {_shared('--output-dir, --save')}\n" in err
    assert f"miles: warning: {LOOPBACK}\n" in err
