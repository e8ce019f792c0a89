"""Every user error is one line naming the flag or setting, exit 2, no traceback: bad
values, librdkafka settings (checked against librdkafka itself and the real broker's
address), a state directory that cannot be created, a full disk (a real tmpfs), a state
built with another threshold, and ``neardup run`` without a bootstrap server.
"""

from __future__ import annotations

import contextlib
import gzip
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from neardup.cli import main

DATA = Path(__file__).parent / "data" / "reuters_excerpt.jsonl.gz"


@pytest.fixture
def stories(tmp_path: Path) -> Path:
    with gzip.open(DATA, "rt", encoding="utf-8") as f:
        lines = f.read().splitlines()[:400]
    path = tmp_path / "stories.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def _error(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    """Run ``neardup argv``: exit 2 and one line on stderr, returned."""
    capsys.readouterr()
    assert main([str(a) for a in argv]) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("neardup: error: "), err
    return lines[0]


@contextlib.contextmanager
def _tmpfs(path: Path, options: str) -> Iterator[bool]:
    """A real tmpfs mounted on ``path`` (True), or False where mounting is not allowed."""
    path.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)],
                             capture_output=True).returncode == 0
    try:
        yield mounted
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(path)], check=True)


def test_an_invalid_value_names_its_flag(capsys, stories, tmp_path, monkeypatch) -> None:
    line = _error(capsys, ["dedup", stories, "--out-dir", tmp_path / "out", "--threshold", "1.5"])
    assert "--threshold" in line and "1.5" in line and "pydantic" not in line
    monkeypatch.setenv("NEARDUP_BATCH_SIZE", "0")
    line = _error(capsys, ["dedup", stories, "--out-dir", tmp_path / "out"])
    assert "NEARDUP_BATCH_SIZE" in line
    assert not (tmp_path / "out").exists()


def test_a_kafka_setting_librdkafka_refuses_is_one_line(capsys, kafka_bootstrap, tmp_path) -> None:
    run = ["run", "--bootstrap-servers", kafka_bootstrap, "--input-topic", "wire",
           "--state-dir", tmp_path / "state", "--metrics-port", "0"]
    assert '"foo.bar"' in _error(capsys, [*run, "-X", "foo.bar=1"])
    assert "session.timeout.ms" in _error(capsys, [*run, "-X", "session.timeout.ms=soon"])
    ssl = [*run, "-X", "security.protocol=SSL"]
    assert "ssl.key.location is empty" in _error(capsys, [*ssl, "-X", "ssl.key.location="])
    line = _error(capsys, [*ssl, "-X", f"ssl.key.location={tmp_path / 'missing.pem'}"])
    assert "ssl.key.location" in line and "no such file" in line
    (tmp_path / "bad.pem").write_text("not a key\n")
    line = _error(capsys, [*ssl, "-X", f"ssl.key.location={tmp_path / 'bad.pem'}"])
    assert "ssl.key.location" in line
    assert not (tmp_path / "state").exists(), "checked before the state was opened"
    (tmp_path / "one.jsonl").write_text('{"id": "1", "text": "one story"}\n')
    produce = ["produce", tmp_path / "one.jsonl", "--topic", "wire", "--bootstrap-servers", kafka_bootstrap]
    assert '"foo.bar"' in _error(capsys, [*produce, "-X", "foo.bar=1"])
    line = _error(capsys, [*produce, "-X", f"sasl.password=@{tmp_path / 'missing'}"])
    assert "sasl.password" in line and "cannot read the file" in line


def test_run_checks_its_settings_before_serving_metrics(capsys, tmp_path) -> None:
    with socket.socket() as busy:  # were the server started first, this would be the error
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        line = _error(capsys, ["run", "--input-topic", "wire", "--metrics-host", "127.0.0.1",
                               "--metrics-port", port, "--state-dir", tmp_path / "state"])
    assert line == "neardup: error: --bootstrap-servers is required"


def test_a_metrics_port_in_use_is_one_line(capsys, stories, tmp_path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        line = _error(capsys, ["dedup", stories, "--out-dir", tmp_path / "out", "--metrics-host", "127.0.0.1",
                               "--metrics-port", port, "--no-progress"])
    assert line.startswith("neardup: error: cannot serve") and f"127.0.0.1:{port}" in line, line


def test_another_threshold_on_a_state_names_the_threshold(capsys, stories, tmp_path) -> None:
    state = tmp_path / "state"
    assert main(["dedup", str(stories), "--state-dir", str(state), "--out-dir", str(tmp_path / "a"),
                 "--no-pipeline"]) == 0
    line = _error(capsys, ["dedup", stories, "--state-dir", state, "--out-dir", tmp_path / "b",
                           "--threshold", "0.7"])
    assert "--threshold changed: 0.7" in line and "default --threshold 0.8" in line, line
    assert "stored 21" not in line
    line = _error(capsys, ["dedup", stories, "--state-dir", state, "--out-dir", tmp_path / "b",
                           "--shingle", "char:5"])
    assert "--shingle" in line and "'word:5'" in line and "'char:5'" in line


def test_a_state_directory_that_cannot_be_created(capsys, stories, tmp_path) -> None:
    parent = tmp_path / "ro"
    with _tmpfs(parent, "ro,size=1m") as mounted:
        if not mounted:  # not root: permissions stop the same mkdir
            parent.chmod(0o555)
        line = _error(capsys, ["dedup", stories, "--state-dir", parent / "state",
                               "--out-dir", tmp_path / "out"])
    assert "cannot create the state directory" in line and str(parent / "state") in line
    assert ("Read-only file system" in line) if mounted else ("Permission denied" in line)


def test_a_full_disk_for_the_outputs(capsys, stories, tmp_path) -> None:
    out = tmp_path / "out"
    with _tmpfs(out, "size=64k") as mounted:
        if not mounted:  # a real ENOSPC without a mount: /dev/full
            for name in ("unique", "duplicates", "rejects"):
                (out / f"{name}.jsonl").symlink_to("/dev/full")
        line = _error(capsys, ["dedup", stories, "--out-dir", out, "--state-dir", tmp_path / "state",
                               "--no-pipeline", "--batch-size", "100"])
    assert "No space left on device" in line and str(out) in line


def test_a_full_disk_for_the_state(capsys, stories, tmp_path) -> None:
    state = tmp_path / "state"
    with _tmpfs(state, "size=512k") as mounted:
        if not mounted:
            pytest.skip("mounting a tmpfs needs root")  # the output case covers ENOSPC then
        line = _error(capsys, ["dedup", stories, "--out-dir", tmp_path / "out", "--state-dir", state,
                               "--no-pipeline", "--batch-size", "100"])
    assert "state" in line and "No space left on device" in line, line


@pytest.mark.parametrize("variables", [("NEARDUP_RETENTION_DOCUMENTS=1000000",), ("NEARDUP_TIMESTAMP_FIELD=time",),
                                       ("NEARDUP_RETENTION=72h", "NEARDUP_CLUSTER_POLICY=components")])
def test_a_stage_refuses_a_retention_window_it_cannot_keep(capsys, monkeypatch, variables) -> None:
    """The stages keep a window by record time with the canonical policy only: a window by
    document count, by a timestamp field, or with the components policy (here from the
    environment) is refused in one line, not ignored."""
    for variable in variables:
        name, value = variable.split("=")
        monkeypatch.setenv(name, value)
    for role in ("prepare", "shard", "decide"):
        line = _error(capsys, ["stage", role, "--bootstrap-servers", "127.0.0.1:1", "--input-topic", "wire"])
        assert "neardup stage keeps a retention window" in line or "neardup stage takes a document's time" in line


def test_a_toml_key_error_names_the_file_and_key_not_a_flag(capsys, stories, tmp_path) -> None:
    toml = tmp_path / "neardup.toml"
    toml.write_text('input_topic = ["wire"]\nthreshold = 0.9\n')
    line = _error(capsys, ["run", "--config", toml, "--bootstrap-servers", "localhost:1", "--state-dir", tmp_path / "s"])
    assert line == f"neardup: error: {toml}: unknown key 'input_topic' (did you mean 'input_topics'?)"
    toml.write_text("threshold = 1.5\n")
    line = _error(capsys, ["dedup", stories, "--out-dir", tmp_path / "out", "--config", toml])
    assert line == f"neardup: error: {toml}: key 'threshold': input should be less than or equal to 1, not 1.5"
    assert not (tmp_path / "s").exists() and not (tmp_path / "out").exists()


def test_an_unknown_variable_is_one_line_naming_it(capsys, stories, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("NEARDUP_INPUT_TOPIC", "wire")  # silently ignored, once
    line = _error(capsys, ["run", "--bootstrap-servers", "localhost:1", "--state-dir", tmp_path / "s"])
    assert line.startswith("neardup: error: NEARDUP_INPUT_TOPIC is not a setting (did you mean NEARDUP_INPUT_TOPICS?)")
    monkeypatch.delenv("NEARDUP_INPUT_TOPIC")
    monkeypatch.setenv("NEARDUP_TEXT_FIELDS", "body")
    line = _error(capsys, ["dedup", stories, "--out-dir", tmp_path / "out"])
    assert "NEARDUP_TEXT_FIELDS is not a setting (did you mean NEARDUP_TEXT_FIELD?)" in line
    assert not (tmp_path / "s").exists() and not (tmp_path / "out").exists()
