"""Settings precedence: flags over NEARDUP_* variables over the TOML file over defaults."""

from __future__ import annotations

import argparse
import inspect
import re
from pathlib import Path

import pytest

from neardup.cli import _settings, build_parser
from neardup.config import (
    FILE_ID_FIELD,
    OTHER_VARIABLES,
    Settings,
    check_environment,
    default,
    load_settings,
    variable,
)
from neardup.core.settings import EngineSettings
from neardup.embedded import dedup_files
from neardup.evaluate import evaluate
from neardup.kafka.produce import produce_files
from neardup.pipeline import prepared_ahead


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


# --- the defaults are written once, in neardup.config.Settings ------------------------------


def _shown(value: object) -> str:
    """A default as the help texts write it."""
    if isinstance(value, bool):
        return "on" if value else "off"
    return f"{value:g}" if isinstance(value, float) else str(value)


def _same(given: object, value: object) -> bool:
    """``given`` is the default ``value`` (None stands for an empty list or table)."""
    return given == value or (given is None and value in ([], {}))


def _settings_flags() -> list[tuple[str, argparse.Action]]:
    """(subcommand, flag) for every flag of a subcommand that sets a Settings field."""
    [subcommands] = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return [(name, action) for name, sub in subcommands.choices.items()
            for action in sub._actions if action.dest in Settings.model_fields]


def test_flags_restate_no_default_of_their_own() -> None:
    flags = _settings_flags()
    assert {"dedup", "run", "eval", "params", "produce"} <= {name for name, _ in flags}
    for name, action in flags:
        value = default(action.dest)
        if name == "produce" and action.dest == "id_field":  # as dedup's JSONL files
            assert action.default == FILE_ID_FIELD
        elif name in ("params", "produce"):  # read no settings: the parser holds the default
            assert _same(action.default, value), (name, action.option_strings)
        else:  # None: not given, so NEARDUP_* variables and the --config file apply
            assert action.default is None, (name, action.option_strings)
        if value not in (None, [], {}) and action.help:
            assert re.search(rf"\bdefault {re.escape(_shown(value))}[):;,]", action.help), \
                (name, action.option_strings, action.help)


def test_library_functions_default_to_the_settings() -> None:
    same = {"parallel": "pipeline", "time_field": "timestamp_field", "text_fields": "text_field"}
    checked = set()
    for function in (dedup_files, evaluate, prepared_ahead, produce_files):
        for name, parameter in inspect.signature(function).parameters.items():
            field = same.get(name, name)
            if field in Settings.model_fields and parameter.default is not parameter.empty:
                expected = FILE_ID_FIELD if function is produce_files and name == "id_field" else default(field)
                assert _same(parameter.default, expected), (function.__name__, name, parameter.default)
                checked.add((function.__name__, name))
    assert {("dedup_files", "batch_size"), ("dedup_files", "parallel"), ("evaluate", "batch_size"),
            ("produce_files", "id_field")} <= checked


def test_engine_defaults_are_the_settings_defaults() -> None:
    # The core imports nothing above it, so EngineSettings (and TextNorm, Shingling) keep
    # defaults of their own for the library; they must be those of Settings.
    assert EngineSettings() == Settings.model_construct().engine()


# --- NEARDUP_* variables and TOML keys: every one listed, an unknown one refused by name ----


REPO = Path(__file__).resolve().parent.parent


def _help(command: str) -> str:
    [subcommands] = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return subcommands.choices[command].format_help()


def test_every_variable_is_listed_in_the_help() -> None:
    listed: set[str] = set()
    for command in ("dedup", "run", "stage", "eval"):
        text = _help(command)
        epilog = text[text.index("environment:"):]
        shown = set(re.findall(r"\bNEARDUP_[A-Z_]+\b", epilog))
        flags = {action.dest for name, action in _settings_flags() if name == command}
        assert {variable(name) for name in flags} <= shown, command  # each of its settings flags
        check_environment(dict.fromkeys(shown, "x"))  # and only variables that are read
        listed |= shown
    assert listed >= {variable(name) for name in Settings.model_fields}
    assert "NEARDUP_INPUT_TOPICS for --input-topic" in " ".join(_help("run").split())


def test_an_unknown_variable_is_refused_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NEARDUP_INPUT_TOPIC", "wire")  # the singular of NEARDUP_INPUT_TOPICS
    with pytest.raises(ValueError, match=r"^NEARDUP_INPUT_TOPIC is not a setting \(did you mean NEARDUP_INPUT_TOPICS\?\)"):
        load_settings({})
    monkeypatch.delenv("NEARDUP_INPUT_TOPIC")
    monkeypatch.setenv("neardup_treshold", "0.7")  # read in any case, so refused in any case
    with pytest.raises(ValueError, match=r"neardup_treshold is not a setting \(did you mean NEARDUP_THRESHOLD\?\)"):
        load_settings({})
    monkeypatch.delenv("neardup_treshold")
    for name in OTHER_VARIABLES:  # the local broker's and the tests': not settings, let be
        monkeypatch.setenv(name, "1")
    monkeypatch.setenv("NEARDUP_INPUT_TOPICS", "a,b")
    assert load_settings({}).input_topics == ["a", "b"]


def test_every_neardup_variable_of_the_repository_is_known() -> None:
    known = {variable(name) for name in Settings.model_fields} | OTHER_VARIABLES
    found: dict[str, str] = {}
    for path in [*REPO.glob("*.md"), *REPO.glob("*.yml"), *(p for d in ("src", "tests", "deploy", "docs", "benchmarks")
                                                          for p in (REPO / d).rglob("*") if p.is_file())]:
        refusing = path.name in (Path(__file__).name, "test_errors.py")  # they name refused ones
        if path.suffix in (".py", ".md", ".sh", ".yaml", ".yml", ".toml", ".json", "") and not refusing:
            for name in re.findall(r"\bNEARDUP_[A-Z][A-Z0-9_]*[A-Z0-9]\b", path.read_text(errors="replace")):
                found.setdefault(name, str(path.relative_to(REPO)))
    assert "NEARDUP_KAFKA_HOME" in found and "NEARDUP_STATE_DIR" in found
    assert {n: p for n, p in found.items() if n not in known} == {}


def test_toml_keys_are_the_settings_names(tmp_path: Path) -> None:
    toml = tmp_path / "neardup.toml"
    toml.write_text('input_topic = ["wire"]\n')
    with pytest.raises(ValueError) as refused:
        load_settings({}, toml)
    assert str(refused.value) == f"{toml}: unknown key 'input_topic' (did you mean 'input_topics'?)"
    toml.write_text('num-perm = 64\n[engine]\nthreshold = 0.9\n')
    with pytest.raises(ValueError) as refused:
        load_settings({}, toml)
    assert str(refused.value) == f"{toml}: unknown key 'num-perm' (did you mean 'num_perm'?); unknown key 'engine'"
    toml.write_text('threshold = 1.5\n[kafka]\n"sasl.password" = "s3cret"\n')
    with pytest.raises(ValueError) as refused:
        load_settings({}, toml)
    assert str(refused.value) == f"{toml}: key 'threshold': input should be less than or equal to 1, not 1.5"
    toml.write_text("threshold = \n")
    with pytest.raises(ValueError, match=rf"^{re.escape(str(toml))}: not valid TOML"):
        load_settings({}, toml)


def test_the_stages_producers_compress_unless_told_otherwise() -> None:
    """The sharded stages' producers compress (``STAGE_PRODUCER``) over neardup's own
    producer settings, and a user's ``-X compression.type`` wins; ``neardup run``'s
    producer and the admin client are left as they were."""
    from neardup.kafka.clients import admin_config, producer_config
    from neardup.kafka.stage import StageRuntime
    from neardup.sharded.decide_stage import DecideStage
    from neardup.sharded.prepare_stage import PrepareStage
    from neardup.sharded.shard_stage import ShardStage
    from neardup.sharded.topology import STAGE_PRODUCER

    plain = load_settings({"bootstrap_servers": "b:9092"})
    told = load_settings({"bootstrap_servers": "b:9092", "kafka": {"compression.type": "zstd"}})
    assert STAGE_PRODUCER == {"compression.type": "lz4"}
    for stage in (PrepareStage, ShardStage, DecideStage):
        assert stage.producer_defaults == STAGE_PRODUCER
        assert producer_config(plain, "t", None, stage.producer_defaults)["compression.type"] == "lz4"
        assert producer_config(told, "t", None, stage.producer_defaults)["compression.type"] == "zstd"
    assert StageRuntime.producer_defaults == {}
    assert "compression.type" not in producer_config(plain, "t", None, StageRuntime.producer_defaults)
    assert "compression.type" not in admin_config(plain)
