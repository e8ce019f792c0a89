"""Whether a Kafka stage makes progress: since when input has waited with no batch
committed, for ``/readyz``, a gauge, and a log line once a minute.

A consumer is *waiting* from the moment it holds a batch it has consumed (or a batch of
its own, ``Processor.due``) until a batch commits with nothing else in hand, or until it
is idle (nothing consumed) with no failed batch to take again. A failed batch keeps it
waiting even through an idle ``consume`` (its partitions were rewound, it comes back),
until a batch commits or the consumer has no partitions left. A batch of no messages
(``Processor.due``) that commits while a batch of messages keeps failing does not end it
(the runtime's rule, ``neardup.kafka.stage``). So an idle
consumer with nothing to read is never stalled; one that retries a batch that cannot be
committed (a dead-letter topic that refuses even neardup's headers alone, say) is, from
the moment it first consumed that batch.

A consumer waiting for longer than ``stall_after`` seconds is *stalled*: ``check`` (the
``/readyz`` test) fails with the reason, and a watchdog thread logs it once every
``log_every`` seconds, whatever the consumer's loop is doing.

A consumer *restoring* its state (``restoring``, until ``restored``: the runtime's check
of newly assigned partitions, Kafka Streams' restoration) is not ready, with that reason,
but not stalled: ``check`` fails with "restoring ... for N s", the waiting clock stops
(``waiting_since`` is 0, so no stall alert fires on a long restore) and starts again when
the restore ends, and the watchdog logs the restore once every ``log_every`` seconds at
INFO.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

#: Seconds input may wait with no batch committed before the consumer counts as stalled.
STALL_AFTER_S = 60.0
#: Seconds between two log lines of a stall.
LOG_EVERY_S = 60.0


class Progress:
    """Since when a consumer's input has waited with no batch committed. Thread-safe.

    Args:
        stall_after: seconds of waiting after which the consumer is stalled.
        log_every: seconds between two log lines of a stall (the first comes once it is
            stalled).
        name: the consumer, as the log names it (``neardup run``, ``the shard stage``).
    """

    def __init__(self, stall_after: float = STALL_AFTER_S, log_every: float = LOG_EVERY_S,
                 name: str = "the consumer") -> None:
        self.stall_after = stall_after
        self.log_every = log_every
        self.name = name
        self._lock = threading.Lock()
        self._since: float | None = None  # time.time() since which input waits
        self._failures = 0  # batches failed since the last commit
        self._last_error = ""
        self._first_error = ""  # of the failures since the last commit: often the cause
        self._restoring: tuple[str, float] | None = None  # what, and time.time() since when
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # --- fed by the consumer's loop -----------------------------------------------------
    def in_hand(self) -> None:
        """A batch is consumed (or made): input waits, from now if it did not already."""
        with self._lock:
            if self._since is None:
                self._since = time.time()

    def committed(self, more_in_hand: bool) -> None:
        """A batch committed; ``more_in_hand``: a later batch is held already."""
        with self._lock:
            self._since = time.time() if more_in_hand else None
            self._failures, self._last_error = 0, ""

    def failed(self, error: object) -> int:
        """A batch failed (it will be taken again): its error, in one line. Returns the
        failures since the last commit, this one included."""
        with self._lock:
            if self._since is None:
                self._since = time.time()
            self._failures += 1
            self._last_error = " ".join(str(error).split())
            if self._failures == 1:
                self._first_error = self._last_error
            return self._failures

    def idle(self, retrying: Callable[[], bool]) -> None:
        """Nothing consumed: input no longer waits, unless a batch failed since the last
        commit and ``retrying()`` says it will be taken again (partitions still assigned:
        a failed batch's partitions are rewound, a failed batch of no messages comes
        again when due)."""
        with self._lock:
            since, failures = self._since, self._failures
        if since is None or (failures and retrying()):
            return
        with self._lock:
            self._since = None
            self._failures, self._last_error = 0, ""

    def restoring(self, what: str) -> None:
        """A restore of ``what`` (e.g. the partitions whose state is checked) begins."""
        with self._lock:
            self._restoring = (what, time.time())

    def restored(self) -> None:
        """The restore ended: input that waits, waits from now."""
        with self._lock:
            self._restoring = None
            if self._since is not None:
                self._since = time.time()

    # --- read ------------------------------------------------------------------------
    def restoring_for(self) -> tuple[str, float] | None:
        """(what is restored, seconds since the restore began), or None."""
        with self._lock:
            restoring = self._restoring
        return None if restoring is None else (restoring[0], time.time() - restoring[1])

    def waiting_since(self) -> float:
        """Unix time (seconds) since which input has waited with no batch committed; 0
        while nothing waits or a restore runs (the gauge)."""
        with self._lock:
            return 0.0 if self._restoring is not None else self._since or 0.0

    def stalled(self) -> str | None:
        """The reason, in one line, when input has waited more than ``stall_after``
        seconds (a restore not counted); else None."""
        with self._lock:
            since, failures, first, error = self._since, self._failures, self._first_error, self._last_error
            if self._restoring is not None:
                return None
        if since is None:
            return None
        waited = time.time() - since
        if waited <= self.stall_after:
            return None
        reason = f"stalled: no batch committed for {waited:.0f} s while input waits"
        if failures:
            reason += f"; {failures} attempt(s) failed"
            if first != error:
                reason += f", the first: {first};"
            reason += f" the last: {error}" if first != error else f", the last: {error}"
        return reason

    def check(self) -> tuple[bool, str]:
        """(neither restoring nor stalled, the reason): a ``/readyz`` test."""
        restoring = self.restoring_for()
        if restoring is not None:
            return False, f"restoring the state of {restoring[0]} for {restoring[1]:.0f} s"
        reason = self.stalled()
        return (True, "making progress") if reason is None else (False, reason)

    # --- the watchdog -------------------------------------------------------------------
    def start(self) -> Progress:
        """Start the thread that logs a stall every ``log_every`` seconds."""
        if self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._watch, name="neardup-progress", daemon=True)
            self._thread.start()
        return self

    def close(self) -> None:
        """Stop the watchdog thread."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
            self._thread = None

    def _watch(self) -> None:
        tick = min(1.0, self.log_every / 4)
        logged_at = float("-inf")
        restore_logged_at = float("-inf")
        while not self._stop.wait(tick):
            restoring = self.restoring_for()
            if restoring is not None and restoring[1] >= self.log_every \
                    and time.monotonic() - restore_logged_at >= self.log_every:
                restore_logged_at = time.monotonic()
                log.info("%s is still restoring the state of %s (%.0f s so far)", self.name, *restoring)
            reason = self.stalled()
            if reason is None:
                logged_at = float("-inf")
                continue
            now = time.monotonic()
            if now - logged_at >= self.log_every:
                logged_at = now
                log.error("%s is %s", self.name, reason)
