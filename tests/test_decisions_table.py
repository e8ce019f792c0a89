"""Decide's decisions table (``neardup.state.decisions``), in memory and in a real RocksDB
store, through one parametrised fixture: the same answers as a dict model of it, its
overlay of decisions taken and not yet read back, and (on disk) its entries and position
kept together across a reopen."""

from __future__ import annotations

import random

import pytest

from neardup.sharded.records import order_key, order_seq
from neardup.state.decisions import DecisionsTable, StoredDecisionsTable


def _seq(i: int) -> int:
    return order_seq(order_key(1_700_000_000_000 + i, i % 3, i))


@pytest.fixture(params=["memory", "disk"])
def table(request, tmp_path):
    t = DecisionsTable() if request.param == "memory" else StoredDecisionsTable(tmp_path / "decisions")
    yield t
    t.close()


def test_the_table_answers_as_a_dict_of_the_decisions_read_and_taken(table):
    rng = random.Random(7)
    clusters: dict[int, int] = {}
    names: dict[int, str] = {}
    offset = 0
    for batch in range(40):
        decisions = []
        for i in range(batch * 25, batch * 25 + 25):
            seq = _seq(i)
            earlier = [s for s in clusters if clusters[s] == s]
            canonical = seq if not earlier or rng.random() < 0.4 else rng.choice(earlier)
            name = f"doc-{i}" if canonical == seq else names[canonical]
            clusters[seq] = canonical
            names[canonical] = name
            decisions.append((seq, canonical, name))
        # half taken here first (a batch of this process), then all read back from the topic
        for seq, canonical, name in decisions[::2]:
            table.take(seq, canonical, name)
        assert table.taken() == len(decisions[::2])
        offset += len(decisions) + 1  # a transaction marker after each batch
        table.apply(decisions, offset)
        assert table.taken() == 0
        assert table.position() == offset
    for seq, canonical in clusters.items():
        assert seq in table and table[seq] == canonical
        assert table.name(canonical) == names[canonical]
    absent = _seq(10_000)
    assert absent not in table
    with pytest.raises(KeyError):
        table[absent]


def test_decisions_taken_are_seen_at_once_and_forgotten_when_their_batch_aborts(table):
    a, b, c = _seq(1), _seq(2), _seq(3)
    table.apply([(a, a, "a")], 5)
    table.take(b, a, "a")
    table.take(c, c, "c")
    assert table[b] == a and table[c] == c and table.name(c) == "c"
    table.forget_taken()
    assert b not in table and c not in table and table[a] == a
    assert table.position() == 5


def test_a_stored_table_reopens_at_its_position_and_a_wipe_empties_it(tmp_path):
    a, b = _seq(1), _seq(2)
    table = StoredDecisionsTable(tmp_path / "decisions")
    assert table.position() is None  # new: read the topic in full
    table.apply([(a, a, "story"), (b, a, "story")], 3)
    table.take(_seq(3), a, "story")  # not committed: not kept
    table.close()
    table = StoredDecisionsTable(tmp_path / "decisions")
    try:
        assert table.position() == 3
        assert table[b] == a and table.name(a) == "story" and _seq(3) not in table
        table.apply([(b, a, "story")], 4)  # read again (a position that lagged): the same
        assert table[b] == a and table.position() == 4
        table.wipe()
        assert table.position() is None and a not in table
    finally:
        table.close()


@pytest.fixture(params=["memory", "disk"])
def forest(request, tmp_path):
    t = (DecisionsTable(components=True) if request.param == "memory"
         else StoredDecisionsTable(tmp_path / "decisions", components=True))
    yield t
    t.close()


def test_merges_read_in_any_order_give_the_same_clusters(forest, tmp_path):
    # two decide processes merged root c concurrently, one into b, the other into a, each
    # without the other's decision: applied as unions, a, b and c end as one cluster
    # whose root is the earliest, whichever merge the topic holds first
    a, b, c, d, e, f = (_seq(i) for i in range(6))
    roots = [(a, a, "a"), (b, b, "b"), (c, c, "c")]
    merges = [(d, b, "b", (c,)), (e, a, "a", (c,)), (f, f, "f")]
    forest.apply(roots + merges, 10)
    other = StoredDecisionsTable(tmp_path / "other", components=True)
    try:
        other.apply(roots + merges[::-1], 10)
        for table in (forest, other):
            assert [table[s] for s in (a, b, c, d, e)] == [a] * 5
            assert table[f] == f and table.name(a) == "a"
    finally:
        other.close()


def test_merges_taken_are_seen_at_once_and_forgotten_when_their_batch_aborts(forest):
    a, b, c, d = (_seq(i) for i in range(4))
    forest.apply([(a, a, "a"), (b, b, "b")], 3)
    forest.take(c, a, "a", (b,))  # c joins a and b: b's cluster is a's now
    forest.take(d, b, "a")  # a later document of this batch sees the merge
    assert forest[b] == a and forest[c] == a and forest[d] == a
    forest.forget_taken()
    assert forest[b] == b and c not in forest and d not in forest
    forest.take(c, a, "a", (b,))
    forest.apply([(c, a, "a", (b,))], 4)  # read back: in the forest, not pending
    assert forest.taken() == 0 and forest[b] == a
