"""The preflight's memory check: a job over --gpu-memory-gib is refused before Ray starts, in one line naming the
peak and where `miles plan` computes the changes; a CPU run is not checked (there is no GPU memory to exceed)."""

from __future__ import annotations

import pytest

from miles.config.resolve import resolve
from miles.preflight import find_problems
from miles.preflight.memory import check_gpu_memory


@pytest.fixture(autouse=True)
def _no_cluster(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.delenv("MILES_GPU_MEMORY_GIB", raising=False)


def test_a_job_over_the_gpu_memory_is_one_preflight_problem() -> None:
    resolved = resolve("dmd2", recipe="sd35-4step", cli={"gpu_memory_gib": 20})
    lines = [p for p in find_problems(resolved) if "memory plan" in p]
    assert len(lines) == 1
    assert lines[0].startswith("the memory plan does not fit: node 0 GPU 0 peaks at 21.1 GiB in the sync phase")
    assert "over the 20 GiB per GPU of --gpu-memory-gib" in lines[0] and "miles plan --recipe sd35-4step" in lines[0]
    assert check_gpu_memory(resolve("dmd2", recipe="sd35-4step", cli={"gpu_memory_gib": 80})) == []


def test_a_cpu_run_is_not_checked_unless_asked() -> None:
    """No GPU here and no --gpu-memory-gib: the check does not estimate (the tiny recipes run on CPU)."""
    assert check_gpu_memory(resolve("rl", recipe="tiny-digits-grpo")) == []
    assert check_gpu_memory(resolve("rl", recipe="sd3-ocr-grpo")) == []  # a GPU recipe planned here: not run here
