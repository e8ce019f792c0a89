"""POST /query on `neardup run` (neardup.server.QueryServer): the nearest stored documents
of a text from the live state, with a real broker and a real RocksDB store; answers equal
those of the state read afterwards; nothing added; the consumer unharmed by queries made
while it commits; the request errors."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections import Counter

from kafka_util import excerpt, free_port, produce, read_all, start_run, stop, unique, wait_committed

from neardup.api import Deduplicator

JSON_FIELDS = ["--text-field", "text", "--id-field", "id"]



def _post(url: str, body: bytes, token: str | None = "s3cret", method: str = "POST") -> tuple[int, dict]:
    request = urllib.request.Request(url, data=body if method == "POST" else None, method=method,
                                     headers={"Content-Type": "application/json",
                                              **({"Authorization": f"Bearer {token}"} if token else {})})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def _query(url: str, text: str, k: int = 5) -> list[dict]:
    status, body = _post(url, json.dumps({"text": text, "k": k}).encode())
    assert status == 200, body
    return body["nearest"]


def _wait_listening(port: int, proc: subprocess.Popen, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, "neardup run exited early"
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.2)
    raise TimeoutError(f"nothing listens on port {port}")


def test_queries_answer_from_the_live_state_while_the_consumer_commits(kafka_bootstrap, kafka_topic_factory,
                                                                       tmp_path):
    records = excerpt(1200)
    counts = Counter(r["text"] for r in records)
    topic = kafka_topic_factory("query")
    group = unique("g-query")
    port = free_port()
    url = f"http://127.0.0.1:{port}/query"
    (tmp_path / "token").write_text("s3cret\n")
    log = tmp_path / "run.log"
    messages = [(str(r["id"]).encode(), json.dumps(r).encode()) for r in records]
    produce(kafka_bootstrap, topic, messages[:100])
    proc = start_run(kafka_bootstrap, topic, group, tmp_path / "state", *JSON_FIELDS, "--batch-size", "50",
                     "--query-port", str(port), "--query-token-file", str(tmp_path / "token"),
                     "--query-max-bytes", "100000", log=log)
    statuses: Counter[int] = Counter()
    stop_querying = threading.Event()

    def keep_querying() -> None:  # while the consumer commits the rest
        i = 0
        while not stop_querying.is_set():
            status, _ = _post(url, json.dumps({"texts": [records[i % 100]["text"], records[(i * 7) % 100]["text"]],
                                               "k": 3}).encode())
            statuses[status] += 1
            i += 1

    try:
        _wait_listening(port, proc)
        wait_committed(kafka_bootstrap, group, topic, 100, proc, log=log)
        querier = threading.Thread(target=keep_querying)
        querier.start()
        try:
            for i in range(100, len(messages), 100):
                produce(kafka_bootstrap, topic, messages[i:i + 100])
            wait_committed(kafka_bootstrap, group, topic, len(messages), proc, log=log)
        finally:
            stop_querying.set()
            querier.join()

        # a text stored once is its own nearest document, at similarity 1
        alone = [r for r in records if counts[r["text"]] == 1][:20]
        answers = {r["id"]: _query(url, r["text"]) for r in alone}
        for r in alone:
            top = answers[r["id"]][0]
            assert (top["id"], top["similarity"]) == (str(r["id"]), 1.0), (r["id"], answers[r["id"]])
        # a new text is not added by asking: asked twice, it still finds only the others
        draft = " ".join(reversed(alone[0]["text"].split())) + " a draft not yet published"
        first = _query(url, draft, k=10)
        assert _query(url, draft, k=10) == first
        assert all(n["similarity"] < 1.0 for n in first)
        # the errors of a request, each one line of JSON
        assert _post(url, b'{"text": "x"}', token=None)[0] == 401
        assert _post(url, b'{"text": "x"}', token="wrong")[0] == 401
        assert _post(url, json.dumps({"text": "x" * 200_000}).encode())[0] == 413
        status, body = _post(url, b"{not json")
        assert status == 400 and body["error"]
        assert _post(url, b'{"text": "x", "k": 0}')[0] == 400
        assert _post(url, b'{"texts": "one text"}')[0] == 400
        assert _post(url, b"", method="GET")[0] == 405
        assert _post(url.replace("/query", "/other"), b'{"text": "x"}')[0] == 404
    finally:
        assert stop(proc) == 0, log.read_text()[-3000:]

    print("queries during the commits:", dict(statuses))
    assert statuses and set(statuses) == {200}, statuses  # every query made during the commits answered
    outs = read_all(kafka_bootstrap, [f"{topic}.unique", f"{topic}.duplicates", f"{topic}.dlq"],
                    expected=len(records))
    assert sorted(o.key.decode() for o in outs) == sorted(str(r["id"]) for r in records)  # queries added nothing
    with Deduplicator(tmp_path / "state", read_only=True) as index:  # the state, read after the stop
        for r in alone:
            assert [n.to_dict() for n in index.query(r["text"])] == answers[r["id"]]
        assert [n.to_dict() for n in index.query(draft, k=10)] == first
    assert "Traceback" not in log.read_text()


def test_an_unreadable_token_file_stops_run_with_one_line(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "neardup.cli", "run", "--bootstrap-servers", "127.0.0.1:9", "--input-topic", "t",
         "--state-dir", str(tmp_path / "state"), "--query-port", "8099", "--query-token-file",
         str(tmp_path / "missing")], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith(
        f"neardup: error: cannot read --query-token-file {tmp_path / 'missing'}")
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "state").exists()  # refused before the state opens
