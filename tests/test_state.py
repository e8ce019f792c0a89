"""State stores: the same contract on both backends; RocksDB persistence, settings checks
and crash atomicity."""

from __future__ import annotations

import random
import signal
import subprocess
import sys
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
from rocksdict import Options, Rdict

from neardup.core.lsh import LshParams
from neardup.core.normalize import TextNorm
from neardup.core.settings import EngineSettings
from neardup.core.shingle import Shingling
from neardup.core.types import Document, Verdict
from neardup.core.unionfind import Node
from neardup.detector import Detector
from neardup.state import SettingsMismatchError, StateError, StateStore, StateUpdate
from neardup.state import codec
from neardup.state.memory import MemoryStateStore
from neardup.state import index as index_module
from neardup.state.forest import Forest
from neardup.state.index import BucketIndex
from neardup.state.rocksdb import RocksDBStateStore

SETTINGS = EngineSettings(num_perm=32)
NUM_PERM = SETTINGS.num_perm
BUCKET_A, BUCKET_B, BUCKET_C = np.array([2**64 - 1, 22, 33], dtype=np.uint64)
BUCKETS = np.array([BUCKET_A, BUCKET_B, BUCKET_C])

MakeStore = Callable[..., StateStore]


@pytest.fixture(params=["rocksdb", "memory"])
def make_store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[MakeStore]:
    """A factory of stores of one backend (RocksDB in tmp_path, or in memory)."""
    opened: list[StateStore] = []

    def make(settings: EngineSettings = SETTINGS) -> StateStore:
        if request.param == "rocksdb":
            store: StateStore = RocksDBStateStore(tmp_path / "state", settings.state_shape())
        else:
            store = MemoryStateStore(settings.state_shape())
        opened.append(store)
        return store

    yield make
    for store in opened:
        store.close()


@pytest.fixture
def store(make_store: MakeStore) -> StateStore:
    return make_store()


def _sigs(n: int, seed: int = 0) -> np.ndarray:
    sigs = np.random.default_rng(seed).integers(0, 2**64, size=(n, NUM_PERM), dtype=np.uint64)
    if n:
        sigs[0, 0], sigs[0, 1] = 0, 2**64 - 1
    return sigs


def _node_rows(nodes: dict[int, Node]) -> np.ndarray:
    """``StateUpdate.nodes`` rows (seq, parent, size, canonical) of ``nodes``."""
    return np.array([(seq, *node) for seq, node in nodes.items()], dtype=np.uint64).reshape(-1, 4)


def _first_update() -> StateUpdate:
    return StateUpdate(
        first_seq=0,
        signatures=_sigs(3),
        ids=["doc-0", "Grüße/字-1", "doc 2"],
        bucket_ids=np.array([BUCKET_A, BUCKET_B, BUCKET_A], dtype=np.uint64),
        bucket_seqs=np.array([0, 1, 2], dtype=np.uint64),
        largest_bucket=2,
        nodes=_node_rows({2: Node(0, 1, 2), 0: Node(0, 2, 0)}),
        positions={"input.jsonl": 3, "topic/0": 2**40},
        verdicts={b"input.jsonl:0": b"\x00\xffverdict", b"k": b""},
    )


def _members(store: StateStore, buckets: np.ndarray = BUCKETS) -> list[list[int]]:
    """Members of each of ``buckets``, read through ``bucket_members``."""
    found = store.bucket_members(buckets)
    assert found.seqs.dtype == np.uint64 and found.counts.tolist() == np.bincount(
        found.owner, minlength=len(buckets)).tolist()
    return [found.seqs[found.owner == i].tolist() for i in range(len(buckets))]


# --- both backends ----------------------------------------------------------------------


def test_fresh_store_is_empty(store: StateStore) -> None:
    assert store.next_seq() == 0
    assert _members(store) == [[], [], []]
    assert store.get_nodes([0, 5]) == [None, None]
    assert store.get_position("input.jsonl") is None
    assert store.get_verdicts([b"x"]) == [None]
    assert store.get_signatures([]).shape == (0, NUM_PERM)
    with pytest.raises(KeyError):
        store.get_signatures([0])
    with pytest.raises(KeyError):
        store.get_ids([0])


def test_round_trip(store: StateStore) -> None:
    first = _first_update()
    store.commit(first)
    assert store.next_seq() == 3
    sigs = store.get_signatures([2, 0, 1])
    assert sigs.dtype == np.uint64 and sigs.shape == (3, NUM_PERM)
    assert np.array_equal(sigs, first.signatures[[2, 0, 1]])
    assert store.get_ids([1, 2, 0]) == ["Grüße/字-1", "doc 2", "doc-0"]
    assert _members(store) == [[0, 2], [1], []]
    assert store.get_nodes([0, 1, 2]) == [Node(0, 2, 0), None, Node(0, 1, 2)]
    assert store.get_position("input.jsonl") == 3 and store.get_position("topic/0") == 2**40
    assert store.get_verdicts([b"input.jsonl:0", b"k", b"nope"]) == [b"\x00\xffverdict", b"", None]

    second = StateUpdate(
        first_seq=3,
        signatures=_sigs(1, seed=1),
        ids=["doc-3"],
        bucket_ids=np.array([BUCKET_A], dtype=np.uint64),
        bucket_seqs=np.array([3], dtype=np.uint64),
        largest_bucket=3,
        nodes=_node_rows({3: Node(0, 1, 3), 0: Node(0, 3, 0)}),
        positions={"input.jsonl": 4},
    )
    store.commit(second)
    assert store.next_seq() == 4
    assert _members(store) == [[0, 2, 3], [1], []]
    assert store.get_nodes([0, 3]) == [Node(0, 3, 0), Node(0, 1, 3)]
    assert store.get_position("input.jsonl") == 4 and store.get_position("topic/0") == 2**40
    assert np.array_equal(store.get_signatures([3]), second.signatures)
    stats = store.stats()
    assert stats["documents"] == 4 and stats["max_bucket_size"] == 3


def test_empty_update_records_positions(store: StateStore) -> None:
    store.commit(_first_update())
    store.commit(
        StateUpdate(3, np.empty((0, NUM_PERM), np.uint64), [], positions={"input.jsonl": 9})
    )
    assert store.next_seq() == 3 and store.get_position("input.jsonl") == 9


def test_verdict_deletes(store: StateStore) -> None:
    store.commit(_first_update())
    store.commit(
        StateUpdate(
            3,
            np.empty((0, NUM_PERM), np.uint64),
            [],
            verdicts={b"new": b"1"},
            verdict_deletes=[b"input.jsonl:0", b"never-stored"],
        )
    )
    assert store.get_verdicts([b"input.jsonl:0", b"k", b"new"]) == [None, b"", b"1"]


@pytest.mark.parametrize("first_seq", [1, 2, 4])
def test_commit_with_wrong_first_seq_raises(store: StateStore, first_seq: int) -> None:
    store.commit(_first_update())
    bad = StateUpdate(first_seq, _sigs(1), ["late"], positions={"input.jsonl": 99})
    with pytest.raises(StateError, match="starts at document"):
        store.commit(bad)
    assert store.next_seq() == 3
    assert store.get_position("input.jsonl") == 3
    with pytest.raises(KeyError):
        store.get_ids([3])


def test_commit_with_wrong_signature_shape_raises(store: StateStore) -> None:
    for sigs in (np.zeros((2, NUM_PERM), np.uint64), np.zeros((1, NUM_PERM + 1), np.uint64)):
        with pytest.raises(StateError):
            store.commit(StateUpdate(0, sigs, ["only-one"]))
    assert store.next_seq() == 0


# --- RocksDB only -----------------------------------------------------------------------


def _docs(*pairs: tuple[str, str]) -> list[Document]:
    return [Document(i, t) for i, t in pairs]


BASE_TEXT = (
    "The central bank said on Tuesday it would keep its key lending rate unchanged at "
    "six per cent for the third month in a row, citing steady inflation, firm demand for "
    "credit from manufacturers and a recovery in exports that analysts had not expected "
    "until the second half of the year. The governor told reporters that the board saw "
    "no reason to move before the budget is presented to parliament next month, and that "
    "the currency had been stable against a basket of trading partners since January."
)


def test_rocksdb_persists_across_reopen(tmp_path: Path) -> None:
    path = tmp_path / "state"
    store = RocksDBStateStore(path, SETTINGS.state_shape())
    first = _first_update()
    store.commit(first)
    store.close()
    store.close()  # idempotent

    with RocksDBStateStore(path, SETTINGS.state_shape()) as store:
        assert store.next_seq() == 3
        assert _members(store) == [[0, 2], [1], []]  # the bucket index is rebuilt
        assert store.get_position("input.jsonl") == 3
        assert store.get_verdicts([b"input.jsonl:0"]) == [b"\x00\xffverdict"]
        assert np.array_equal(store.get_signatures([0, 1, 2]), first.signatures)
        assert store.get_ids([0, 1, 2]) == first.ids
        assert store.get_nodes([0, 2]) == [Node(0, 2, 0), Node(0, 1, 2)]
        assert store.max_bucket_size() == 2


def test_rocksdb_detector_after_reopen_finds_earlier_documents(tmp_path: Path) -> None:
    path, settings = tmp_path / "state", EngineSettings()
    with RocksDBStateStore(path, settings.state_shape()) as store:
        out = Detector(settings, store).process(
            _docs(("orig", BASE_TEXT), ("other", "Wheat futures fell sharply in Chicago.")),
            positions={"in": 2},
        )
        assert [r.verdict for r in out if isinstance(r, Verdict)] == ["unique", "unique"]

    with RocksDBStateStore(path, settings.state_shape()) as store:
        assert store.next_seq() == 2 and store.get_position("in") == 2
        near = BASE_TEXT + " Reporting by a staff correspondent."
        out = Detector(settings, store).process(_docs(("copy", BASE_TEXT), ("near", near)))
        copy, near_v = out
        assert isinstance(copy, Verdict) and isinstance(near_v, Verdict)
        assert (copy.seq, copy.verdict, copy.match) == (2, "duplicate", "orig")
        assert copy.cluster == "orig"
        assert copy.similarity == 1.0
        assert (near_v.seq, near_v.verdict, near_v.cluster) == (3, "duplicate", "orig")
        assert near_v.match in {"orig", "copy"}


@pytest.mark.parametrize(
    ("changed", "name"),
    [
        (EngineSettings(num_perm=64), "num_perm"),
        (EngineSettings(num_perm=32, shingling=Shingling("char", 5)), "shingling"),
        (EngineSettings(num_perm=32, seed=2), "seed"),
        (EngineSettings(num_perm=32, norm=TextNorm(strip_punctuation=True)), "normalization"),
        (EngineSettings(num_perm=32, lsh=LshParams(4, 8)), "bands"),
    ],
)
def test_rocksdb_settings_mismatch(tmp_path: Path, changed: EngineSettings, name: str) -> None:
    path = tmp_path / "state"
    with RocksDBStateStore(path, SETTINGS.state_shape()) as store:
        store.commit(_first_update())
    with pytest.raises(SettingsMismatchError, match=name) as info:
        RocksDBStateStore(path, changed.state_shape())
    assert name in info.value.differences
    stored, requested = info.value.differences[name]
    assert stored == SETTINGS.state_shape()[name] and requested == changed.state_shape()[name]
    # The refused open released the directory, and the state is intact.
    with RocksDBStateStore(path, SETTINGS.state_shape()) as store:
        assert store.next_seq() == 3


def test_rocksdb_threshold_is_not_state_shaping(tmp_path: Path) -> None:
    path = tmp_path / "state"
    RocksDBStateStore(path, SETTINGS.state_shape()).close()
    other = EngineSettings(num_perm=32, threshold=0.7, lsh=SETTINGS.bands)
    with RocksDBStateStore(path, other.state_shape()) as store:
        assert store.next_seq() == 0


def test_rocksdb_second_open_is_refused(tmp_path: Path) -> None:
    with RocksDBStateStore(tmp_path / "state", SETTINGS.state_shape()):
        with pytest.raises(StateError, match="cannot open"):
            RocksDBStateStore(tmp_path / "state", SETTINGS.state_shape())


# A writer committing batches forever: each batch adds its documents to 8 buckets (every
# seq in exactly one), relinks one old node to the batch's last seq, moves the position.
WRITER = r"""
import sys
import numpy as np
from neardup.core.settings import EngineSettings
from neardup.core.unionfind import Node
from neardup.state import StateUpdate, codec
from neardup.state.rocksdb import RocksDBStateStore

store = RocksDBStateStore(sys.argv[1], EngineSettings(num_perm=32).state_shape())
rng = np.random.default_rng(int(sys.argv[2]))
buckets = np.arange(8, dtype=np.uint64)
announced = False
while True:
    first = store.next_seq()
    k = int(rng.integers(1, 300))
    seqs = np.arange(first, first + k, dtype=np.uint64)
    nodes = {first + i: Node(first, 1, first) for i in range(k)}
    if first:
        nodes[int(rng.integers(0, first))] = Node(first + k - 1, 1, 0)
    store.commit(StateUpdate(
        first_seq=first,
        signatures=rng.integers(0, 2**64, size=(k, 32), dtype=np.uint64),
        ids=[f"doc-{s}" for s in range(first, first + k)],
        bucket_ids=buckets[seqs % 8],
        bucket_seqs=seqs,
        nodes=np.array([(s, *n) for s, n in nodes.items()], dtype=np.uint64),
        positions={"input": first + k},
        verdicts={b"v%012d" % s: b"x" for s in range(first, first + k)},
    ))
    if not announced:
        print("committing", flush=True)
        announced = True
"""


def _check_whole_batches(path: Path) -> int:
    """Assert every stored record belongs to a complete batch; return next_seq."""
    with RocksDBStateStore(path, SETTINGS.state_shape()) as store:
        next_seq = store.next_seq()
        assert store.get_position("input") == (next_seq or None)
        rebuilt = store.bucket_members(np.arange(8, dtype=np.uint64))
        assert rebuilt.counts.sum() == next_seq  # the index rebuilt from whole batches only
        assert np.array_equal(np.sort(rebuilt.seqs), np.arange(next_seq, dtype=np.uint64))
    families = {name: Options(raw_mode=True) for name in codec.FAMILIES}
    db = Rdict(str(path), Options(raw_mode=True), column_families=families)
    try:
        cf = {name: db.get_column_family(name) for name in codec.FAMILIES}
        seq_keys = codec.seq_keys(list(range(next_seq)))
        assert list(cf["signatures"].keys()) == seq_keys
        assert list(cf["documents"].keys()) == seq_keys
        assert sum(1 for _ in cf["verdicts"].keys()) == next_seq
        members = [codec.decode_memberships(v)[1] for v in cf["buckets"].values()]
        all_members = np.sort(np.concatenate([np.empty(0, np.uint64), *members]))
        assert all_members.tolist() == list(range(next_seq))
        keys, values = zip(*cf["nodes"].items()) if next_seq else ((), ())
        seqs, nodes = codec.decode_nodes(list(keys), list(values))
        assert len(seqs) == len(keys) and (seqs < next_seq).all()
        assert (nodes[:, 0] < next_seq).all() and (nodes[:, 2] < next_seq).all()  # parent, canonical
        for family in cf.values():
            family.close()
    finally:
        db.close()
    return next_seq


def test_rocksdb_commit_is_atomic_under_sigkill(tmp_path: Path) -> None:
    path = tmp_path / "state"
    rnd = random.Random(20240601)
    seen = [0]
    for round_ in range(5):
        proc = subprocess.Popen(
            [sys.executable, "-c", WRITER, str(path), str(round_)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            line = proc.stdout.readline() if proc.stdout else ""
            assert line.strip() == "committing", proc.stderr.read() if proc.stderr else ""
            try:
                proc.wait(timeout=rnd.uniform(0.01, 0.4))
            except subprocess.TimeoutExpired:
                pass
            assert proc.poll() is None, "the writer stopped by itself"
            proc.send_signal(signal.SIGKILL)
        finally:
            proc.kill()
            proc.wait()
        assert proc.returncode == -signal.SIGKILL
        seen.append(_check_whole_batches(path))
    # Every round committed at least its announced batch on top of the previous state.
    assert all(b > a for a, b in zip(seen, seen[1:])), seen


# --- the bucket index -------------------------------------------------------------------


@pytest.mark.parametrize("max_run", [index_module.MAX_RUN, 700])
def test_bucket_index_matches_a_dict_of_lists(max_run: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Batches of random memberships, merged into runs, answer like a plain dict."""
    monkeypatch.setattr(index_module, "MAX_RUN", max_run)
    rng = np.random.default_rng(7)
    index, reference = BucketIndex(), defaultdict(list)
    seq = 0
    for _ in range(60):
        k = int(rng.integers(0, 400))
        buckets = rng.choice(np.array([0, 1, 2**63, 2**64 - 1, *range(5, 300)], dtype=np.uint64), k)
        seqs = np.arange(seq, seq + k, dtype=np.uint64)
        seq += k
        index.add(buckets, seqs)
        for b, q in zip(buckets.tolist(), seqs.tolist()):
            reference[b].append(q)
        asked = np.unique(np.concatenate([rng.integers(0, 310, 40).astype(np.uint64),
                                          np.array([2**64 - 1, 2**63 + 1], dtype=np.uint64)]))
        found = index.lookup(asked)
        assert found.counts.tolist() == [len(reference.get(b, [])) for b in asked.tolist()]
        assert [found.seqs[found.owner == i].tolist() for i in range(len(asked))] == [
            reference.get(b, []) for b in asked.tolist()]
        shuffled = rng.permutation(asked)  # any order of distinct ids answers alike
        found = index.lookup(shuffled)
        assert (np.diff(found.owner) >= 0).all()
        assert [found.seqs[found.owner == i].tolist() for i in range(len(shuffled))] == [
            reference.get(b, []) for b in shuffled.tolist()]
    with pytest.raises(ValueError):
        index.lookup(np.array([5, 5], dtype=np.uint64))
    assert len(index) == seq
    if max_run > seq:
        assert index.runs <= 8  # merged into O(log n) runs
    else:  # runs stop growing at max_run
        assert index.runs >= seq // max_run
        assert all(len(run.buckets) <= max(max_run, 400) for run in index._runs)
    assert 12 * seq < index.nbytes <= 14 * seq + 8 * (4 + 4 * index.runs)  # runs and directories


def test_store_of_another_layout_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "state"
    RocksDBStateStore(path, SETTINGS.state_shape()).close()
    families = {name: Options(raw_mode=True) for name in codec.FAMILIES}
    db = Rdict(str(path), Options(raw_mode=True), column_families=families)
    stored = codec.decode_settings(db[codec.SETTINGS_KEY])
    db[codec.SETTINGS_KEY] = codec.encode_settings({**stored, "layout": 1})
    db.close()
    with pytest.raises(SettingsMismatchError, match="layout"):
        RocksDBStateStore(path, SETTINGS.state_shape())


def test_forest_closure_reaches_roots_and_canonicals() -> None:
    forest = Forest()
    forest.grow(10)
    # 7 -> 5 -> 2 (root, canonical 1); 1 -> 2; 9 -> 8 (root, canonical 8); the rest alone
    seqs = np.array([7, 5, 1, 2, 9, 8])
    forest.set(seqs, np.array([5, 2, 2, 2, 8, 8]), np.array([1, 1, 1, 4, 1, 2]),
               np.array([7, 5, 1, 1, 9, 8]))
    reach, canonicals = forest.closure(np.array([7, 3]))
    assert reach.tolist() == [1, 2, 3, 5, 7] and canonicals.tolist() == [1, 3]
    assert forest.node(7) == Node(5, 1, 7) and forest.node(3) is None and forest.node(10) is None
    parent, size, canonical = forest.nodes(np.array([2, 4]))
    assert (parent.tolist(), size.tolist(), canonical.tolist()) == ([2, 4], [4, 1], [1, 4])
    parent, size, canonical = forest.local_copy(reach, 2)  # local ids: 1 2 3 5 7 -> 0..4, new 5 6
    assert parent.tolist() == [1, 1, 2, 1, 3, 5, 6] and canonical.tolist() == [0, 0, 2, 3, 4, 5, 6]
    assert size.tolist() == [1, 4, 1, 1, 1, 1, 1]
    forest.grow(12)
    assert forest.node(11) is None and len(forest) == 12
    with pytest.raises(IndexError):
        forest.set(np.array([12]), np.array([0]), np.array([1]), np.array([0]))


def test_ids_come_from_the_recent_ring_and_from_the_store_alike(make_store: MakeStore, monkeypatch) -> None:
    """``get_ids`` gives every committed document's id, whether the ring of recent ids
    still holds it or it is read from the store (a ring of 8 here, 23 documents in
    batches of 5, then a batch larger than the ring), and after the store is reopened
    (the ring starts empty). An unknown seq still raises ``KeyError``."""
    from neardup.state import kv  # noqa: PLC0415

    monkeypatch.setattr(kv, "RECENT_IDS", 8)
    store = make_store()
    ids = [f"doc-{i}" for i in range(23)]
    first = 0
    for size in (5, 5, 3, 10):
        batch = ids[first:first + size]
        store.commit(StateUpdate(first_seq=first, signatures=None, ids=batch))
        first += size
        assert store.get_ids(list(range(first))) == ids[:first]
    assert store.get_ids([22, 0, 15, 14, 7]) == ["doc-22", "doc-0", "doc-15", "doc-14", "doc-7"]
    with pytest.raises(KeyError):
        store.get_ids([23])
    if isinstance(store, RocksDBStateStore):  # reopened: from the store
        store.close()
        reopened = make_store()
        assert reopened.get_ids(list(range(23))) == ids
