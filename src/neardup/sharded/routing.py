"""Which shard partition owns a band bucket, and the order in which shards see documents."""

from __future__ import annotations

import numpy as np


def shard_of(buckets: np.ndarray, shards: int) -> np.ndarray:
    """The shard partition owning each bucket.

    Bucket ids are 64-bit hashes (``neardup.core.lsh.bucket_ids``), uniform over their
    range, so their remainder spreads buckets evenly; a bucket's owner depends only on its
    id and the partition count, never on which process asks.

    Args:
        buckets: uint64, any shape: bucket ids.
        shards: number of shard partitions, at least 1.

    Returns:
        int64, the shape of ``buckets``: partitions in [0, shards).

    Raises:
        ValueError: ``shards`` below 1.
    """
    if shards < 1:
        raise ValueError(f"shards must be at least 1, not {shards}")
    return (np.asarray(buckets, dtype=np.uint64) % np.uint64(shards)).astype(np.int64)


def owned_bands(buckets: np.ndarray, shards: int) -> list[np.ndarray]:
    """Per shard partition, the bands of one document whose bucket it owns.

    Args:
        buckets: uint64, shape (bands,): one document's bucket id in each band.
        shards: number of shard partitions.

    Returns:
        ``shards`` int64 arrays of band indices, ascending; empty for a shard the
        document does not touch.
    """
    owner = shard_of(buckets, shards)
    return [np.flatnonzero(owner == p) for p in range(shards)]


def group_by_shard(buckets: np.ndarray, shards: int) -> tuple[np.ndarray, list[list[int]]]:
    """Every document's bucket ids grouped by the shard partition owning them (a batch at
    once: what ``owned_bands`` gives one document).

    Args:
        buckets: uint64, shape (n, bands): each document's bucket id in each band.
        shards: number of shard partitions.

    Returns:
        ``grouped``, uint64, shape (n, bands): each row's bucket ids ordered by owner,
        in band order within one owner; and ``bounds``, n lists of ``shards + 1`` ints:
        document i's bucket ids on shard q are ``grouped[i, bounds[i][q]:bounds[i][q + 1]]``.
    """
    grouped, bounds = shard_bounds(buckets, shards)
    return grouped, bounds.tolist()


def shard_bounds(buckets: np.ndarray, shards: int) -> tuple[np.ndarray, np.ndarray]:
    """``group_by_shard`` with ``bounds`` as an int64 array, shape (n, shards + 1)."""
    owner = shard_of(buckets, shards)
    order = np.argsort(owner, axis=1, kind="stable")
    grouped = np.take_along_axis(np.asarray(buckets, dtype=np.uint64), order, axis=1)
    n = len(owner)
    # per row, how many of its buckets each shard owns: one bincount over (row, owner)
    # pairs (a comparison of every bucket with every shard took n × bands × shards)
    rows = np.arange(n, dtype=np.int64)[:, None] * shards
    counts = np.bincount((owner + rows).ravel(), minlength=n * shards).reshape(n, shards)
    bounds = np.zeros((n, shards + 1), dtype=np.int64)
    np.cumsum(counts, axis=1, out=bounds[:, 1:])
    return grouped, bounds
