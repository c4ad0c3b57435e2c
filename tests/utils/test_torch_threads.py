"""`miles.utils.torch_threads`: an actor's torch threads from its start environment, set only when they differ."""

from __future__ import annotations

import pytest
import torch

from miles.utils.torch_threads import thread_options, use_threads


def test_thread_options_is_a_runtime_env_hint() -> None:
    assert thread_options(None) == {}
    assert thread_options(3) == {"runtime_env": {"env_vars": {"OMP_NUM_THREADS": "3"}}}
    assert thread_options(0)["runtime_env"]["env_vars"]["OMP_NUM_THREADS"] == "1"


def test_use_threads_calls_set_num_threads_only_for_another_count(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    monkeypatch.setattr(torch, "set_num_threads", calls.append)
    use_threads(torch.get_num_threads())
    assert calls == []
    use_threads(torch.get_num_threads() + 1)
    assert calls == [torch.get_num_threads() + 1]
