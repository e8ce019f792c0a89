"""Typed settings: command-line flags win over ``NEARDUP_*`` environment variables, which
win over a TOML file (``--config``), which wins over the defaults.

The TOML file holds the settings' names (the ``Settings`` fields: the flags' names with
underscores for dashes, ``input_topics`` for ``--input-topic``) at top level, and
librdkafka settings in a ``[kafka]`` table::

    threshold = 0.85
    shingle = "char:5"
    input_topics = ["wire"]
    [kafka]
    "security.protocol" = "SASL_SSL"
    "sasl.password" = "@/run/secrets/kafka"

A librdkafka value ``@PATH`` is read from the file PATH (``neardup.kafka.kafka_config``).

Each setting's variable is ``NEARDUP_`` and its name in capitals (``variable``):
``NEARDUP_NUM_PERM``, ``NEARDUP_INPUT_TOPICS`` (comma-separated), ``NEARDUP_KAFKA`` (a
JSON object). An unknown key in the file, and a ``NEARDUP_*`` variable that is no setting
(a typo, a singular for a plural) save those of ``OTHER_VARIABLES``, are refused by name.

The defaults are written here only: the command-line help, the library functions
(``neardup.embedded.dedup_files``, ``neardup.evaluate.evaluate``) and ``EngineSettings``
read them from ``Settings`` (``default(name)``); tests/test_config.py checks that none is
restated with another value.
"""

from __future__ import annotations

import difflib
import os
import re
import tomllib
from collections.abc import Callable, Mapping
from contextvars import ContextVar
from dataclasses import replace
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, ValidationError, field_validator
from pydantic_settings import (
    BaseSettings,
    InitSettingsSource,
    PydanticBaseSettingsSource,
    NoDecode,
    SettingsConfigDict,
)

from neardup.core.lsh import LshParams
from neardup.core.normalize import TextNorm
from neardup.core.retention import parse_duration
from neardup.core.settings import EngineSettings
from neardup.core.shingle import Shingling
from neardup.kafka.kafka_config import read_value_files

DEFAULT_METRICS_PORT = 9464  # ``run``; ``dedup`` serves no metrics unless given a port
DEFAULT_STATE_DIR = Path("neardup-state")  # ``run``; ``dedup``: a state for the run only (below)
FILE_TEXT_FIELD = "text"  # JSONL files (dedup, eval): the field holding the text
FILE_ID_FIELD = "id"  # JSONL files (dedup, eval, produce): the field holding the id

#: ``dedup``: a state for one run only (no ``--state-dir``) is kept in memory when the
#: inputs are files of fewer bytes than this on disk together (gzipped ones count as
#: stored) and no retention window is given; otherwise in a temporary RocksDB directory.
#: RocksDB's open and its flush of every column family at close cost 30-35 ms on any
#: input. On the 2-core machine, against the temporary directory: 5 documents 0.27 s
#: against 0.32 s (medians of 15); Reuters-21578 (8 MB gzipped) 1.33 s against 1.47 s
#: (medians of 5), peak RSS 175 MB against 200 MB; 100,000 wire stories (31 MB
#: gzipped) 4.9 s against 5.3 s, peak RSS 251 MB against 256 MB; outputs identical.
MEMORY_STATE_BYTES = 32 << 20


class Settings(BaseSettings):
    """Every setting of the ``neardup`` commands, with its default."""

    model_config = SettingsConfigDict(env_prefix="NEARDUP_", extra="forbid")

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        """The keyword arguments, then the ``NEARDUP_*`` variables, then a TOML file's
        table, as ``_sourced`` sets them (``_SOURCES``); a subclass per call instead would
        have pydantic build a validator at each, about 10 ms."""
        environment, table = _SOURCES.get()
        sources = (init_settings, env_settings) if environment else (init_settings,)
        return sources if table is None else (*sources, InitSettingsSource(settings_cls, init_kwargs=table))

    # engine
    shingle: str = "word:5"
    num_perm: int = Field(128, ge=1)
    seed: int = 1
    minhash: Literal["oph", "classic"] = "oph"
    threshold: float = Field(0.8, gt=0.0, le=1.0)
    bands: int | None = Field(None, ge=1)
    rows: int | None = Field(None, ge=1)
    nfkc: bool = True
    casefold: bool = True
    strip_punctuation: bool = False
    max_bucket_size: int = Field(256, ge=1)
    max_candidates: int = Field(8, ge=1)
    extra_candidates: int | None = Field(None, ge=0)
    duplicate_buckets: Literal["new", "all"] = "new"
    measure: Literal["jaccard", "containment"] = "jaccard"
    containment_direction: Literal["new-in-earlier", "earlier-in-new", "both"] = "new-in-earlier"
    containment_ratio: float = Field(8.0, ge=1.0)
    verify: Literal["exact", "estimate"] = "exact"
    cluster_policy: Literal["canonical", "components"] = "canonical"
    score_floor: float | None = Field(None, gt=0.0, le=1.0)
    candidate_threshold: float | None = Field(None, gt=0.0, lt=1.0)
    multiset: bool = False
    # retention (stored with the state; changeable)
    retention: str | None = None  # duration, e.g. 72h; "none": no time bound
    retention_documents: int | str | None = None  # count; "none": no count bound
    timestamp_field: str | None = None  # dedup: the field holding each record's time
    future_tolerance: str = "1h"  # a time later than now + this is taken as now (duration)
    # records
    text_field: Annotated[list[str], NoDecode] | None = None  # dedup: FILE_TEXT_FIELD; run: whole value
    id_field: str | None = None  # dedup: FILE_ID_FIELD; run: the message key
    text_format: Literal["plain", "html"] = "plain"  # html: the text is a page, its main text kept (neardup.extract)
    batch_size: int = Field(2000, ge=1)
    pipeline: bool = True
    state_dir: Path | None = None
    # Kafka
    bootstrap_servers: str | None = None
    input_topics: Annotated[list[str], NoDecode] = []
    group_id: str = "neardup"
    unique_topic: str | None = None
    duplicate_topic: str | None = None
    dlq_topic: str | None = None
    batch_max_ms: int = Field(200, ge=1)
    partition_wait_ms: int = Field(2000, ge=0)  # run: timestamp synchronisation (neardup.kafka.intake)
    assign_wait_ms: int = Field(60_000, ge=1)  # run and stages: the assignment watchdog (neardup.kafka.stage)
    max_message_bytes: int = Field(1 << 20, ge=1)
    from_beginning: bool = False
    transactional_id: str | None = None
    reset_state: bool = False
    changelog: Literal["on", "off"] = "on"
    changelog_topic: str | None = None
    # topics neardup creates when missing (-1: the broker's default); existing ones are kept
    topic_partitions: int = -1  # outputs and dead letters (run; decide)
    topic_replication_factor: int = -1  # every topic created: outputs, dead letters, changelogs, internal
    # sharded stages (docs/scale-out.md)
    app: str | None = None  # prefix of the internal topics and consumer groups; default: group_id
    shards: int = Field(4, ge=1)
    decide_partitions: int = Field(2, ge=1)
    reorder_window_ms: int = Field(500, ge=0)
    max_undecided: int = Field(10_000, ge=1)  # prepare: the bound on what waits downstream (per decide partition)
    instance: str | None = None  # default: the host name
    kafka: dict[str, str] = {}
    # operations
    metrics_host: str = "0.0.0.0"
    metrics_port: int | None = None
    # run: POST /query on the live state (neardup.server.QueryServer); off by default
    query_port: int | None = None
    query_host: str = "127.0.0.1"
    query_token_file: Path | None = None
    query_max_bytes: int = Field(1 << 20, ge=1)
    log_format: Literal["text", "json"] = "text"
    log_level: str = "INFO"

    @field_validator("text_field", "input_topics", mode="before")
    @classmethod
    def _split_commas(cls, value: Any) -> Any:
        if isinstance(value, str):
            return [v.strip() for v in value.split(",") if v.strip()]
        return value

    @field_validator("topic_partitions", "topic_replication_factor")
    @classmethod
    def _topic_count(cls, value: int) -> int:
        if value == 0 or value < -1:
            raise ValueError("must be at least 1, or -1 for the broker's default")
        return value

    @field_validator("shingle")
    @classmethod
    def _valid_shingle(cls, value: str) -> str:
        return str(Shingling.parse(value))

    @field_validator("kafka", mode="before")
    @classmethod
    def _stringify(cls, value: Any) -> Any:
        if isinstance(value, dict):
            return {
                str(k): (str(v).lower() if isinstance(v, bool) else str(v))
                for k, v in value.items()
            }
        return value

    def _shingling(self) -> Shingling:
        shingling = Shingling.parse(self.shingle)  # may say "+multiset" itself
        return replace(shingling, multiset=True) if self.multiset else shingling

    def engine(self) -> EngineSettings:
        """The engine settings these settings describe.

        Raises:
            ValueError: only one of bands and rows given, or they exceed num_perm.
        """
        if (self.bands is None) != (self.rows is None):
            raise ValueError("give both --bands and --rows, or neither")
        lsh = LshParams(self.bands, self.rows) if self.bands and self.rows else None
        return EngineSettings(
            norm=TextNorm(
                nfkc=self.nfkc,
                casefold=self.casefold,
                strip_punctuation=self.strip_punctuation,
            ),
            shingling=self._shingling(),
            num_perm=self.num_perm,
            seed=self.seed,
            minhash=self.minhash,
            threshold=self.threshold,
            lsh=lsh,
            max_bucket_size=self.max_bucket_size,
            max_candidates=self.max_candidates,
            extra_candidates=self.extra_candidates,
            duplicate_buckets=self.duplicate_buckets,
            measure=self.measure,
            containment_direction=self.containment_direction,
            containment_ratio=self.containment_ratio,
            verify=self.verify,
            cluster_policy=self.cluster_policy,
            score_floor=self.score_floor,
            candidate_threshold=self.candidate_threshold,
            future_tolerance_s=_tolerance(self.future_tolerance),
        )


def _tolerance(text: str) -> float:
    """Seconds of ``--future-tolerance`` (a duration, or 0).

    Raises:
        ValueError: not a duration.
    """
    if re.fullmatch(r"\s*0+(\.0*)?\s*(ms|s|m|h|d|w)?\s*", str(text)):
        return 0.0
    try:
        return parse_duration(text)
    except ValueError:
        raise ValueError(f"--future-tolerance must be a duration such as 1h, 15m or 0, not {text!r}") from None


def default(name: str) -> Any:
    """The default of the setting ``name`` (a ``Settings`` field).

    Raises:
        KeyError: no such setting.
    """
    return Settings.model_fields[name].default


def retention_changes(settings: Settings) -> dict[str, Any] | None:
    """The retention bounds the settings change (``seconds``, ``documents``; a bound of
    None removes it), or None when they name none (the stored window stays).

    Raises:
        ValueError: a duration or count that is not one.
    """
    changes: dict[str, Any] = {}
    off = ("none", "off")
    if settings.retention is not None:
        text = str(settings.retention).strip().lower()
        changes["seconds"] = None if text in off else parse_duration(text)
    if settings.retention_documents is not None:
        text = str(settings.retention_documents).strip().lower()
        if text in off:
            changes["documents"] = None
        elif not text.isdigit() or int(text) < 1:
            raise ValueError(f"--retention-documents must be a count of at least 1 or none, not {text!r}")
        else:
            changes["documents"] = int(text)
    return changes or None


#: ``NEARDUP_*`` variables that are no settings and that the commands let be: those of
#: the local broker (deploy/local/kafka.sh), of the tests, the image's prebuilt kernels
#: (``neardup.kernel_cache``) and the choice of numba's JIT over the kernels built at install
#: (``neardup.core.aot``).
OTHER_VARIABLES = frozenset({
    "NEARDUP_KAFKA_HOME", "NEARDUP_KAFKA_BOOTSTRAP", "NEARDUP_KAFKA_START_TIMEOUT",
    "NEARDUP_KAFKA_HEAP_OPTS", "NEARDUP_KAFKA_JVM_OPTS", "NEARDUP_FUZZ_SEED", "NEARDUP_PREBUILT_KERNELS",
    "NEARDUP_KERNELS",
})


def variable(name: str) -> str:
    """The environment variable of the setting ``name``: ``NEARDUP_NUM_PERM`` for
    ``num_perm``."""
    return f"{Settings.model_config['env_prefix']}{name.upper()}"


def _did_you_mean(given: str, names: list[str], show: Callable[[str], str] = str) -> str:
    """`` (did you mean X?)`` with X the closest of ``names`` to ``given`` (as ``show``
    writes it), or ``""`` when none is close."""
    close = difflib.get_close_matches(given, names, n=1, cutoff=0.6)
    return f" (did you mean {show(close[0])}?)" if close else ""


def check_environment(environ: Mapping[str, str] | None = None) -> None:
    """Refuse a ``NEARDUP_*`` variable (any case, as the settings read them) that is
    neither a setting's (``variable``) nor one of ``OTHER_VARIABLES``.

    Args:
        environ: the variables; default ``os.environ``.

    Raises:
        ValueError: one line naming each such variable, with the closest setting's.
    """
    prefix = Settings.model_config["env_prefix"]
    known = [variable(name) for name in Settings.model_fields]
    unknown = sorted(name for name in (os.environ if environ is None else environ)
                     if name.upper().startswith(prefix) and name.upper() not in {*known, *OTHER_VARIABLES})
    if unknown:
        raise ValueError("; ".join(f"{name} is not a setting{_did_you_mean(name.upper(), known)}" for name in unknown)
                         + " (the variables are listed at the end of --help)")


#: What ``Settings`` reads besides its keyword arguments: the ``NEARDUP_*`` variables
#: (True) or not, and a TOML file's table (lowest priority) or None. Set by ``_sourced``.
_SOURCES: ContextVar[tuple[bool, dict[str, Any] | None]] = ContextVar("neardup_settings_sources",
                                                                     default=(True, None))


def _sourced(given: dict[str, Any], environment: bool, table: dict[str, Any] | None = None) -> Settings:
    """``Settings`` from ``given`` (keyword arguments), then (``environment``) the
    ``NEARDUP_*`` variables, then ``table`` (a TOML file's), in that order of priority.

    Raises:
        pydantic.ValidationError: a value is invalid.
    """
    token = _SOURCES.set((environment, table))
    try:
        return Settings(**given)
    finally:
        _SOURCES.reset(token)


def read_toml(path: Path) -> dict[str, Any]:
    """The settings of the TOML file ``path``, its keys and values checked.

    Raises:
        ValueError: one line starting with ``path``: the file is not TOML, a key is not
            a setting's name (with the closest one), or a value is invalid (naming its
            key; a ``[kafka]`` value is not repeated: it may be a secret).
        OSError: the file cannot be read.
    """
    try:
        with open(path, "rb") as f:
            table = tomllib.load(f)
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"{path}: not valid TOML: {exc}") from None
    names = list(Settings.model_fields)
    unknown = [key for key in table if key not in Settings.model_fields]
    if unknown:
        raise ValueError(f"{path}: " + "; ".join(
            f"unknown key {key!r}{_did_you_mean(key.replace('-', '_').lower(), names, repr)}" for key in unknown))
    try:
        _sourced(table, environment=False)
    except ValidationError as exc:
        parts = []
        for error in exc.errors():
            key = ".".join(str(part) for part in error["loc"]) or "settings"
            message = str(error["msg"]).removeprefix("Value error, ")
            given = "" if error["loc"][:1] == ("kafka",) else f", not {error['input']!r}"
            parts.append(f"key {key!r}: {message[:1].lower()}{message[1:]}{given}")
        raise ValueError(f"{path}: " + "; ".join(parts)) from None
    return table


def library_settings(options: Mapping[str, Any], toml_file: Path | None = None) -> Settings:
    """Settings for the Python API (``neardup.api``): ``options`` (keyword arguments,
    None values ignored) win over ``toml_file``, which wins over the defaults. The
    ``NEARDUP_*`` variables are not read: a program's settings do not change with the
    environment it runs in.

    Raises:
        FileNotFoundError: ``toml_file`` does not exist.
        pydantic.ValidationError: a value is invalid, or a name is no setting.
        ValueError: the TOML file has an unknown key or an invalid value.
    """
    if toml_file is not None and not Path(toml_file).is_file():
        raise FileNotFoundError(f"config file not found: {toml_file}")
    table = read_toml(Path(toml_file)) if toml_file is not None else None
    return _sourced({k: v for k, v in options.items() if v is not None}, environment=False, table=table)


def load_settings(overrides: dict[str, Any], toml_file: Path | None = None) -> Settings:
    """Settings from ``overrides`` (flags; None values ignored), the environment and
    ``toml_file``. A ``kafka`` override is merged into the lower sources' table.

    Raises:
        FileNotFoundError: ``toml_file`` does not exist.
        pydantic.ValidationError: a value is invalid (the message names it).
        ValueError: a librdkafka ``@PATH`` value whose file cannot be read; a
            ``NEARDUP_*`` variable that is no setting (``check_environment``); a TOML
            file with an unknown key or an invalid value (``read_toml``).
    """
    if toml_file is not None and not Path(toml_file).is_file():
        raise FileNotFoundError(f"config file not found: {toml_file}")
    check_environment()
    table = read_toml(Path(toml_file)) if toml_file is not None else None
    given = {k: v for k, v in overrides.items() if v is not None}
    kafka = given.pop("kafka", None)
    settings = _sourced(given, environment=True, table=table)
    # librdkafka overrides add to the [kafka] table (and NEARDUP_KAFKA), key by key; then
    # ``@PATH`` values are read from their files (neardup.kafka.kafka_config).
    merged = {**settings.kafka, **Settings._stringify(dict(kafka or {}))}
    return settings.model_copy(update={"kafka": read_value_files(merged)})
