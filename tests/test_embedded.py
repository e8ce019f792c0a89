"""The embedded mode on real files and a real RocksDB state: a rerun never destroys
earlier output, a killed run resumed gives exactly the outputs of an uninterrupted one,
inputs are known by content and checked before any output is touched.
"""

from __future__ import annotations

import gzip
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from neardup.cli import main
from neardup.embedded import OUTPUTS_KEY
from neardup.state.rocksdb import RocksDBStateStore
from neardup.config import Settings

DATA = Path(__file__).parent / "data" / "reuters_excerpt.jsonl.gz"
SRC = Path(__file__).resolve().parent.parent / "src"
OUTPUTS = ("unique", "duplicates", "rejects")


def _stories(n: int | None = None, skip: int = 0) -> list[str]:
    with gzip.open(DATA, "rt", encoding="utf-8") as f:
        lines = f.read().splitlines()
    return lines[skip:][:n]


def _write(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def _outputs(out: Path) -> dict[str, bytes]:
    return {name: (out / f"{name}.jsonl").read_bytes() for name in OUTPUTS}


def _count(out: Path) -> dict[str, int]:
    return {name: len(data.splitlines()) for name, data in _outputs(out).items()}


def _one_error_line(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("neardup: error: "), err
    assert "Traceback" not in err
    return lines[0]


def _dedup(*args: str) -> int:
    return main(["dedup", "--no-pipeline", "--log-level", "WARNING", *map(str, args)])


def test_a_rerun_with_the_state_continues_its_outputs(tmp_path: Path) -> None:
    stories = _write(tmp_path / "in.jsonl", _stories(600))
    state, out = tmp_path / "state", tmp_path / "out"
    assert _dedup(stories, "--state-dir", state, "--out-dir", out) == 0
    first = _outputs(out)
    assert sum(_count(out).values()) == 600
    assert _dedup(stories, "--state-dir", state, "--out-dir", out) == 0  # nothing new to read
    assert _outputs(out) == first  # it used to truncate them: 600 verdicts became 0
    more = _write(tmp_path / "more.jsonl", _stories(200, skip=600))
    assert _dedup(stories, more, "--state-dir", state, "--out-dir", out) == 0
    counts = _count(out)
    assert sum(counts.values()) == 800
    assert all(_outputs(out)[name].startswith(first[name]) for name in OUTPUTS)


def test_non_empty_outputs_not_from_the_state_are_refused(tmp_path: Path, capsys) -> None:
    stories = _write(tmp_path / "in.jsonl", _stories(300))
    out = tmp_path / "out"
    assert _dedup(stories, "--out-dir", out) == 0
    first = _outputs(out)
    capsys.readouterr()
    assert _dedup(stories, "--out-dir", out) == 2  # no state: the rerun would replace them
    assert "--overwrite" in _one_error_line(capsys)
    assert _outputs(out) == first
    assert _dedup(stories, "--out-dir", out, "--append") == 0
    assert _count(out)["unique"] == 2 * first["unique"].count(b"\n")
    assert _dedup(stories, "--out-dir", out, "--overwrite") == 0
    assert _outputs(out) == first


def test_outputs_changed_since_the_state_recorded_them_are_refused(tmp_path: Path, capsys) -> None:
    stories = _write(tmp_path / "in.jsonl", _stories(300))
    state, out = tmp_path / "state", tmp_path / "out"
    assert _dedup(stories, "--state-dir", state, "--out-dir", out) == 0
    (out / "unique.jsonl").write_text("")  # e.g. emptied by hand: the verdicts are gone
    capsys.readouterr()
    assert _dedup(stories, "--state-dir", state, "--out-dir", out) == 2
    assert "fewer than" in _one_error_line(capsys)


def test_a_typo_in_an_input_leaves_the_outputs_alone(tmp_path: Path, capsys) -> None:
    stories = _write(tmp_path / "in.jsonl", _stories(300))
    out = tmp_path / "out"
    assert _dedup(stories, "--out-dir", out) == 0
    first = _outputs(out)
    capsys.readouterr()
    assert _dedup(stories, tmp_path / "typo.jsonl", "--out-dir", out, "--overwrite") == 2
    assert "input not found" in _one_error_line(capsys)
    assert _outputs(out) == first  # it used to empty them before failing
    assert _dedup(tmp_path, "--out-dir", out, "--overwrite") == 2
    assert "is a directory" in _one_error_line(capsys)
    assert _outputs(out) == first


def test_gzip_is_known_by_its_magic_bytes_on_stdin_too(tmp_path: Path) -> None:
    lines = _stories(200)
    packed = gzip.compress("".join(line + "\n" for line in lines).encode())
    (tmp_path / "wire.jsonl").write_bytes(packed)  # gzip without the .gz suffix
    assert _dedup(tmp_path / "wire.jsonl", "--out-dir", tmp_path / "a") == 0
    counts = _count(tmp_path / "a")
    assert counts["rejects"] == 0 and counts["unique"] + counts["duplicates"] == 200
    proc = subprocess.run(
        [sys.executable, "-m", "neardup.cli", "dedup", "-", "--out-dir", str(tmp_path / "b"), "--no-pipeline"],
        input=packed, capture_output=True, env={**os.environ, "PYTHONPATH": str(SRC)}, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr.decode()[-2000:]
    assert _outputs(tmp_path / "b") == _outputs(tmp_path / "a")


def test_a_file_rewritten_under_the_same_name_is_read_again(tmp_path: Path, capsys) -> None:
    stories = tmp_path / "in.jsonl"
    state, out = tmp_path / "state", tmp_path / "out"
    _write(stories, _stories(300))
    assert _dedup(stories, "--state-dir", state, "--out-dir", out) == 0
    _write(stories, _stories(300, skip=300))  # new content, same name
    assert _dedup(stories, "--state-dir", state, "--out-dir", out, "--summary-json", tmp_path / "s.json") == 0
    summary = json.loads((tmp_path / "s.json").read_text())
    assert summary["documents"] + summary["rejects"] == 300  # it used to skip all 300 lines
    assert summary["resumed_at_line"] == {}
    assert "not the file read before under this name" in capsys.readouterr().err
    # The same content under another name is the same input: resumed, and said so.
    copy = _write(tmp_path / "copy.jsonl", _stories(300, skip=300))
    assert _dedup(copy, "--state-dir", state, "--out-dir", out, "--summary-json", tmp_path / "s.json",
                  "--log-level", "INFO") == 0
    summary = json.loads((tmp_path / "s.json").read_text())
    assert summary["documents"] == 0 and summary["resumed_at_line"] == {str(copy): 300}
    assert "resuming after line 300" in capsys.readouterr().err


def test_repeated_ids_stay_distinguishable(tmp_path: Path, capsys) -> None:
    text = json.loads(_stories(1)[0])["text"]
    other = json.loads(_stories(1, skip=1)[0])["text"]
    records = [{"id": "x", "text": text}, {"id": "x", "text": text}, {"id": "x", "text": other}]
    stories = _write(tmp_path / "in.jsonl", [json.dumps(r) for r in records])
    out = tmp_path / "out"
    assert _dedup(stories, "--out-dir", out) == 0
    unique = [json.loads(line) for line in _outputs(out)["unique"].splitlines()]
    dups = [json.loads(line) for line in _outputs(out)["duplicates"].splitlines()]
    assert [r["neardup"]["id"] for r in unique] == ["x", "x@in.jsonl:3"]
    assert [r["neardup"]["id"] for r in dups] == ["x@in.jsonl:2"]
    assert dups[0]["neardup"]["match"] == "x" and dups[0]["id"] == "x"  # the record as it came
    assert len({r["neardup"]["cluster"] for r in unique}) == 2
    assert "id 'x' seen before" in capsys.readouterr().err


# A real SIGKILL of `neardup dedup` mid-file, then the same command again.

def _committed(state: Path, out: Path) -> dict[str, int]:
    with RocksDBStateStore(state, Settings().engine().state_shape()) as store:
        [raw] = store.get_verdicts([OUTPUTS_KEY + str(out.resolve()).encode()])
    return json.loads(raw) if raw else {}


def _sizes(out: Path) -> dict[str, int]:
    return {name: (out / f"{name}.jsonl").stat().st_size if (out / f"{name}.jsonl").exists() else 0
            for name in OUTPUTS}


def _command(stories: Path, state: Path, out: Path) -> list[str]:
    return [sys.executable, "-m", "neardup.cli", "dedup", str(stories), "--state-dir", str(state),
            "--out-dir", str(out), "--batch-size", "250", "--log-level", "WARNING"]


def _kill_when_written(cmd: list[str], out: Path, past: int, log: Path) -> None:
    """Start ``cmd``; SIGKILL it the moment unique.jsonl grows past ``past`` bytes, so
    that the kill lands while a batch is written, before its commit."""
    with open(log, "ab") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err,
                                env={**os.environ, "PYTHONPATH": str(SRC)}, start_new_session=True)
    try:
        deadline = time.monotonic() + 600
        while _sizes(out)["unique"] <= past:
            assert proc.poll() is None, f"finished before it was killed: {log.read_text()[-2000:]}"
            assert time.monotonic() < deadline
            time.sleep(0.001)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the run and its preparing worker
        proc.wait()


def test_a_killed_run_resumed_gives_the_outputs_of_an_uninterrupted_run(tmp_path: Path) -> None:
    stories = _write(tmp_path / "in.jsonl", _stories(4000))
    whole = _command(stories, tmp_path / "state-whole", tmp_path / "whole")
    done = subprocess.run(whole, capture_output=True, env={**os.environ, "PYTHONPATH": str(SRC)}, timeout=900)
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    expected = _outputs(tmp_path / "whole")

    state, out, log = tmp_path / "state", tmp_path / "out", tmp_path / "killed.log"
    torn = 0
    # seven kills: on a loaded machine four once all landed between batches
    for past in (200_000, 600_000, 1_000_000, 1_500_000, 2_000_000, 2_500_000, 3_000_000):
        _kill_when_written(_command(stories, state, out), out, past, log)
        sizes, committed = _sizes(out), _committed(state, out)
        assert all(sizes[n] >= committed[n] for n in OUTPUTS)
        torn += sizes != committed  # lines past the committed position
    assert torn, "no kill landed between a batch's writes and its commit"
    again = subprocess.run(_command(stories, state, out), capture_output=True,
                           env={**os.environ, "PYTHONPATH": str(SRC)}, timeout=900)
    assert again.returncode == 0, again.stderr.decode()[-2000:]
    assert _outputs(out) == expected


def test_a_cold_kernel_cache_is_announced(tmp_path: Path, capsys) -> None:
    cold = subprocess.run(
        [sys.executable, "-m", "neardup.cli", "dedup", str(tmp_path / "missing.jsonl")],
        capture_output=True, text=True, timeout=300,
        env={**os.environ, "PYTHONPATH": str(SRC), "NUMBA_CACHE_DIR": str(tmp_path / "numba"),
             "NEARDUP_KERNELS": "jit"},
    )
    assert cold.returncode == 2
    assert "compiling kernels, first run only" in cold.stderr
    from neardup.core.settings import EngineSettings
    from neardup.detector import kernels_cached, warm_up

    warm_up(EngineSettings())  # loads the kernels, compiling those not cached yet
    assert kernels_cached()
    stories = _write(tmp_path / "in.jsonl", _stories(20))
    assert main(["dedup", str(stories), "--out-dir", str(tmp_path / "out"), "--no-pipeline"]) == 0
    assert "compiling kernels" not in capsys.readouterr().err


def test_lines_parsed_and_prepared_in_the_worker_give_the_outputs_of_one_process(tmp_path: Path) -> None:
    """``neardup dedup -`` fed a batch at a time until its worker process has started,
    then the rest: the batches the worker parsed and prepared (good, blank and bad lines
    alike) come out byte for byte as ``--no-pipeline`` writes them."""
    bad = ['{not json', '["a", "list"]', '{"id": "t"}', '{"id": "v", "text": 7}', "\u3000",
           '{"id": "m", "text": "a record that holds one already", "neardup": {"x": 1}}']
    lines = []
    for k, story in enumerate(_stories(900)):
        lines.append(story)
        if k % 20 == 0:
            lines.append(bad[(k // 20) % len(bad)])
        if k % 7 == 0:  # a republished copy, with a new lead
            record = json.loads(story)
            lines.append(json.dumps({"id": f"copy-{k}", "text": "UPDATE 1 - " + record["text"]}))
    data = "".join(line + "\n" for line in lines).encode()
    batch = 5
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    one = subprocess.run([sys.executable, "-m", "neardup.cli", "dedup", "-", "--out-dir", str(tmp_path / "one"),
                          "--batch-size", str(batch), "--no-pipeline"], input=data, capture_output=True, env=env, timeout=600)
    assert one.returncode == 0, one.stderr.decode()[-2000:]

    proc = subprocess.Popen([sys.executable, "-m", "neardup.cli", "dedup", "-", "--out-dir", str(tmp_path / "two"),
                             "--batch-size", str(batch), "--log-level", "INFO"],
                            stdin=subprocess.PIPE, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, env=env)
    err: list[str] = []
    reader = threading.Thread(target=lambda: err.extend(line.decode() for line in proc.stderr), daemon=True)
    reader.start()
    sent = 0
    deadline = time.monotonic() + 120
    while not any("preparing worker started" in line for line in err):
        assert time.monotonic() < deadline and sent < len(lines) - 200, "the worker did not start"
        proc.stdin.write("".join(line + "\n" for line in lines[sent:sent + batch]).encode())
        proc.stdin.flush()
        sent += batch
        time.sleep(0.05)
    proc.stdin.write("".join(line + "\n" for line in lines[sent:]).encode())  # the worker's share
    proc.stdin.close()
    assert proc.wait(timeout=600) == 0, "".join(err)[-2000:]
    reader.join(10)
    assert len(lines) - sent >= 200
    assert _outputs(tmp_path / "two") == _outputs(tmp_path / "one")
    counts = _count(tmp_path / "one")
    assert counts["duplicates"] >= 129 and counts["rejects"] == 31


def _stdin_command(state: Path, out: Path) -> list[str]:
    return [sys.executable, "-m", "neardup.cli", "dedup", "-", "--state-dir", str(state), "--out-dir", str(out),
            "--batch-size", "100", "--no-pipeline", "--log-level", "INFO"]


def test_a_rerun_over_stdin_of_an_interrupted_run_is_refused(tmp_path: Path) -> None:
    """stdin has no identity, so a run over it cannot be resumed: the start says so in
    one line; a run over stdin killed after 200 or 300 committed lines, run again over the whole
    input, is refused with one line and leaves the outputs as they were (read again, those
    lines would be duplicates of themselves). A run over stdin that ended does not
    stop the next one."""
    lines = _stories(600)
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    state, out = tmp_path / "state", tmp_path / "out"
    proc = subprocess.Popen(_stdin_command(state, out), stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, env=env, start_new_session=True)
    err: list[str] = []
    reader = threading.Thread(target=lambda: err.extend(line.decode() for line in proc.stderr), daemon=True)
    reader.start()
    proc.stdin.write("".join(line + "\n" for line in lines[:300]).encode())
    proc.stdin.flush()
    deadline, last, stable_since = time.monotonic() + 300, None, time.monotonic()
    while time.monotonic() - stable_since < 3:  # 3 batches written and committed, waiting for more
        assert proc.poll() is None and time.monotonic() < deadline, "".join(err)[-2000:]
        sizes = _sizes(out)
        if sizes != last or sum(sizes.values()) == 0:
            last, stable_since = sizes, time.monotonic()
        time.sleep(0.1)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    reader.join(10)
    starts = [line for line in err if "stdin cannot be resumed" in line]
    assert len(starts) == 1 and "a rerun over stdin with --state-dir" in starts[0], "".join(err)[-2000:]
    before = _outputs(out)
    written = sum(len(data.splitlines()) for data in before.values())
    assert written >= 200  # the batch of lines 201-300 may wait for the line after it

    data = "".join(line + "\n" for line in lines).encode()
    again = subprocess.run(_stdin_command(state, out), input=data, capture_output=True, env=env, timeout=600)
    stderr = again.stderr.decode()
    assert again.returncode == 2, stderr[-2000:]
    errors = [line for line in stderr.splitlines() if line.startswith("neardup: error: ")]
    assert len(errors) == 1 and "Traceback" not in stderr, stderr[-2000:]
    assert f"interrupted after line {written}" in errors[0] and "stdin cannot be resumed" in errors[0]
    assert _outputs(out) == before

    # a run over stdin that reaches its end leaves the state open to the next one
    state2, out2 = tmp_path / "state2", tmp_path / "out2"
    first = subprocess.run(_stdin_command(state2, out2), input="".join(l + "\n" for l in lines[:300]).encode(),
                           capture_output=True, env=env, timeout=600)
    assert first.returncode == 0, first.stderr.decode()[-2000:]
    second = subprocess.run(_stdin_command(state2, out2), input="".join(l + "\n" for l in lines[300:]).encode(),
                            capture_output=True, env=env, timeout=600)
    assert second.returncode == 0, second.stderr.decode()[-2000:]
    assert sum(len(d.splitlines()) for d in _outputs(out2).values()) == 600


def test_a_state_for_one_run_is_in_memory_for_small_files_and_gives_the_same_outputs(tmp_path: Path, monkeypatch) -> None:
    """Without ``--state-dir``: files under ``MEMORY_STATE_BYTES`` together keep the state
    in memory; larger inputs, stdin and a retention window keep it in a temporary RocksDB
    directory; both give the same outputs byte for byte."""
    import neardup.embedded as embedded
    from neardup.core.settings import EngineSettings
    from neardup.files import check_input
    from neardup.state.memory import MemoryStateStore

    lines = []
    for k, story in enumerate(_stories(400)):
        lines.append(story)
        if k % 5 == 0:
            record = json.loads(story)
            lines.append(json.dumps({"id": f"copy-{k}", "text": "UPDATE 1 - " + record["text"]}))
    stories = _write(tmp_path / "stories.jsonl", lines)
    small = [check_input(str(stories))]
    settings = EngineSettings()

    def kind(sources, retention=None) -> type:
        store = embedded._one_run_store(sources, settings, str(tmp_path / "scratch"), retention)
        store.close()
        return type(store)

    assert kind(small) is MemoryStateStore
    assert kind(small, {"documents": 100}) is RocksDBStateStore
    assert kind([check_input("-")]) is RocksDBStateStore
    assert _dedup(stories, "--out-dir", tmp_path / "memory") == 0
    monkeypatch.setattr(embedded, "MEMORY_STATE_BYTES", stories.stat().st_size)
    assert kind(small) is RocksDBStateStore
    assert _dedup(stories, "--out-dir", tmp_path / "rocksdb") == 0
    assert _outputs(tmp_path / "memory") == _outputs(tmp_path / "rocksdb")
    assert _count(tmp_path / "memory")["duplicates"] >= 80
