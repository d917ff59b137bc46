"""The vLLM integration's tests: they need vLLM, which only ``make test-vllm``'s venv
(``.venv-vllm``) has. Elsewhere (``make test``) every one of them is skipped, with the
reason below; where vLLM is installed, none is."""

from __future__ import annotations

import importlib.util

import pytest

NO_VLLM = "vLLM is not installed in this venv: `make test-vllm` runs these in .venv-vllm"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if importlib.util.find_spec("vllm") is not None:
        return
    skip = pytest.mark.skip(reason=NO_VLLM)
    for item in items:
        if "tests/vllm/" in item.nodeid:
            item.add_marker(skip)
