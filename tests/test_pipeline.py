"""The file mode's pipeline (``neardup.pipeline.prepared_ahead``): when a worker is started,
and that its prepared batches are the ones prepared inline."""

from __future__ import annotations

import multiprocessing

import numpy as np

from neardup.core.settings import EngineSettings
from neardup.core.types import Document
from neardup.pipeline import prepared_ahead

SETTINGS = EngineSettings()


def _batches(n: int, size: int = 3) -> list[list[Document]]:
    return [[Document(f"{b}-{k}", f"story {b} paragraph {k} of the wire copy, filed late") for k in range(size)]
            for b in range(n)]


def test_small_input_starts_no_worker() -> None:
    children = []
    for _batch, _prepared in prepared_ahead(_batches(3), list, SETTINGS, parallel=True, worker_after=3):
        children.extend(multiprocessing.active_children())
    assert children == []


def test_worker_batches_equal_inline_ones() -> None:
    batches = _batches(12)
    inline = [p for _, p in prepared_ahead(batches, list, SETTINGS, parallel=False)]
    started = []
    piped = []
    for batch, prepared in prepared_ahead(batches, list, SETTINGS, parallel=True, worker_after=1, depth=1):
        started.extend(multiprocessing.active_children())
        piped.append((batch, prepared))
    assert started, "a worker is started for an input longer than worker_after batches"
    assert [b for b, _ in piped] == batches
    for a, (_, b) in zip(inline, piped):
        assert np.array_equal(a.signatures, b.signatures)
