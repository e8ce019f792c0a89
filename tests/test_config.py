"""Settings precedence: flags over NEARDUP_* variables over the TOML file over defaults."""

from __future__ import annotations

from pathlib import Path

import pytest

from neardup.cli import _settings, build_parser
from neardup.config import load_settings


def test_precedence(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    toml = tmp_path / "neardup.toml"
    toml.write_text(
        'threshold = 0.9\nseed = 5\nshingle = "char:4"\ninput_topics = ["a", "b"]\n'
        '[kafka]\n"security.protocol" = "SASL_SSL"\n"enable.idempotence" = true\n'
    )
    monkeypatch.setenv("NEARDUP_THRESHOLD", "0.7")
    monkeypatch.setenv("NEARDUP_TEXT_FIELD", "title,body")
    s = load_settings({"seed": 9, "num_perm": None}, toml)
    assert s.threshold == 0.7  # variable over file
    assert s.seed == 9  # flag over file
    assert s.num_perm == 128  # default (None is "not given")
    assert s.shingle == "char:4" and s.input_topics == ["a", "b"]  # file
    assert s.text_field == ["title", "body"]
    assert s.kafka == {"security.protocol": "SASL_SSL", "enable.idempotence": "true"}


def test_cli_x_settings_merge_with_the_kafka_table(tmp_path: Path) -> None:
    toml = tmp_path / "neardup.toml"
    toml.write_text('[kafka]\n"security.protocol" = "SASL_SSL"\n"sasl.mechanism" = "PLAIN"\n')
    args = build_parser().parse_args(
        ["run", "--config", str(toml), "--bootstrap-servers", "b:9092", "--input-topic", "wire",
         "-X", "sasl.mechanism=SCRAM-SHA-512", "-X", "session.timeout.ms=6000", "--threshold", "0.85"]
    )
    s = _settings(args)
    assert s.kafka == {"security.protocol": "SASL_SSL", "sasl.mechanism": "SCRAM-SHA-512",
                       "session.timeout.ms": "6000"}
    assert s.threshold == 0.85 and s.bootstrap_servers == "b:9092" and s.input_topics == ["wire"]
    engine = s.engine()
    assert engine.threshold == 0.85 and engine.verify == "exact"


def test_invalid_values_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="shingling"):
        load_settings({"shingle": "words:5"})
    with pytest.raises(ValueError):
        load_settings({"threshold": 1.5})
    with pytest.raises(FileNotFoundError):
        load_settings({}, tmp_path / "missing.toml")
    with pytest.raises(ValueError, match="both --bands and --rows"):
        load_settings({"bands": 4}).engine()
    with pytest.raises(SystemExit):
        build_parser().parse_args(["run", "-X", "no-equals-sign"])
