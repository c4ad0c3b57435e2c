"""`--rm-type remote_rm`: the job's client of the reward service at `--rm-url` (`../service/client.py`), built from
the flags once per process.

    --rm-url http://host:8000          the service (`miles reward serve` there)
    --rm-remote-name digit             the reward it serves to ask for (default: its only one)
    --rm-batch-size 32  --rm-max-in-flight 4  --rm-timeout 60  --rm-retries 3
    --use-fault-tolerance  --rm-fault-wait 120     a service that goes down is waited for, its batches re-sent

The service's protocol version and reward names are checked before the job starts (the preflight, `check_remote`)
and again by the first call of each process.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

from miles.core.errors import ConfigError
from miles.rewards.service.client import RemoteRewardClient

_CLIENTS: dict[tuple[Any, ...], RemoteRewardClient] = {}
_LOCK = threading.Lock()


def _knobs(args: Any) -> dict[str, Any]:
    return {
        "batch_size": int(args.rm_batch_size),
        "max_in_flight": int(args.rm_max_in_flight),
        "timeout_s": float(args.rm_timeout),
        "retries": int(args.rm_retries),
        "fault_tolerant": bool(args.use_fault_tolerance),
        "wait_s": float(args.rm_fault_wait),
    }


def _url(args: Any) -> str:
    if not args.rm_url:
        raise ConfigError("--rm-type remote_rm requires --rm-url (the URL of `miles reward serve`)")
    return str(args.rm_url)


async def served_rewards(args: Any) -> list[str]:
    """The rewards the service at --rm-url serves (its /health), unreachable -> RewardError, like a score call."""
    probe = RemoteRewardClient(_url(args), "", **_knobs(args))
    try:
        return await probe.served()
    finally:
        await probe.aclose()


async def _name(args: Any) -> str:
    if args.rm_remote_name:
        return str(args.rm_remote_name)
    served = await served_rewards(args)
    if len(served) != 1:
        raise ConfigError(
            f"--rm-url {args.rm_url} serves {', '.join(served) or 'nothing'}: choose one with --rm-remote-name"
        )
    return served[0]


async def client_for(args: Any) -> RemoteRewardClient:
    """The process's client for the job's remote reward, checked against the service on first use."""
    key = (_url(args), args.rm_remote_name, tuple(sorted(_knobs(args).items())))
    with _LOCK:
        client = _CLIENTS.get(key)
    if client is None:
        client = RemoteRewardClient(_url(args), await _name(args), **_knobs(args))
        await client.check()
        with _LOCK:
            client = _CLIENTS.setdefault(key, client)
    return client


def check_remote(args: Any) -> str:
    """The preflight's check: the service answers, speaks this protocol and serves the reward (ConfigError or
    RewardError, one line, otherwise); -> the reward's name."""

    async def run() -> str:
        name = await _name(args)
        client = RemoteRewardClient(_url(args), name, **_knobs(args))
        try:
            await client.check()
        finally:
            await client.aclose()
        return name

    return asyncio.run(run())
