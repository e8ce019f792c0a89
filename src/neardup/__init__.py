"""neardup: streaming near-duplicate detection for text.

MinHash signatures (Broder 1997), LSH banding (Leskovec, Rajaraman, Ullman, *Mining of
Massive Datasets*, §3.4) and union-find clustering, with the state in RocksDB, driven by
a Kafka consumer or by JSONL files.
"""

__version__ = "0.1.0"

from neardup import kernel_cache as _kernel_cache

_kernel_cache.choose()  # before any compiled kernel is defined: numba needs a writable cache

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the names the lazy ``__getattr__`` below gives, for type checkers
    from neardup.api import Deduplicator
    from neardup.core.types import Rejected, Verdict
    from neardup.query import Neighbour

__all__ = ["Deduplicator", "Neighbour", "Rejected", "Verdict", "__version__"]

_API = {"Deduplicator": "neardup.api", "Neighbour": "neardup.query", "Rejected": "neardup.core.types",
        "Verdict": "neardup.core.types"}


def __getattr__(name: str) -> object:
    """The Python API (``neardup.api``), imported on first use: ``import neardup`` stays
    cheap for the command line, which does not need the engine's modules up front."""
    if name in _API:
        import importlib  # noqa: PLC0415

        return getattr(importlib.import_module(_API[name]), name)
    raise AttributeError(f"module 'neardup' has no attribute {name!r}")
