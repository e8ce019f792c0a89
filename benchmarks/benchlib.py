"""Helpers shared by the benchmarks in this folder (not a benchmark itself).

- the corpus (Reuters-21578 JSONL: ``id`` and ``text``) and the *replay stream*: the corpus
  replayed round after round, round 0 as it is, every later round with seeded random edits
  (``light``: one of fix-a-typo / drop-a-word / add-a-footer-line; ``heavy``: up to 5% of
  the words replaced by random corpus words, then one light edit, so that many replays are
  no longer near-duplicates of any earlier version);
- the reference implementations (datasketch and rensa, with Python shingling that copies
  neardup's word 5-grams);
- the environment of a run (git commit, dirty ``src/``, load average, package versions),
  memory readings, quantiles and plain-text tables.

The scripts import it as ``benchlib`` (they put this folder on ``sys.path``).
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import platform
import random
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import numpy as np

from neardup.core.normalize import normalize
from neardup.core.settings import EngineSettings
from neardup.records import record_id, record_text

REPO = Path(__file__).resolve().parents[1]
#: The shared Reuters copy, next to the checkout or next to its folder of worktrees.
DEFAULT_CORPUS = next((p / "shared" / "data" / "reuters21578" / "reuters21578.jsonl.gz" for p in REPO.parents[:2]
                       if (p / "shared" / "data" / "reuters21578" / "reuters21578.jsonl.gz").exists()),
                      REPO.parent / "shared" / "data" / "reuters21578" / "reuters21578.jsonl.gz")
FALLBACK_CORPUS = REPO / "tests" / "data" / "reuters_excerpt.jsonl.gz"
TEXT_FIELD, ID_FIELD = "text", "id"
BATCH_SIZE = 1000
RENSA_BANDS = 16
_WORD = re.compile(r"\w+")


def default_corpus() -> Path:
    """Reuters-21578 beside the checkout, else the excerpt in ``tests/data`` (said on
    stderr: numbers from the excerpt are not comparable with those from Reuters)."""
    if DEFAULT_CORPUS.exists():
        return DEFAULT_CORPUS
    print(f"benchlib: {DEFAULT_CORPUS} not found; using the excerpt {FALLBACK_CORPUS}", file=sys.stderr)
    return FALLBACK_CORPUS


# --- corpus ------------------------------------------------------------------------------


@dataclass
class Corpus:
    """Records in memory. ``path`` is a file neardup can read (a cut copy with a limit)."""

    path: Path | None
    ids: list[str]
    texts: list[str]

    def __len__(self) -> int:
        return len(self.texts)

    @cached_property
    def megabytes(self) -> float:
        return sum(len(t.encode("utf-8")) for t in self.texts) / 1e6

    def head(self, n: int) -> Corpus:
        """The first ``n`` records (no file)."""
        return Corpus(None, self.ids[:n], self.texts[:n])


def load_corpus(path: Path, limit: int | None = None, scratch: Path | None = None) -> Corpus:
    """Read ids and texts as neardup does (``id``, else the line number; ``text``).

    With ``limit`` and ``scratch``, the first ``limit`` lines are also written to a cut
    file in ``scratch`` (``Corpus.path``) for tools that read files.
    """
    lines: list[str] = []
    with gzip.open(path, "rt", encoding="utf-8") as f:
        for line in f:
            if line.strip():
                lines.append(line)
                if limit is not None and len(lines) == limit:
                    break
    if limit is not None and scratch is not None:
        path = scratch / f"corpus-{len(lines)}.jsonl.gz"
        with gzip.open(path, "wt", encoding="utf-8") as out:
            out.writelines(lines)
    ids, texts = [], []
    for number, line in enumerate(lines, start=1):
        record = json.loads(line)
        ids.append(record_id(record, ID_FIELD) or str(number))
        texts.append(record_text(record, [TEXT_FIELD]))
    return Corpus(path, ids, texts)


# --- the replay stream -------------------------------------------------------------------

EDIT_KINDS = ("typo", "drop_word", "footer")
_LONG_WORD = re.compile(r"[^\W\d_]{4,}")
_WORD_AND_SPACE = re.compile(r"\S+\s*")
_NAMES = ("Jane Smith", "Peter Gunn", "Ana Ortiz", "Li Wei", "Tom Berger", "Sara Okafor")
_CITIES = ("London", "New York", "Tokyo", "Frankfurt", "Sydney", "Toronto")
_FOOTERS = (
    "(Reporting by {name}; editing by {name2})",
    "Repeats item issued earlier with no change to the text",
    "(Corrects spelling in paragraph two; version {r})",
    "Additional reporting by {name} in {city}",
    "For related news, see story {code}",
    "Reuters {city} desk +44 20 7542 {code}",
)
#: ``heavy`` edits replace this share of the words at most (uniform in [0, max] per replay).
HEAVY_MAX_REPLACED = 0.05


def _typo(text: str, rng: random.Random) -> str:
    """Swap two adjacent inner letters of one word of 4+ letters (a typo made or fixed)."""
    words = [m.span() for m in _LONG_WORD.finditer(text)]
    if not words:
        return text
    start, end = rng.choice(words)
    j = rng.randrange(start + 1, end - 2) if end - start > 3 else start
    return text[:j] + text[j + 1] + text[j] + text[j + 2 :]


def _drop_word(text: str, rng: random.Random) -> str:
    spans = [m.span() for m in _WORD_AND_SPACE.finditer(text)]
    if len(spans) < 2:
        return text
    start, end = rng.choice(spans)
    return text[:start] + text[end:]


def _footer(text: str, rng: random.Random, round_: int) -> str:
    name, name2 = rng.sample(_NAMES, 2)
    line = rng.choice(_FOOTERS).format(name=name, name2=name2, city=rng.choice(_CITIES),
                                       r=round_, code=rng.randrange(1000, 9999))
    return f"{text}\n{line}"


def light_edit(text: str, rng: random.Random, round_: int) -> str:
    """One edit, chosen uniformly: fix a typo, drop a word, or add a footer line."""
    kind = rng.choice(EDIT_KINDS)
    if kind == "typo":
        return _typo(text, rng)
    if kind == "drop_word":
        return _drop_word(text, rng)
    return _footer(text, rng, round_)


def heavy_edit(text: str, rng: random.Random, round_: int, vocabulary: Sequence[str]) -> str:
    """Replace a share p ~ U(0, HEAVY_MAX_REPLACED) of the words by random corpus words
    (the text's white space becomes single spaces), then ``light_edit``."""
    words = text.split()
    share = rng.uniform(0.0, HEAVY_MAX_REPLACED)
    k = min(len(words), int(share * len(words) + rng.random()))
    for j in rng.sample(range(len(words)), k):
        words[j] = rng.choice(vocabulary)
    return light_edit(" ".join(words), rng, round_)


def vocabulary(corpus: Corpus, docs: int = 2000) -> list[str]:
    """Distinct word tokens of the first ``docs`` texts, sorted (deterministic)."""
    return sorted({w for t in corpus.texts[:docs] for w in _WORD.findall(t)})


def replay_stream(corpus: Corpus, docs: int, edits: str = "light", seed: int = 1) -> Iterator[tuple[str, str]]:
    """``docs`` (id, text) pairs: the corpus replayed round after round.

    Round 0 is the corpus as it is. In round r >= 1 the i-th record gets the id
    ``<id>~r<r>`` and its text edited by ``light_edit`` (or ``heavy_edit``), from a
    ``random.Random`` seeded with (edits, seed, r): the stream depends only on the corpus,
    ``edits`` and ``seed``, and a shorter stream is a prefix of a longer one.
    """
    if edits not in ("light", "heavy"):
        raise ValueError(f"edits must be light or heavy, not {edits!r}")
    n = len(corpus)
    vocab = vocabulary(corpus) if edits == "heavy" else []
    rng = random.Random()
    for k in range(docs):
        round_, i = divmod(k, n)
        if round_ == 0:
            yield corpus.ids[i], corpus.texts[i]
            continue
        if i == 0:
            rng = random.Random(f"neardup-bench:{edits}:{seed}:{round_}")
        text = corpus.texts[i]
        text = light_edit(text, rng, round_) if edits == "light" else heavy_edit(text, rng, round_, vocab)
        yield f"{corpus.ids[i]}~r{round_}", text


def replay_corpus(corpus: Corpus, docs: int, edits: str = "light", seed: int = 1) -> Corpus:
    """``replay_stream`` materialised."""
    ids, texts = [], []
    for doc_id, text in replay_stream(corpus, docs, edits, seed):
        ids.append(doc_id)
        texts.append(text)
    return Corpus(None, ids, texts)


# --- reference implementations -----------------------------------------------------------


@dataclass
class Result:
    """One tool's run over a corpus: one row of a comparison table."""

    tool: str
    documents: int
    megabytes: float
    seconds: float
    duplicates: int
    setup: str
    duplicate_ids: set[str] = field(default_factory=set, repr=False)
    #: neardup in engine.py only: seconds inside dedup_files' batches.
    batch_seconds: float | None = None

    @property
    def docs_per_second(self) -> float:
        return self.documents / self.seconds

    @property
    def mb_per_second(self) -> float:
        return self.megabytes / self.seconds

    def as_dict(self, baseline: Result | None = None) -> dict[str, object]:
        out: dict[str, object] = {
            "tool": self.tool,
            "setup": self.setup,
            "documents": self.documents,
            "megabytes": round(self.megabytes, 3),
            "seconds": round(self.seconds, 3),
            "documents_per_second": round(self.docs_per_second, 1),
            "megabytes_per_second": round(self.mb_per_second, 3),
            "duplicates": self.duplicates,
        }
        if baseline is not None:
            out["neardup_speedup"] = round(baseline.docs_per_second / self.docs_per_second, 2)
        return out


def python_shingles(text: str, n: int) -> list[str]:
    """Word n-grams of the normalised text; one shingle of every token when fewer than n."""
    tokens = _WORD.findall(normalize(text))
    if len(tokens) < n:
        return [" ".join(tokens)] if tokens else []
    return [" ".join(tokens[i : i + n]) for i in range(len(tokens) - n + 1)]


def _query_then_insert(corpus: Corpus, settings: EngineSettings, lsh: Any,
                       make_sketch: Callable[[list[str]], Any]) -> tuple[float, set[str]]:
    """Shingle each text in Python, sketch it, query ``lsh``, then insert it.

    A document is a duplicate if a candidate from the query (an earlier document) has an
    estimated Jaccard similarity of at least the threshold. Returns (seconds, duplicate ids).
    """
    import time

    started = time.perf_counter()
    sketches: dict[int, Any] = {}
    duplicate_ids: set[str] = set()
    for key, (doc_id, text) in enumerate(zip(corpus.ids, corpus.texts)):
        shingles = python_shingles(text, settings.shingling.n)
        if not shingles:
            continue
        sketch = make_sketch(shingles)
        if any(sketch.jaccard(sketches[c]) >= settings.threshold for c in lsh.query(sketch)):
            duplicate_ids.add(doc_id)
        lsh.insert(key, sketch)
        sketches[key] = sketch
    return time.perf_counter() - started, duplicate_ids


def run_datasketch(corpus: Corpus, settings: EngineSettings) -> Result:
    """Python shingling, ``MinHash.update_batch``, in-memory ``MinHashLSH`` query/insert."""
    from datasketch import MinHash, MinHashLSH

    def sketch(shingles: list[str]) -> MinHash:
        m = MinHash(num_perm=settings.num_perm, seed=settings.seed)
        m.update_batch([s.encode("utf-8") for s in shingles])
        return m

    lsh = MinHashLSH(threshold=settings.threshold, num_perm=settings.num_perm)
    seconds, duplicate_ids = _query_then_insert(corpus, settings, lsh, sketch)
    return Result(
        tool="datasketch",
        documents=len(corpus),
        megabytes=corpus.megabytes,
        seconds=seconds,
        duplicates=len(duplicate_ids),
        setup=f"MinHashLSH in memory, {lsh.b} bands x {lsh.r} rows, estimate >= {settings.threshold}",
        duplicate_ids=duplicate_ids,
    )


def run_rensa(corpus: Corpus, settings: EngineSettings) -> Result:
    """Python shingling, ``RMinHash.update``, in-memory ``RMinHashLSH`` query/insert."""
    from rensa import RMinHash, RMinHashLSH

    def sketch(shingles: list[str]) -> RMinHash:
        m = RMinHash(num_perm=settings.num_perm, seed=settings.seed)
        m.update(shingles)
        return m

    lsh = RMinHashLSH(threshold=settings.threshold, num_perm=settings.num_perm, num_bands=RENSA_BANDS)
    seconds, duplicate_ids = _query_then_insert(corpus, settings, lsh, sketch)
    rows = settings.num_perm // RENSA_BANDS
    return Result(
        tool="rensa",
        documents=len(corpus),
        megabytes=corpus.megabytes,
        seconds=seconds,
        duplicates=len(duplicate_ids),
        setup=f"RMinHashLSH in memory, {RENSA_BANDS} bands x {rows} rows, estimate >= {settings.threshold}",
        duplicate_ids=duplicate_ids,
    )


def agreement(a: Result, b: Result) -> dict[str, int]:
    """Overlap of two tools' duplicate id sets."""
    x, y = a.duplicate_ids, b.duplicate_ids
    return {"both": len(x & y), f"only_{a.tool}": len(x - y), f"only_{b.tool}": len(y - x)}


# --- environment -------------------------------------------------------------------------


def package_version(package: str) -> str | None:
    try:
        return version(package)
    except PackageNotFoundError:
        return None


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True,
                              timeout=30, check=True).stdout.rstrip("\n")
    except (OSError, subprocess.SubprocessError):
        return ""


def src_digest() -> str:
    """SHA-1 (12 hex) over the paths and bytes of src/neardup/**/*.py as they are on disk."""
    h = hashlib.sha1()
    for p in sorted((REPO / "src" / "neardup").rglob("*.py")):
        h.update(str(p.relative_to(REPO)).encode())
        h.update(p.read_bytes())
    return h.hexdigest()[:12]


def git_state() -> dict[str, object]:
    """The commit (``git rev-parse --short HEAD``), the src/ files that differ from it, and
    a digest of src/ as it is on disk (the code a measurement actually imported)."""
    dirty = [line[3:] for line in _git("status", "--porcelain", "--", "src").splitlines() if line]
    return {"commit": _git("rev-parse", "--short", "HEAD").strip() or "unknown", "src_dirty_files": dirty,
            "src_digest": src_digest()}


def describe_git(state: dict[str, object]) -> str:
    dirty = state["src_dirty_files"]
    tail = f", src/ differs from it in {len(dirty)} file(s): {', '.join(dirty)}" if dirty else ", src/ clean"  # type: ignore[arg-type]
    return f"commit {state['commit']}{tail} (src digest {state['src_digest']})"


def environment() -> dict[str, object]:
    return {
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "loadavg": [round(x, 2) for x in os.getloadavg()],
        **{p: package_version(p) for p in
           ("neardup", "numpy", "rocksdict", "datasketch", "rensa", "confluent-kafka")},
    }


# --- memory ------------------------------------------------------------------------------


def mode_worker(prefix: str, run: Callable[[Path], dict[str, Any]]) -> None:
    """The child side of ``modes_in_processes``: ``run`` in a fresh temporary directory
    (removed after), its result printed as one JSON line."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix=prefix) as state:
        print(json.dumps(run(Path(state))))


def modes_in_processes(script: str, modes: Sequence[str], *args: str) -> list[dict[str, Any]]:
    """Run ``script --mode M *args`` for each of ``modes``, one process after the other, so
    that each process's memory readings are its own; the JSON object each prints last."""
    runs = []
    for mode in modes:
        out = subprocess.run([sys.executable, script, "--mode", mode, *args], capture_output=True, text=True,
                             check=True)
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    return runs


def proc_status_mb(pid: int | str = "self") -> dict[str, float]:
    """VmRSS (current) and VmHWM (peak) of a process from /proc/<pid>/status, in MB (1e6 B)."""
    out: dict[str, float] = {}
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in ("VmRSS", "VmHWM"):
                    out[key] = int(rest.split()[0]) * 1024 / 1e6
    except OSError:
        pass
    return out


def proc_cpu_seconds(pid: int | str = "self", thread: int | None = None) -> float | None:
    """User + system CPU seconds of a process (all its threads) from /proc/<pid>/stat, or
    of its thread ``thread`` alone (``/proc/<pid>/task/<thread>/stat``; the main thread:
    ``thread == pid``)."""
    path = f"/proc/{pid}/stat" if thread is None else f"/proc/{pid}/task/{thread}/stat"
    try:
        with open(path, encoding="ascii") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def dir_bytes(path: Path) -> int:
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += os.stat(os.path.join(root, name)).st_size
            except OSError:
                pass
    return total


# --- numbers and tables ------------------------------------------------------------------


def quantiles(values: Sequence[float] | np.ndarray, qs: Sequence[float] = (50, 90, 99)) -> dict[str, float]:
    """p50/p90/p99 (linear interpolation), max, mean and count."""
    a = np.asarray(values, dtype=np.float64)
    if a.size == 0:
        return {"count": 0}
    out = {f"p{q:g}": float(np.percentile(a, q)) for q in qs}
    out.update(max=float(a.max()), mean=float(a.mean()), count=int(a.size))
    return out


def table(headers: Sequence[str], rows: Sequence[Sequence[object]], left: int = 1) -> str:
    """A plain-text table; the first ``left`` columns are left-aligned, the rest right."""
    cells = [[str(c) for c in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]

    def line(r: list[str]) -> str:
        return "  ".join(c.ljust(w) if i < left else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip()

    out = [line(cells[0]), "-" * len(line(cells[0]))]
    out += [line(r) for r in cells[1:]]
    return "\n".join(out)


def write_json(path: Path, report: dict[str, object]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")


def wait_listening(port: int, proc: subprocess.Popen, timeout_s: float = 120.0) -> None:
    """Wait until something listens on 127.0.0.1:``port``.

    Raises:
        RuntimeError: ``proc`` exited first.
        TimeoutError: nothing listened within ``timeout_s`` seconds.
    """
    import socket

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the process exited with {proc.returncode}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.2)
    raise TimeoutError(f"nothing listens on port {port}")
