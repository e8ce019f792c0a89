"""neardup: streaming near-duplicate detection for text.

MinHash signatures (Broder 1997), LSH banding (Leskovec, Rajaraman, Ullman, *Mining of
Massive Datasets*, §3.4) and union-find clustering, with the state in RocksDB, driven by
a Kafka consumer or by JSONL files.
"""

__version__ = "0.1.0"

from neardup import kernel_cache as _kernel_cache

_kernel_cache.choose()  # before any compiled kernel is defined: numba needs a writable cache
