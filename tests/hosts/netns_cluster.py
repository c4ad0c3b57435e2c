"""A Ray cluster of several hosts on one machine: each host a Linux network namespace with its own address.

The namespaces are joined by a bridge the cluster makes in the root namespace (it carries no address there, so
nothing outside the namespaces is reachable from them, and the root namespace reaches none of them). Addresses are
10.233.0.0/24, used only on that bridge. Each host runs Ray as a user would on a machine of its own: `ray start
--head` on host 0, `ray start --address HEAD:PORT` on the others, each with `--node-ip-address` of its namespace,
its own temp folder and its own working folder (the raylet's folder, where an actor's relative path would land).
The host's name resolves to loopback in every namespace (one /etc/hosts), as on many images.

Everything made is recorded and removed by `close()` (every process in every namespace killed, the namespaces and
the bridge deleted), also after a test fails. Root only; `available()` says why not where it cannot run.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

SUBNET = "10.233.0"
FIRST_HOST = 11  # host i has 10.233.0.(11 + i)
RAY_PORT = 6380
_RAY_DAEMONS = {"ray::IDLE", "ray::DashboardAgent", "ray::RuntimeEnvAgent"}


def _run(cmd: list[str], check: bool = True, **kwargs: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, check=check, capture_output=True, text=True, **kwargs)  # type: ignore[call-overload]


def available() -> str | None:
    """None when namespaces can be made here; else why not (the tests skip with it)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "iproute2's `ip` is not installed"
    if shutil.which("ray") is None:
        return "the `ray` command is not on PATH"
    probe = f"miles-probe-{os.getpid()}"
    made = _run(["ip", "netns", "add", probe], check=False)
    if made.returncode != 0:
        return f"cannot make a network namespace: {made.stderr.strip()}"
    _run(["ip", "netns", "del", probe], check=False)
    return None


def netem_available() -> str | None:
    """None when the kernel has the netem qdisc (delay, loss); else why not."""
    probe = f"miles-nprobe-{os.getpid()}"
    _run(["ip", "netns", "add", probe], check=False)
    try:
        _run(["ip", "-n", probe, "link", "add", "nprobe0", "type", "veth", "peer", "name", "nprobe1"], check=False)
        made = _run(["ip", "netns", "exec", probe, "tc", "qdisc", "add", "dev", "nprobe0", "root", "netem"], False)
        if made.returncode != 0:
            return f"this kernel has no netem qdisc ({made.stderr.strip()})"
        return None
    finally:
        _run(["ip", "netns", "del", probe], check=False)


@dataclass
class Host:
    index: int
    netns: str
    address: str
    veth: str  # the host's end of its link (inside its namespace)
    root_end: str  # the other end, on the bridge
    workdir: Path  # where `ray start` ran: the raylet's (and its actors') working folder
    tempdir: Path  # Ray's temp folder on this host (its session logs)
    gpus: int = 0
    cpus: int = 2

    def exec_prefix(self) -> list[str]:
        return ["ip", "netns", "exec", self.netns]


@dataclass
class NetnsCluster:
    """`hosts` namespaces; host 0 runs the Ray head. `gpus[i]`: GPUs host i declares to Ray (none exist)."""

    root: Path
    gpus: tuple[int, ...] = (0, 1, 2)
    cpus: int = 2
    hosts: list[Host] = field(default_factory=list)
    tag: str = field(default_factory=lambda: f"{os.getpid() % 100000}")
    bridge: str = ""
    env: dict[str, str] = field(default_factory=dict)

    # ---- making it ---------------------------------------------------------------------------------
    def start(self) -> NetnsCluster:
        # Ray turns token authentication on where a token file exists (~/.ray/auth_token); the hosts of a real
        # cluster share one token, and so do these (their own, made here)
        self.root.mkdir(parents=True, exist_ok=True)
        token = self.root / "ray_auth_token"
        token.write_text(os.urandom(32).hex())
        self.env.setdefault("RAY_AUTH_MODE", "token")
        self.env.setdefault("RAY_AUTH_TOKEN_PATH", str(token))
        try:
            self._make_network()
            for host in self.hosts:
                self.start_ray(host)
            self.wait_nodes(len(self.hosts))
        except BaseException:
            self.close()
            raise
        return self

    def _make_network(self) -> None:
        self.bridge = f"mlb{self.tag}"
        _run(["ip", "link", "add", self.bridge, "type", "bridge"])
        _run(["ip", "link", "set", self.bridge, "up"])
        for i, gpus in enumerate(self.gpus):
            base = self.root / f"host{i}"
            host = Host(
                index=i,
                netns=f"miles-h{i}-{self.tag}",
                address=f"{SUBNET}.{FIRST_HOST + i}",
                veth=f"mlh{i}x{self.tag}",
                root_end=f"mlr{i}x{self.tag}",
                workdir=base / "cwd",
                tempdir=base / "ray",
                gpus=gpus,
                cpus=self.cpus,
            )
            host.workdir.mkdir(parents=True, exist_ok=True)
            host.tempdir.mkdir(parents=True, exist_ok=True)
            self.hosts.append(host)
            _run(["ip", "netns", "add", host.netns])
            _run(["ip", "link", "add", host.root_end, "type", "veth", "peer", "name", host.veth])
            _run(["ip", "link", "set", host.veth, "netns", host.netns])
            _run(["ip", "link", "set", host.root_end, "master", self.bridge])
            _run(["ip", "link", "set", host.root_end, "up"])
            _run(["ip", "-n", host.netns, "addr", "add", f"{host.address}/24", "dev", host.veth])
            _run(["ip", "-n", host.netns, "link", "set", host.veth, "up"])
            _run(["ip", "-n", host.netns, "link", "set", "lo", "up"])

    @property
    def head(self) -> Host:
        return self.hosts[0]

    @property
    def ray_address(self) -> str:
        return f"{self.head.address}:{RAY_PORT}"

    def host_env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
        env.update(self.env)
        env["RAY_USAGE_STATS_ENABLED"] = "0"
        return env

    def start_ray(self, host: Host) -> None:
        cmd = [
            *host.exec_prefix(),
            "ray",
            "start",
            f"--node-ip-address={host.address}",
            f"--num-cpus={host.cpus}",
            f"--num-gpus={host.gpus}",
            f"--temp-dir={host.tempdir}",
            "--disable-usage-stats",
        ]
        if host.index == 0:
            cmd += ["--head", f"--port={RAY_PORT}", "--include-dashboard=false"]
        else:
            cmd += [f"--address={self.ray_address}"]
        done = _run(cmd, check=False, cwd=host.workdir, env=self.host_env(), timeout=120)
        if done.returncode != 0:
            raise RuntimeError(f"ray start on host {host.index} failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")

    def wait_nodes(self, count: int, timeout: float = 60.0) -> None:
        """Until Ray's head reports `count` alive nodes."""
        deadline = time.monotonic() + timeout
        last = ""
        while time.monotonic() < deadline:
            last = self.python(
                "import ray; ray.init(address='auto', log_to_driver=False, logging_level='ERROR');"
                "print(sum(1 for n in ray.nodes() if n['Alive']))",
                check=False,
            ).stdout.strip()
            if last.splitlines() and last.splitlines()[-1] == str(count):
                return
            time.sleep(1.0)
        raise RuntimeError(f"the cluster has {last!r} alive nodes after {timeout:.0f} s, not {count}")

    # ---- using it ----------------------------------------------------------------------------------
    def python(
        self, code: str, host: int = 0, check: bool = True, timeout: float = 120
    ) -> subprocess.CompletedProcess[str]:
        """`python -c code` on host `host`, joined to the cluster (RAY_ADDRESS)."""
        env = {**self.host_env(), "RAY_ADDRESS": self.ray_address}
        return _run(
            [*self.hosts[host].exec_prefix(), sys.executable, "-c", code],
            check=check,
            env=env,
            timeout=timeout,
            cwd=self.hosts[host].workdir,
        )

    def driver(
        self, argv: list[str], cwd: Path, host: int = 0, timeout: float = 600, env: dict[str, str] | None = None
    ) -> subprocess.Popen[str]:
        """`miles ARGV` started on host `host` from folder `cwd`, joined to the cluster, as a user would."""
        full = {**self.host_env(), "RAY_ADDRESS": self.ray_address, **(env or {})}
        return subprocess.Popen(
            [*self.hosts[host].exec_prefix(), sys.executable, "-m", "miles_cli", *argv],
            cwd=cwd,
            env=full,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )

    def pids(self, host: int) -> list[int]:
        out = _run(["ip", "netns", "pids", self.hosts[host].netns], check=False).stdout
        return [int(p) for p in out.split()]

    def processes(self, host: int) -> list[tuple[int, str]]:
        """(pid, command line) of every process in host `host`'s namespace."""
        found = []
        for pid in self.pids(host):
            with contextlib.suppress(OSError):
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                found.append((pid, cmdline.strip()))
        return found

    def job_processes(self, host: int) -> list[tuple[int, str]]:
        """The processes a job leaves on host `host`: Ray workers that hold an actor or task (``ray::Name``, not
        the idle pool) and sglang servers. The cluster's own daemons (raylet, GCS, ...) are not a job's."""
        left = []
        for pid, cmd in self.processes(host):
            actor = cmd.startswith("ray::") and cmd.split()[0] not in _RAY_DAEMONS
            if actor or ("sglang" in cmd and "launch_server" in cmd) or "miles_cli" in cmd:
                left.append((pid, cmd))
        return left

    # ---- faults --------------------------------------------------------------------------------------
    def kill_host(self, host: int) -> None:
        """Every process of host `host` killed at once (its raylet, its workers, its servers): a machine lost."""
        for pid in self.pids(host):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def link(self, host: int, up: bool) -> None:
        h = self.hosts[host]
        _run(["ip", "-n", h.netns, "link", "set", h.veth, "up" if up else "down"])

    def shape(self, host: int, spec: list[str] | None) -> None:
        """Put a qdisc on host `host`'s link (e.g. ["tbf", "rate", "256kbit", ...] or ["netem", "delay", "50ms"]);
        None removes it."""
        h = self.hosts[host]
        if spec is None:
            _run(["ip", "netns", "exec", h.netns, "tc", "qdisc", "del", "dev", h.veth, "root"], check=False)
            return
        _run(["ip", "netns", "exec", h.netns, "tc", "qdisc", "replace", "dev", h.veth, "root", *spec])

    def heal(self, host: int) -> None:
        """Host `host` back as a live node: its link up and unshaped, its Ray started again if it was lost."""
        self.shape(host, None)
        self.link(host, True)
        alive = self.python(
            "import ray; ray.init(address='auto', log_to_driver=False, logging_level='ERROR');"
            f"print(any(n['Alive'] and n['NodeManagerAddress'] == '{self.hosts[host].address}' for n in ray.nodes()))",
            check=False,
        ).stdout.strip()
        if alive.endswith("True") and any("raylet" in cmd for _, cmd in self.processes(host)):
            return
        self.kill_host(host)
        time.sleep(1.0)
        self.start_ray(self.hosts[host])
        self.wait_nodes(len(self.hosts))

    # ---- removing it -------------------------------------------------------------------------------
    def close(self) -> None:
        # the namespaces' processes only (`ray stop` would end every Ray on the machine: one PID namespace)
        for _ in range(3):
            for host in range(len(self.hosts)):
                with contextlib.suppress(Exception):
                    self.kill_host(host)
            time.sleep(0.5)
        for host in self.hosts:
            _run(["ip", "netns", "del", host.netns], check=False)
            _run(["ip", "link", "del", host.root_end], check=False)
        if self.bridge:
            _run(["ip", "link", "del", self.bridge], check=False)
