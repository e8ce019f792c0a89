"""librdkafka's log lines through Python logging, rate-limited.

While a broker is down, every client reconnects every ``reconnect.backoff.ms`` and logs
each failure ("Connect to ipv4#127.0.0.1:9092 failed: Connection refused"): about 20
lines a second for one consumer and its producer. Passing ``rdkafka_logger()`` as the
``logger`` of a client's configuration sends its lines to the ``neardup.rdkafka`` logger
(served by the client's ``poll``/``consume``), where ``RateLimit`` lets through the first
line of each kind and then at most one every ``interval_s`` seconds, telling how many
were left out. ``ProducerLog`` does the same for one producer and keeps its last
transaction error.
"""

from __future__ import annotations

import logging
import re
import threading
import time

LOGGER_NAME = "neardup.rdkafka"
#: At most one line of a kind per this many seconds.
INTERVAL_S = 10.0

_NUMBERS = re.compile(r"\d+")


class RateLimit(logging.Filter):
    """Lets through the first record of a kind, then at most one per ``interval_s``
    seconds; a record let through after others were dropped says how many.

    The kind is the message with every run of digits blanked (client numbers, ports,
    milliseconds), so that the same failure of another connection attempt is the same
    kind, and the same failure of another broker is not.
    """

    def __init__(self, interval_s: float = INTERVAL_S) -> None:
        super().__init__()
        self.interval_s = interval_s
        self._kinds: dict[str, tuple[float, int]] = {}  # kind -> (last let through, dropped since)
        self._lock = threading.Lock()

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        kind = _NUMBERS.sub("#", message)
        now = time.monotonic()
        with self._lock:
            last, dropped = self._kinds.get(kind, (-float("inf"), 0))
            if now - last < self.interval_s:
                self._kinds[kind] = (last, dropped + 1)
                return False
            self._kinds[kind] = (now, 0)
            if len(self._kinds) > 1000:  # kinds that stopped coming
                self._kinds = {k: v for k, v in self._kinds.items() if now - v[0] < self.interval_s}
        if dropped:
            record.msg, record.args = f"{message} ({dropped} more like it in the last {now - last:.0f} s)", None
        return True


def rdkafka_logger() -> logging.Logger:
    """The ``neardup.rdkafka`` logger, with one ``RateLimit`` filter, for the ``logger``
    key of a librdkafka client's configuration."""
    logger = logging.getLogger(LOGGER_NAME)
    if not any(isinstance(f, RateLimit) for f in logger.filters):
        logger.addFilter(RateLimit())
    return logger


_THREAD = re.compile(r"^\[thrd:[^\]]*\]: ")


class ProducerLog:
    """The ``logger`` of one producer's configuration: its lines go to ``rdkafka_logger()``,
    and the last transaction error it logged (librdkafka's ``TXNERR`` line, e.g.
    "Current transaction failed in state InTransaction: ProduceRequest for T [0] with 2
    message(s) failed: Broker: Message size too large ...") is kept in
    ``transaction_error``: a later call of the transaction may fail with "Local:
    Erroneous state" only, which names neither the topic nor the broker's refusal.

    librdkafka calls ``log(level, "%s [%s] %s", facility, client name, line)`` from the
    thread that serves the producer's queue (``poll``, ``flush``).
    """

    def __init__(self) -> None:
        self.logger = rdkafka_logger()
        self.transaction_error: str | None = None

    def log(self, level: int, msg: str, *args: object) -> None:
        if len(args) == 3 and args[0] == "TXNERR":
            self.transaction_error = _THREAD.sub("", str(args[2]))
        self.logger.log(level, msg, *args)
