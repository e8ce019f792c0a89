"""librdkafka settings given by the user (``-X KEY=VALUE``, the TOML ``[kafka]`` table,
the ``NEARDUP_KAFKA`` variable): values read from files, checked before anything starts,
and secrets kept out of every message.

A value ``@PATH`` is the contents of the file PATH (one trailing newline dropped), so
that a password need not appear in ``ps`` or in a file of settings:
``-X sasl.password=@/run/secrets/kafka``. ``@@`` stands for a literal leading ``@``.
"""

from __future__ import annotations

import os
import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from neardup.config import Settings

#: Settings whose values are secrets: never logged, never in an error message.
SECRET = re.compile(r"password|secret|\.pem$|^sasl\.jaas\.config$|^sasl\.oauthbearer\.config$")
#: Settings naming a file librdkafka reads (``ssl.ca.location`` may also be ``probe``
#: or a directory).
FILE = re.compile(r"\.location$|^sasl\.kerberos\.keytab$")


def is_secret(key: str) -> bool:
    """Whether the librdkafka setting ``key`` holds a secret (password, key, token)."""
    return bool(SECRET.search(key))


def read_value_files(kafka: dict[str, str]) -> dict[str, str]:
    """``kafka`` with each ``@PATH`` value replaced by the contents of PATH.

    Raises:
        ValueError: a file cannot be read (the message names the setting and the path,
            never a value).
    """
    out = {}
    for key, value in kafka.items():
        if value.startswith("@@"):
            value = value[1:]
        elif value.startswith("@"):
            path = value[1:]
            try:
                with open(path, encoding="utf-8") as f:
                    value = f.read().removesuffix("\n")
            except (OSError, UnicodeDecodeError) as exc:
                reason = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
                raise ValueError(f"-X {key}=@{path}: cannot read the file: {reason}") from None
        out[key] = value
    return out


def redact(text: str, kafka: dict[str, str]) -> str:
    """``text`` with the value of every secret setting of ``kafka`` replaced by ``***``."""
    for key, value in kafka.items():
        if value and is_secret(key):
            text = text.replace(value, "***")
    return text


def check_kafka_settings(settings: Settings) -> None:
    """Refuse, before anything starts, what would stop ``neardup run`` later: no
    bootstrap servers or input topic, a file setting empty or unreadable, a setting
    librdkafka does not know or whose value it refuses (it builds a consumer and a
    producer from them and closes them at once, without connecting).

    Raises:
        ValueError: one line naming the flag or the setting.
    """
    from confluent_kafka import Consumer, KafkaException, Producer

    if not settings.bootstrap_servers:
        raise ValueError("--bootstrap-servers is required")
    if not settings.input_topics:
        raise ValueError("at least one --input-topic is required")
    for key, value in settings.kafka.items():
        if not FILE.search(key) or value == "probe":
            continue
        if not value:
            raise ValueError(f"-X {key} is empty: give the path of the file")
        if not os.access(value, os.R_OK):
            reason = "no such file" if not os.path.exists(value) else "not readable"
            raise ValueError(f"-X {key}={value}: {reason}")
    common = {"bootstrap.servers": settings.bootstrap_servers, "log_level": 0, **settings.kafka}
    try:
        Consumer({"group.id": settings.group_id, **common}).close()
        Producer({"transactional.id": "neardup-check", **common}).flush(0)
    except KafkaException as exc:
        raise ValueError(f"-X: {redact(exc.args[0].str(), settings.kafka)}") from None
