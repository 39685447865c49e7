"""Shared test setup.

GPU tests carry `@pytest.mark.gpu`. `invoke test` deselects them on CPU machines; `invoke test --gpu`
selects them, and then a machine without a visible CUDA GPU is an error for the whole run, never a silent
skip of every test.
"""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests make their own tiny models and data
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
if "PYTEST_XDIST_WORKER" in os.environ:  # (and the ranks a test launches, which inherit it)
    # each xdist worker its own Inductor cache: two workers building the same kernel at once once loaded a
    # half-written .so from the shared one ("file too short", a CI run of 2026-11-27)
    import tempfile

    worker_cache = os.path.join(tempfile.gettempdir(), f"torchinductor_{os.environ['PYTEST_XDIST_WORKER']}")
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", worker_cache)


@pytest.hookimpl(trylast=True)  # after `-m "not gpu"` has deselected: count only what will run
def pytest_collection_modifyitems(config, items):
    selected_gpu = [item for item in items if item.get_closest_marker("gpu")]
    if not selected_gpu:
        return
    import torch

    if not torch.cuda.is_available():
        raise pytest.UsageError(
            f"{len(selected_gpu)} GPU tests selected but no CUDA GPU is visible; run them on a GPU machine "
            "(invoke test --gpu) or deselect them with -m 'not gpu'"
        )


@pytest.fixture(autouse=True)
def python_gc_back_on():
    """A Runtime turns Python's automatic garbage collection off until it is closed (trainer.gc_every);
    many tests leave theirs open, and the tests after them would run, and hold memory, without it."""
    yield
    import sys

    collection = sys.modules.get("mlite.runtime.collection")  # not imported: no Runtime was built
    if collection is not None and collection.StepCollection.live:
        import gc

        collection.StepCollection.live = 0
        gc.enable()
