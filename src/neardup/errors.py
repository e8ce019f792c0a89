"""User errors as one line: what the ``neardup`` command prints (after
``neardup: error:``) instead of a traceback, naming the flag or setting at fault.

A user error is a bad value (flag, ``NEARDUP_*`` variable, TOML file, ``-X``), an input,
output or state directory that cannot be used, the machine refusing (read-only file
system, full disk), or a state built with other settings. Secrets (``-X`` passwords,
keys) never appear in the line.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from neardup.config import default
from neardup.core.lsh import optimal_params
from neardup.kafka.kafka_config import redact
from neardup.state.base import SettingsMismatchError, StateError

if TYPE_CHECKING:
    from neardup.config import Settings


class ServerError(RuntimeError):
    """A server (``neardup.server``) cannot listen on the address (port in use, unknown
    host). Defined here, not there, so that telling the user needs no HTTP module loaded."""


class DuplicateIdError(ValueError):
    """A document id that the index already holds, or that one call gives twice
    (``neardup.api.Deduplicator.add``): ids name documents in verdicts and must be
    distinct."""


class DocumentTypeError(TypeError):
    """A document's id or text that is not a ``str``, or a time that is not a number."""


class ClosedError(ValueError):
    """An operation on a closed ``neardup.api.Deduplicator`` (as on a closed file)."""


class ReadOnlyError(ValueError):
    """A document added to a ``neardup.api.Deduplicator`` opened read-only."""


def _flag(field: str) -> str:
    return f"--{field.replace('_', '-')}"


def _validation(exc: ValidationError) -> str:
    parts = []
    for error in exc.errors():
        field = str(error["loc"][0]) if error["loc"] else "settings"
        message = str(error["msg"]).removeprefix("Value error, ")
        message = message[:1].lower() + message[1:]
        given = "" if field == "kafka" else f", not {error['input']!r}"
        parts.append(f"{_flag(field)} (or NEARDUP_{field.upper()}): {message}{given}")
    return "; ".join(parts)


#: The user settings each state-shaping setting comes from.
_SHAPED_BY = {
    "normalization": "--nfkc, --casefold, --strip-punctuation",
    "shingling": "--shingle, --multiset",
    "num_perm": "--num-perm",
    "seed": "--seed",
    "minhash": "--minhash",
    "verify": "--verify",
    "cluster_policy": "--cluster-policy",
}


def _banding(stored: tuple[int, int], settings: Settings) -> str:
    """Which user setting changed the banding, and the value that gives the stored one."""
    engine = settings.engine()
    now = f"{engine.bands.bands} bands x {engine.bands.rows} rows"
    if settings.bands is not None:
        return f"--bands {settings.bands} --rows {settings.rows} give {now}"
    if settings.candidate_threshold is None and engine.measure == "jaccard":
        earlier = optimal_params(engine.banding_threshold, engine.num_perm)
        if (earlier.bands, earlier.rows) == stored:
            return (f"the state was built with {stored[0]} bands x {stored[1]} rows, the banding earlier "
                    f"versions chose for --threshold {settings.threshold:g}; this one chooses {now} so that "
                    f"scores reach the score floor {engine.floor:g}: give --bands {stored[0]} --rows {stored[1]} "
                    f"to keep this state (scores then reach less far)")
    flag, current = ("--candidate-threshold", settings.candidate_threshold) if \
        settings.candidate_threshold is not None else ("--threshold", settings.threshold)
    threshold = default("threshold")
    plain = replace(engine, lsh=None, threshold=threshold, candidate_threshold=None).bands
    built = f" (as the default --threshold {threshold:g} does)" if (plain.bands, plain.rows) == stored else ""
    return (f"{flag} changed: {current:g} gives {now}, the state was built with "
            f"{stored[0]} x {stored[1]}{built}; give the {flag} it was built with, or "
            f"--bands {stored[0]} --rows {stored[1]}")


def _mismatch(exc: SettingsMismatchError, settings: Settings | None) -> str:
    diffs = dict(exc.differences)
    parts = []
    if settings is not None and ("bands" in diffs or "rows" in diffs):
        stored = (diffs.get("bands", (settings.engine().bands.bands,))[0],
                  diffs.get("rows", (settings.engine().bands.rows,))[0])
        diffs.pop("bands", None)
        diffs.pop("rows", None)
        parts.append(_banding(stored, settings))
    for name, (stored, requested) in sorted(diffs.items()):
        parts.append(f"{_SHAPED_BY.get(name, name)}: the state has {stored!r}, this run {requested!r}")
    return ("the state directory was built with other settings: " + "; ".join(parts)
            + "; use the state's settings or another --state-dir")


def _refused_setting(exc: BaseException) -> bool:
    """A KafkaException of librdkafka refusing a setting (``_INVALID_ARG``) when a client
    is created; other Kafka errors are not the user's."""
    error = exc.args[0] if type(exc).__name__ == "KafkaException" and exc.args else None
    return hasattr(error, "code") and error.code() == -186  # KafkaError._INVALID_ARG


def user_error(exc: BaseException, settings: Settings | None = None,
               kafka: dict[str, str] | None = None) -> str | None:
    """The one line that reports ``exc`` to the user, or None when it is not a user
    error (a bug: let its traceback show).

    Args:
        settings: the run's settings, when known (for the state mismatch and secrets).
        kafka: the librdkafka settings given, when ``settings`` is not known (secrets).
    """
    secrets: dict[str, Any] = settings.kafka if settings is not None else (kafka or {})
    if isinstance(exc, ValidationError):
        line = _validation(exc)
    elif isinstance(exc, SettingsMismatchError):
        line = _mismatch(exc, settings)
    elif isinstance(exc, (ValueError, StateError, ServerError)):
        line = str(exc)
    elif _refused_setting(exc):
        line = f"-X: {exc.args[0].str()}"
    elif isinstance(exc, OSError):
        what = f"{exc.filename}: " if exc.filename else ""
        line = f"{what}{exc.strerror or exc}"
    else:
        return None
    return redact(" ".join(line.split()), secrets)
