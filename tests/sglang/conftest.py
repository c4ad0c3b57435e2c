"""The sglang tier: tests against real sglang-diffusion servers on this machine's CPU.

They need the separate sglang environment (`bash scripts/build_sglang_env.sh`, about 6 GB; found
through $MILES_SGLANG_PYTHON or ~/.cache/miles/sglang-env) and are skipped without it. Each server
takes about 20-25 s to start on 2 cores.
"""

from __future__ import annotations

import pytest

from miles.utils.sglang_env import resolve_sglang_python

SGLANG_PYTHON = resolve_sglang_python(None)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip = pytest.mark.skip(reason="no sglang environment (bash scripts/build_sglang_env.sh)")
    for item in items:
        if "tests/sglang/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(pytest.mark.sglang)
            item.add_marker(pytest.mark.slow)
            if SGLANG_PYTHON is None:
                item.add_marker(skip)
