"""Typed settings: command-line flags win over ``NEARDUP_*`` environment variables, which
win over a TOML file (``--config``), which wins over the defaults.

The TOML file holds the same names as the flags (underscores for dashes) at top level,
and librdkafka settings in a ``[kafka]`` table::

    threshold = 0.85
    shingle = "char:5"
    input_topics = ["wire"]
    [kafka]
    "security.protocol" = "SASL_SSL"
    "sasl.password" = "@/run/secrets/kafka"

A librdkafka value ``@PATH`` is read from the file PATH (``neardup.io.kafka_config``).

The defaults are written here only: the command-line help, the library functions
(``neardup.embedded.dedup_files``, ``neardup.evaluate.evaluate``) and ``EngineSettings``
read them from ``Settings`` (``default(name)``); tests/test_config.py checks that none is
restated with another value.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    NoDecode,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

from neardup.core.lsh import LshParams
from neardup.core.normalize import TextNorm
from neardup.core.retention import parse_duration
from neardup.core.settings import EngineSettings
from neardup.core.shingle import Shingling
from neardup.io.kafka_config import read_value_files

DEFAULT_METRICS_PORT = 9464  # ``run``; ``dedup`` serves no metrics unless given a port
DEFAULT_STATE_DIR = Path("neardup-state")  # ``run``; ``dedup`` uses a temporary directory
FILE_TEXT_FIELD = "text"  # JSONL files (dedup, eval): the field holding the text
FILE_ID_FIELD = "id"  # JSONL files (dedup, eval, produce): the field holding the id


class Settings(BaseSettings):
    """Every setting of the ``neardup`` commands, with its default."""

    model_config = SettingsConfigDict(env_prefix="NEARDUP_", extra="forbid")

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
    candidate_threshold: float | None = Field(None, gt=0.0, lt=1.0)
    multiset: bool = False
    # retention (stored with the state; changeable)
    retention: str | None = None  # duration, e.g. 72h; "none": no time bound
    retention_documents: int | str | None = None  # count; "none": no count bound
    timestamp_field: str | None = None  # dedup: the field holding each record's time
    # records
    text_field: Annotated[list[str], NoDecode] | None = None  # dedup: FILE_TEXT_FIELD; run: whole value
    id_field: str | None = None  # dedup: FILE_ID_FIELD; run: the message key
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
    reorder_window_ms: int = Field(2000, ge=0)
    instance: str | None = None  # default: the host name
    kafka: dict[str, str] = {}
    # operations
    metrics_host: str = "0.0.0.0"
    metrics_port: int | None = None
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
            candidate_threshold=self.candidate_threshold,
        )


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


def load_settings(overrides: dict[str, Any], toml_file: Path | None = None) -> Settings:
    """Settings from ``overrides`` (flags; None values ignored), the environment and
    ``toml_file``. A ``kafka`` override is merged into the lower sources' table.

    Raises:
        FileNotFoundError: ``toml_file`` does not exist.
        pydantic.ValidationError: a value is invalid (the message names it).
        ValueError: a librdkafka ``@PATH`` value whose file cannot be read.
    """
    if toml_file is not None and not Path(toml_file).is_file():
        raise FileNotFoundError(f"config file not found: {toml_file}")

    class _FromFile(Settings):
        @classmethod
        def settings_customise_sources(
            cls,
            settings_cls: type[BaseSettings],
            init_settings: PydanticBaseSettingsSource,
            env_settings: PydanticBaseSettingsSource,
            dotenv_settings: PydanticBaseSettingsSource,
            file_secret_settings: PydanticBaseSettingsSource,
        ) -> tuple[PydanticBaseSettingsSource, ...]:
            sources: tuple[PydanticBaseSettingsSource, ...] = (init_settings, env_settings)
            if toml_file is not None:
                sources += (TomlConfigSettingsSource(settings_cls, toml_file=toml_file),)
            return sources

    given = {k: v for k, v in overrides.items() if v is not None}
    kafka = given.pop("kafka", None)
    settings = _FromFile(**given)
    # librdkafka overrides add to the [kafka] table (and NEARDUP_KAFKA), key by key; then
    # ``@PATH`` values are read from their files (neardup.io.kafka_config).
    merged = {**settings.kafka, **Settings._stringify(dict(kafka or {}))}
    return settings.model_copy(update={"kafka": read_value_files(merged)})
