"""Launch and watch one sglang-diffusion server process (torch-free).

The server runs from its own Python environment: sglang pins torch/transformers/diffusers versions
that differ from the trainer's. The interpreter comes from `--sglang-python`, else
`$MILES_SGLANG_PYTHON`, else the environment `scripts/build_sglang_env.sh` builds
(`~/.cache/miles/sglang-env`).

What miles sets on every server (a `--sglang-KEY VALUE` passthrough overrides the rest):
  * `--model-path`, `--host` (the bind address of `--rollout-engine-host`: by default 127.0.0.1 on a one-node
    cluster, the node's own address on several; see `miles.rollout.engines.addresses`), `--port`, and free
    `--scheduler-port` / `--master-port` so several servers share a machine. The server's URL (`ServerSpec.url`)
    is its advertised address, the one other hosts reach (the node's IP for a wildcard bind); the engine actor
    itself talks to it on `local_url`, on its own host;
  * `--model-id` from the family's `sglang_model_id` (sglang picks its native pipeline by name: a local
    checkpoint directory carries no hint, and without it sglang falls back to a diffusers pipeline
    that cannot return trajectories);
  * precisions: `--dit-precision` from `--diffusion-forward-dtype`, the text encoders likewise, the VAE fp32;
  * the family's own options (`TrainPipelineConfig.sglang_server_options`: its text-encoder count, flux's
    `--embedded-cfg-scale`), over the defaults above;
  * `--vae-tiling false`: sglang's SD3 config tiles the VAE decode by default with tiles sized from the
    VAE config's `sample_size` (diffusers' default 32), while diffusers' pipeline never tiles. A latent
    larger than the tile then decodes to a different image (measured on tiny-sd3 with sample_size 32:
    max |diff| 0.43, correlation 0.93), so rewards would score another image than the latent holds;
  * `--warmup-resolutions WxH` at the job's resolution, `--num-gpus` = `--rollout-num-gpus-per-engine`;
  * on a CPU machine `--sleep-on-idle`: sglang's scheduler busy-polls for requests by default, which
    keeps one core at 100 % while the trainer runs (measured: an idle tiny-sd3 server at 100 % CPU).
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

_PRECISION = {"fp32": "fp32", "bf16": "bf16", "fp16": "fp16"}


def server_precision(dtype: str) -> str:
    """sglang's precision name for `--diffusion-forward-dtype` `dtype` (fp32 for one it has no name for)."""
    return _PRECISION.get(dtype, "fp32")


class EngineStartError(RuntimeError):
    """An sglang server did not come up; the message names it and ends with its log tail."""


def health_problem(url: str, timeout: float) -> str | None:
    """None when `GET <url>/health` answers 200 within `timeout` seconds, else what went wrong, in a few words."""
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/health", timeout=timeout) as resp:
            return None if resp.status == 200 else f"GET /health answered HTTP {resp.status}"
    except urllib.error.HTTPError as exc:
        return f"GET /health answered HTTP {exc.code}"
    except urllib.error.URLError as exc:
        return f"GET /health failed: {exc.reason}"
    except (OSError, ValueError) as exc:
        return f"GET /health failed: {type(exc).__name__}: {exc}" if str(exc) else f"GET /health failed: {exc!r}"


def _bind_target(host: str) -> tuple[socket.AddressFamily, str]:
    """The socket family and address a test bind on `host` uses (a wildcard: every interface)."""
    from miles.utils.net import is_wildcard

    bare = host.strip().strip("[]")
    if bare == "::":
        return socket.AF_INET6, "::"
    if is_wildcard(bare):
        return socket.AF_INET, ""
    family = socket.AF_INET6 if ":" in bare else socket.AF_INET
    return family, bare


def free_port(pair: bool = False, host: str = "127.0.0.1") -> int:
    """A free TCP port on `host`, the address a server will bind (with the next one free too when `pair`)."""
    family, address = _bind_target(host)
    for _ in range(200):
        with socket.socket(family) as sock:
            sock.bind((address, 0))
            port = sock.getsockname()[1]
        if not pair:
            return port
        if port < 65535:
            with socket.socket(family) as sock, contextlib.suppress(OSError):
                sock.bind((address, port + 1))
                return port
    raise RuntimeError("no free port pair found")


@dataclass
class ServerSpec:
    """Everything one server process needs."""

    python: str
    model_path: str
    host: str = "127.0.0.1"  # the bind address
    port: int = 0
    advertise_host: str | None = None  # what the others are told (None: where this host reaches the server)
    model_id: str | None = None
    precision: str = "fp32"
    num_gpus: int = 1
    warmup: tuple[int, int] | None = None  # (width, height)
    sleep_on_idle: bool = False  # on a CPU machine the idle scheduler would otherwise spin a whole core
    family_options: dict[str, Any] = field(default_factory=dict)  # the family's, over the defaults
    passthrough: dict[str, Any] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)
    name: str = "engine 0"

    def command(self, scheduler_port: int, master_port: int) -> list[str]:
        sglang = Path(self.python).parent / "sglang"
        head = [str(sglang)] if sglang.is_file() else [self.python, "-m", "sglang.cli.main"]
        precision = server_precision(self.precision)
        options: dict[str, Any] = {
            "host": self.host,
            "port": self.port,
            "scheduler_port": scheduler_port,
            "master_port": master_port,
            "num_gpus": self.num_gpus,
            "dit_precision": precision,
            "vae_precision": "fp32",
            "text_encoder_precisions": [precision] * 3,  # SD3's three; a family's options set its own
            "vae_tiling": "false",
        }
        options.update(self.family_options)
        if self.model_id:
            options["model_id"] = self.model_id
        if self.sleep_on_idle:
            options["sleep_on_idle"] = True
        if self.warmup:
            options["warmup_resolutions"] = f"{self.warmup[0]}x{self.warmup[1]}"
        options.update(self.passthrough)
        argv = [*head, "serve", "--model-path", self.model_path]
        for key, value in options.items():
            flag = "--" + key.replace("_", "-")
            if value is True:  # store_true flags take no value; optional-value ones read it as true
                argv.append(flag)
            elif value is False:
                argv += [flag, "false"]
            elif isinstance(value, (list, tuple)):
                argv += [flag, *(str(v) for v in value)]
            elif value is not None:
                argv += [flag, str(value)]
        return argv

    @property
    def url(self) -> str:
        """The advertised URL: where the router, the manager and the other hosts reach the server."""
        from miles.utils.net import http_url, local_host

        return http_url(self.advertise_host or local_host(self.host), self.port)

    @property
    def local_url(self) -> str:
        """Where a process on the server's own host reaches it (a wildcard bind: the loopback address)."""
        from miles.utils.net import http_url, local_host

        return http_url(local_host(self.host), self.port)


def _die_with_parent() -> None:
    """Runs in the child before exec: SIGTERM it when the process that launched it dies (Linux), so a
    killed engine actor never leaves an orphaned server holding memory and ports."""
    import ctypes
    import sys

    if sys.platform.startswith("linux"):
        with contextlib.suppress(Exception):
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class SglangServer:
    """One server process (its own session, so stop() also ends the scheduler it spawns)."""

    def __init__(self, spec: ServerSpec, log_dir: str | Path) -> None:
        self.spec = spec
        self.log_path = Path(log_dir) / f"sglang_{spec.name.replace(' ', '_')}.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.started_at = 0.0

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def start(self) -> None:
        if self.spec.port == 0:
            self.spec.port = free_port(pair=True, host=self.spec.host)  # the server also listens on port + 1
        argv = self.spec.command(scheduler_port=free_port(), master_port=free_port())
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, **self.spec.env}
        env.pop("PYTHONPATH", None)  # the trainer's packages must not shadow the sglang environment's
        with open(self.log_path, "ab") as log:
            log.write(f"\n$ {shlex.join(argv)}\n".encode())
            log.flush()
            self.proc = subprocess.Popen(
                argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
                preexec_fn=_die_with_parent,
            )
        self.started_at = time.monotonic()

    def exit_code(self) -> int | None:
        """The server's exit code once it has exited; None while it runs (or before it started)."""
        return None if self.proc is None else self.proc.poll()

    def alive(self) -> bool:
        return self.proc is not None and self.exit_code() is None

    def healthy(self, timeout: float = 5.0) -> bool:
        """`GET /health` answers 200, asked on the server's own host."""
        return health_problem(self.spec.local_url, timeout) is None

    def wait_ready(self, timeout: float) -> float:
        """Block until `/health` answers 200 (503 until the warm-up is done); seconds it took."""
        deadline = self.started_at + timeout
        problem: str | None = "not asked yet"
        while time.monotonic() < deadline:
            if not self.alive():
                raise EngineStartError(
                    f"sglang {self.spec.name} exited with code {self.proc.returncode if self.proc else None} "
                    f"while starting (log {self.log_path}):\n{self.log_tail()}"
                )
            problem = health_problem(self.spec.local_url, timeout=2.0)
            if problem is None:
                return time.monotonic() - self.started_at
            time.sleep(0.5)
        self.stop()
        raise EngineStartError(
            f"sglang {self.spec.name} at {self.spec.local_url} was not healthy after {timeout:.0f} s "
            f"({problem}; log {self.log_path}):\n{self.log_tail()}"
        )

    def log_tail(self, lines: int = 15) -> str:
        """The end of this start's log (warnings dropped), errors first so one-line reports keep them."""
        try:
            text = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        starts = [i for i, line in enumerate(text) if line.startswith("$ ")]
        text = text[starts[-1] :] if starts else text
        useful = [line for line in text if "warnings.warn" not in line and "UserWarning" not in line]
        errors = [line for line in useful if "ERROR" in line or "Error" in line]
        return "\n".join([*errors[-3:], *useful[-lines:]])

    def stop(self, grace: float = 10.0) -> None:
        """SIGTERM the process group, SIGKILL what is left after `grace` seconds."""
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=grace)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=5)
