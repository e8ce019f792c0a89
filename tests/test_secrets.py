"""Secrets for librdkafka: read from a file (``-X key=@PATH``) or the environment, and
kept out of error messages, logs and ``/metrics`` (a real ``neardup run`` against the
real broker).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.request
import uuid
from pathlib import Path

import pytest

from kafka_util import free_port, produce, wait_committed
from neardup.cli import _settings, build_parser, main

SRC = Path(__file__).resolve().parent.parent / "src"


def _secret() -> str:
    return f"hunter2-{uuid.uuid4().hex[:12]}"


def test_values_are_read_from_files(tmp_path: Path, monkeypatch) -> None:
    secret = _secret()
    (tmp_path / "kafka").write_text(secret + "\n")
    toml = tmp_path / "neardup.toml"
    toml.write_text(f'[kafka]\n"ssl.key.password" = "@{tmp_path / "kafka"}"\n')
    monkeypatch.setenv("NEARDUP_KAFKA", json.dumps({"sasl.username": "@@reader"}))
    args = build_parser().parse_args(["run", "--config", str(toml),
                                      "-X", f"sasl.password=@{tmp_path / 'kafka'}"])
    kafka = _settings(args).kafka
    assert kafka == {"ssl.key.password": secret, "sasl.password": secret, "sasl.username": "@reader"}
    with pytest.raises(ValueError, match="sasl.password=@.*missing: cannot read the file"):
        _settings(build_parser().parse_args(["run", "-X", f"sasl.password=@{tmp_path / 'missing'}"]))


def test_secrets_stay_out_of_error_messages(capsys, monkeypatch) -> None:
    secret = _secret()
    run = ["run", "--bootstrap-servers", "127.0.0.1:9", "--input-topic", "wire", "--metrics-port", "0"]
    # a password pasted where the protocol goes: librdkafka quotes the value it refuses
    assert main([*run, "-X", f"sasl.password={secret}", "-X", f"security.protocol={secret}"]) == 2
    err = capsys.readouterr().err
    assert "security.protocol" in err and secret not in err and "Traceback" not in err
    # the environment variable in the wrong shape: pydantic would quote the whole input
    monkeypatch.setenv("NEARDUP_KAFKA", json.dumps([f"sasl.password={secret}"]))
    assert main(run) == 2
    err = capsys.readouterr().err
    assert "NEARDUP_KAFKA" in err and secret not in err and len(err.strip().splitlines()) == 1



def _get(url: str) -> str:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(url, timeout=10) as response:
        return response.read().decode()


def test_a_secret_from_a_file_stays_out_of_logs_and_metrics(kafka_bootstrap, kafka_topic_factory, tmp_path) -> None:
    secret = _secret()
    (tmp_path / "password").write_text(secret + "\n")
    topic = kafka_topic_factory("secret")
    port = free_port()
    log = tmp_path / "run.log"
    cmd = [sys.executable, "-m", "neardup.cli", "run", "--bootstrap-servers", kafka_bootstrap,
           "--input-topic", topic, "--from-beginning", "--group-id", f"g-{topic}",
           "--state-dir", str(tmp_path / "state"), "--metrics-host", "127.0.0.1",
           "--metrics-port", str(port), "--log-level", "DEBUG", "--batch-max-ms", "50",
           "-X", f"sasl.password=@{tmp_path / 'password'}", "-X", "sasl.username=reader",
           "-X", f"ssl.key.password=@{tmp_path / 'password'}"]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONPATH": str(SRC)})
    try:
        messages = [(f"m{i}".encode(), json.dumps({"text": f"story number {i} " * 20}).encode())
                    for i in range(20)]
        produce(kafka_bootstrap, topic, messages)
        wait_committed(kafka_bootstrap, f"g-{topic}", topic, len(messages), proc)
        pages = [_get(f"http://127.0.0.1:{port}{path}") for path in ("/metrics", "/", "/healthz", "/readyz")]
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, log.read_text()[-3000:]
    text = log.read_text()
    assert "subscribed to" in text  # it ran, with the settings read from the file
    assert secret not in text
    assert all(secret not in page for page in pages)
    assert "neardup_documents_total" in pages[0]
