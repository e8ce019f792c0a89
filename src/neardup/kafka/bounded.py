"""Waits on librdkafka calls that are bounded here, not by librdkafka.

After a broker restart a transactional call can block far past the timeout it was given
(librdkafka's "send_offsets_to_transaction ignores timeout", issue 5456 there). Such a
call runs in a daemon thread of its own and is waited for at most ``wait_s`` seconds; if
it has not returned by then, ``ProducerWedged`` is raised and the producer must never be
called again: the caller replaces it (a new producer with the same ``transactional.id``
fences the old one and has the broker abort its transaction). The thread keeps the old
producer referenced until the call returns, so its destruction, which can block as
well, never happens in the caller's thread (``discard``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, TypeVar

from confluent_kafka import KafkaError, KafkaException

T = TypeVar("T")

#: Timeout handed to librdkafka's transactional calls, seconds.
CALL_TIMEOUT_S = 20.0
#: How long such a call is waited for before its producer counts as wedged, seconds.
CALL_WAIT_S = CALL_TIMEOUT_S + 10.0


class ProducerWedged(KafkaException):
    """A call on a producer did not return within its bound: the producer is abandoned."""

    def __init__(self, what: str, wait_s: float) -> None:
        super().__init__(KafkaError(KafkaError._TIMED_OUT, f"{what} did not return within {wait_s:.0f} s"))


def bounded(what: str, call: Callable[..., T], *args: Any, wait_s: float = CALL_WAIT_S) -> T:
    """``call(*args)`` in a daemon thread, waited for at most ``wait_s`` seconds.

    ``call`` should be a bound method of the producer (or otherwise hold it), so that a
    call left running keeps the producer alive in its own thread.

    Returns:
        What ``call`` returned.

    Raises:
        ProducerWedged: ``call`` had not returned after ``wait_s`` seconds (it goes on
            in its thread; its outcome is dropped).
        BaseException: whatever ``call`` raised.
    """
    outcome: list[Any] = []

    def target() -> None:
        try:
            outcome.append((True, call(*args)))
        except BaseException as exc:  # noqa: BLE001 - raised again in the caller's thread
            outcome.append((False, exc))

    thread = threading.Thread(target=target, name=f"neardup-{what}", daemon=True)
    thread.start()
    thread.join(wait_s)
    if not outcome:
        raise ProducerWedged(what, wait_s)
    ok, value = outcome[0]
    if not ok:
        raise value
    return value


def discard(client: Any) -> None:
    """Drop ``client`` in a thread of its own, a second from now: destroying a librdkafka
    handle waits for its threads, which a wedged call can hold up. The caller drops its
    own references at once (e.g. ``producer, self.producer = self.producer, None``)."""
    holder = [client]
    del client
    timer = threading.Timer(1.0, holder.clear)
    timer.name, timer.daemon = "neardup-discard", True
    timer.start()
