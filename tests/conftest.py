"""Shared fixtures: the real Qwen vocabularies (built once per session) and corpus paths."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from grammask import Compiler, Vocabulary, load_vocabulary

# two xdist workers on two cores: one intra-op thread each avoids oversubscription
torch.set_num_threads(1)
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

ROOT = Path(__file__).resolve().parents[1]
CORPUS = Path(os.environ.get("GRAMMASK_CORPUS", ROOT.parent / "shared" / "corpus"))


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--runslow", action="store_true", help="run whole-corpus tests")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--runslow"):
        return
    skip = pytest.mark.skip(reason="whole-corpus run: use --runslow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def qwen25() -> Vocabulary:
    return load_vocabulary("qwen2.5")


@pytest.fixture(scope="session")
def qwen36() -> Vocabulary:
    return load_vocabulary("qwen3.6")


@pytest.fixture(scope="session")
def compiler(qwen25: Vocabulary) -> Iterator[Compiler]:
    # routes as the router makes them: a tuned spec may move to the other backend later
    # (tests/compile/test_fillcost.py tests that)
    compiler = Compiler(qwen25, timeout_s=60, tune_fill=False)
    yield compiler
    compiler.close()


@pytest.fixture(scope="session")
def corpus() -> Path:
    if not (CORPUS / "maskbench").is_dir():
        pytest.fail(f"corpus not found at {CORPUS} (set GRAMMASK_CORPUS)")
    return CORPUS
