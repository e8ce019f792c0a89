"""The ``neardup`` command: parsing and wiring only.

Subcommands: ``dedup`` (JSONL files, the embedded mode), ``run`` (the Kafka consumer),
``query`` (the nearest stored documents of texts, read-only), ``produce`` (replay JSONL
into a topic), ``params`` (the LSH banding for a threshold).
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import signal
import sys
import textwrap
import threading
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
from neardup import __version__
from neardup.config import (
    DEFAULT_METRICS_PORT,
    DEFAULT_STATE_DIR,
    FILE_ID_FIELD,
    FILE_TEXT_FIELD,
    MEMORY_STATE_BYTES,
    Settings,
    default,
    load_settings,
    retention_changes,
    variable,
)
from neardup.core import numba_math_without_scipy
from neardup.core.lsh import false_negative_area, false_positive_area
from neardup.core.settings import CANDIDATE_MARGIN, SCORE_RECALL, EngineSettings
from neardup.errors import user_error

log = logging.getLogger("neardup")


def _d(name: str) -> str:
    """``default <value>`` of the setting ``name``, as the help texts show it."""
    value = default(name)
    if isinstance(value, bool):
        text = "on" if value else "off"
    elif isinstance(value, float):
        text = f"{value:g}"
    else:
        text = str(value)
    return f"default {text}"


def _engine_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine (stored with the state: shingle, normalisation, num-perm, seed, bands, rows)")
    g.add_argument("--shingle", help=f"word:N or char:N shingles ({_d('shingle')})")
    g.add_argument("--num-perm", type=int, help=f"MinHash permutations ({_d('num_perm')})")
    g.add_argument("--seed", type=int, help=f"MinHash seed ({_d('seed')})")
    g.add_argument("--minhash", choices=["oph", "classic"], help=f"oph: one-permutation hashing with optimal densification (fast); classic: num-perm hash functions ({_d('minhash')})")
    g.add_argument("--threshold", type=float, help=f"Jaccard similarity of a duplicate ({_d('threshold')})")
    g.add_argument("--bands", type=int, help="LSH bands (default: optimal for the threshold)")
    g.add_argument("--rows", type=int, help="LSH rows per band (with --bands)")
    g.add_argument("--nfkc", action=argparse.BooleanOptionalAction, default=None, help=f"Unicode NFKC ({_d('nfkc')})")
    g.add_argument("--casefold", action=argparse.BooleanOptionalAction, default=None, help=f"case folding ({_d('casefold')})")
    g.add_argument("--strip-punctuation", action=argparse.BooleanOptionalAction, default=None, help=f"delete punctuation ({_d('strip_punctuation')})")
    g.add_argument("--max-bucket-size", type=int, help=f"documents kept per band bucket ({_d('max_bucket_size')})")
    g.add_argument("--max-candidates", type=int, help=f"candidates verified per document, those sharing the most buckets first ({_d('max_candidates')})")
    g.add_argument("--extra-candidates", type=int, help="candidates verified beyond --max-candidates while none is accepted and the best so far is a near miss (default 56; 248 with --measure containment)")
    g.add_argument("--measure", choices=["jaccard", "containment"], help=f"jaccard, or containment: the share of a document's shingles found in an earlier one ({_d('measure')})")
    g.add_argument("--containment-direction", choices=["new-in-earlier", "earlier-in-new", "both"], help=f"with --measure containment: a new text inside an earlier one, an earlier text inside a new one, or both ({_d('containment_direction')})")
    g.add_argument("--containment-ratio", type=float, help=f"with --measure containment: the largest size ratio of a contained text to its container that the banding is tuned for ({_d('containment_ratio')})")
    g.add_argument("--verify", choices=["exact", "estimate"], help=f"exact: decide on the exact similarity of stored shingle fingerprints; estimate: on the estimate from a bottom-k sample of them, the 2 x num-perm smallest (at most 8 x num-perm bytes per document; exact for shorter texts) ({_d('verify')})")
    g.add_argument("--duplicate-buckets", choices=["new", "all"], help=f"new: a duplicate joins only the LSH buckets holding none of its matches; all: every bucket ({_d('duplicate_buckets')})")
    g.add_argument("--cluster-policy", choices=["canonical", "components"], help=f"canonical: join a cluster only if similar to its canonical document; components: classic union-find ({_d('cluster_policy')})")
    g.add_argument("--score-floor", type=float, help=f"Jaccard similarity down to which every output's nearest and similarity reach: the banding makes a pair at the floor a candidate with probability {SCORE_RECALL:g} or more (lower: more candidates per document) (default: threshold minus {CANDIDATE_MARGIN:g})")
    g.add_argument("--candidate-threshold", type=float, help="Jaccard similarity the LSH banding is optimised for instead of reaching --score-floor (default: none for Jaccard; for containment t / (1 + R - t), R the containment ratio)")
    g.add_argument("--multiset", action=argparse.BooleanOptionalAction, default=None, help=f"count repeated shingles (a bag) instead of a set ({_d('multiset')})")


def _record_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("records")
    g.add_argument("--text-field", action="append", help=f"JSON field holding text, dotted path; repeat to join several (dedup default: {FILE_TEXT_FIELD}; run default: the whole message value)")
    g.add_argument("--id-field", help=f"JSON field holding the document id (dedup default: {FILE_ID_FIELD}, else the line number; run default: the message key, else topic/partition/offset)")
    g.add_argument("--text-format", choices=["plain", "html"], help=f"html: the text (each --text-field, or run's whole message value) is an HTML page and only its main text is deduplicated, without navigation, related links and footers; a page with none is rejected (dedup) or dead-lettered (run); needs pip install 'neardup[html]' ({_d('text_format')})")
    g.add_argument("--batch-size", type=int, help=f"documents per batch ({_d('batch_size')})")
    g.add_argument("--pipeline", action=argparse.BooleanOptionalAction, default=None, help=f"prepare the next batch (normalise, shingle, MinHash) while the current one is checked and written, in a second process (dedup: in a thread for the first 24 batches of an input under 64 MiB); run: when a backlog fills whole batches ({_d('pipeline')})")
    g.add_argument("--state-dir", type=Path, help=f"RocksDB state directory, kept between runs (run default ./{DEFAULT_STATE_DIR}; dedup default: state for the run only, in memory for inputs under {MEMORY_STATE_BYTES >> 20} MiB without a retention window, else in a temporary directory removed at the end)")


def _retention_flags(p: argparse.ArgumentParser, timestamp_field: bool) -> None:
    g = p.add_argument_group("retention (stored with the state; given again, it changes: shorter expires at once, longer cannot bring back what expired)")
    g.add_argument("--retention", metavar="DURATION", help="documents older than this stop being candidates, e.g. 72h, 7d, 30m (run: by Kafka record timestamp; dedup: by --timestamp-field, else arrival); none removes it (default: keep everything)")
    g.add_argument("--retention-documents", metavar="N", help="only the N most recent documents are candidates; none removes it (default: keep everything)")
    g.add_argument("--future-tolerance", metavar="DURATION", help="a record time later than now plus this is taken as now (counted, logged): one record stamped in the future cannot expire the window early; 0 allows none (default 1h)")
    if timestamp_field:
        g.add_argument("--timestamp-field", help="JSON field holding a record's time, ISO 8601 or epoch seconds (default: the time a line is read)")


def _metrics_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("metrics")
    g.add_argument("--metrics-port", type=int, help=f"serve Prometheus /metrics, /healthz and /readyz on this port (run default {DEFAULT_METRICS_PORT}, dedup and stage default off; 0 turns it off)")
    g.add_argument("--metrics-host", help=f"address to serve metrics on ({_d('metrics_host')})")


def _kafka_setting(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return key.strip(), value.strip()


def _common_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", type=Path, help="TOML settings file (flags and NEARDUP_* variables win)")
    p.add_argument("--log-level", help=f"DEBUG, INFO, WARNING, ERROR ({_d('log_level')})")
    p.add_argument("--log-format", choices=["text", "json"], help=f"log lines as text or JSON ({_d('log_format')})")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="neardup",
        description="Streaming near-duplicate detection for text: MinHash, LSH and union-find over RocksDB.",
    )
    parser.add_argument("--version", action="version", version=f"neardup {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    dedup = sub.add_parser("dedup", help="deduplicate JSONL files (embedded mode, no Kafka)",
                           epilog="exit status: 0 when done (lines rejected, if any, are counted on stderr and "
                                  "written to rejects.jsonl); 1 when every line was rejected (a misspelt "
                                  "--text-field, input that is not JSON lines); 2 on a usage or input error")
    dedup.add_argument("inputs", nargs="+", metavar="INPUT", help=".jsonl, .jsonl.gz or - for stdin")
    dedup.add_argument("--out-dir", type=Path, default=Path("neardup-out"), help="where unique.jsonl, duplicates.jsonl and rejects.jsonl go (default ./neardup-out)")
    dedup.add_argument("--append", action="store_true", help="append to non-empty output files that the state did not write (a rerun with the same --state-dir continues its own outputs anyway)")
    dedup.add_argument("--overwrite", action="store_true", help="empty the output files first (without it, non-empty outputs not written by the state are refused)")
    dedup.add_argument("--summary-json", type=Path, help="also write the summary as JSON here")
    dedup.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None, help="progress bar (default: on a terminal)")
    _engine_flags(dedup)
    _record_flags(dedup)
    _retention_flags(dedup, timestamp_field=True)
    _metrics_flags(dedup)
    _common_flags(dedup)

    run = sub.add_parser("run", help="consume Kafka topics, produce each message to a unique or duplicate topic (exactly once)")
    k = run.add_argument_group("Kafka")
    k.add_argument("--bootstrap-servers", help="host:port[,host:port...]")
    k.add_argument("--input-topic", dest="input_topics", action="append", help="topic to consume; repeat for several; ^regex for a pattern")
    k.add_argument("--group-id", help=f"consumer group ({_d('group_id')})")
    k.add_argument("--unique-topic", help="topic for unique messages (default <input>.unique)")
    k.add_argument("--duplicate-topic", help="topic for duplicates (default <input>.duplicates)")
    k.add_argument("--dlq-topic", help="dead-letter topic for malformed messages (default <input>.dlq)")
    k.add_argument("--batch-max-ms", type=int, help=f"longest wait to fill a batch, ms ({_d('batch_max_ms')})")
    k.add_argument("--max-message-bytes", type=int, help=f"larger values go to the dead-letter topic, bytes ({_d('max_message_bytes')})")
    k.add_argument("--from-beginning", action=argparse.BooleanOptionalAction, default=None, help=f"a new group starts at the earliest offset ({_d('from_beginning')}: at the latest)")
    k.add_argument("--transactional-id", help="one per instance, stable across restarts (default neardup-<group-id>)")
    k.add_argument("--partition-wait-ms", type=int, help=f"with several input partitions, messages are processed in order of record time (then partition, offset): the next is the earliest head among the partitions, and the others wait at most this long, ms, for a partition not read to its end (up to 60 s while the client knows it has records to fetch; 0: no wait otherwise) ({_d('partition_wait_ms')})")
    k.add_argument("--assign-wait-ms", type=int, help=f"a consumer that has no partitions assigned this long after subscribing or losing them, while the broker answers (or twice this long whatever it sees), is replaced by a new one; above the group's longest rebalance (the members' max.poll.interval.ms), ms ({_d('assign_wait_ms')})")
    k.add_argument("--changelog", choices=["on", "off"], help=f"keep the state's changelog in a compacted Kafka topic, written in each batch's transaction and restored from when the state directory is missing, empty or behind ({_d('changelog')})")
    k.add_argument("--changelog-topic", help="the changelog topic (default <group-id>.neardup-changelog; created compacted, with one partition, if missing)")
    k.add_argument("--topic-partitions", type=int, metavar="N", help=f"partitions of the output and dead-letter topics when neardup creates them ({_d('topic_partitions')}: the broker's num.partitions); existing topics are kept as they are")
    k.add_argument("--topic-replication-factor", type=int, metavar="N", help=f"replication factor of every topic neardup creates: outputs, dead letters, changelog ({_d('topic_replication_factor')}: the broker's default.replication.factor; 3 in production)")
    k.add_argument("--reset-state", action="store_true", default=None, help=f"accept a state that does not match the input (deleted, older, or of a topic created again): resume at the group's committed offsets, logged ({_d('reset_state')}: refuse to start)")
    k.add_argument("-X", dest="kafka", action="append", metavar="KEY=VALUE", type=_kafka_setting, help="librdkafka setting for the consumer and producer (SASL, TLS, ...); repeatable")
    _engine_flags(run)
    _record_flags(run)
    _retention_flags(run, timestamp_field=False)
    _metrics_flags(run)
    q = run.add_argument_group("queries (docs/kafka.md: POST /query answers a text with its nearest stored documents)")
    q.add_argument("--query-port", type=int, help="serve POST /query on this port (default off; 0 turns it off)")
    q.add_argument("--query-host", help=f"address to serve queries on ({_d('query_host')}: this host only)")
    q.add_argument("--query-token-file", type=Path, metavar="FILE", help="a file holding the bearer token every query must carry (default: none asked)")
    q.add_argument("--query-max-bytes", type=int, metavar="N", help=f"largest query body accepted, bytes ({_d('query_max_bytes')})")
    _common_flags(run)

    stage = sub.add_parser("stage", help="run one stage of a sharded deduplication over many processes (docs/scale-out.md)")
    stage.add_argument("role", choices=["prepare", "shard", "decide"], help="prepare: input -> band and documents records; shard: band buckets, verification; decide: verdicts to <input>.unique / .duplicates")
    g = stage.add_argument_group("Kafka")
    g.add_argument("--bootstrap-servers", help="host:port[,host:port...]")
    g.add_argument("--input-topic", dest="input_topics", action="append", help="the input topic (prepare consumes it; every stage needs it); repeat for several")
    g.add_argument("--app", help="prefix of the internal topics (<app>.bands, .sets, .findings, .decisions, .shard-changelog, .decide-changelog) and of the stages' consumer groups (<app>.<role>); default the --group-id")
    g.add_argument("--group-id", help=f"the default --app ({_d('group_id')})")
    g.add_argument("--shards", type=int, help=f"partitions of the band topic: shard partitions, fixed for the life of the state ({_d('shards')})")
    g.add_argument("--decide-partitions", type=int, help=f"partitions of the findings topic ({_d('decide_partitions')})")
    g.add_argument("--reorder-window-ms", type=int, help=f"prepare: how far behind the wall clock the next record of an input partition read to its end may be stamped; shards process documents in order-key order once every input partition's watermark is past them, and a partition read to its end (as the broker says) has the time the broker said so minus this as its watermark (longer: outputs wait longer while a partition is idle; shorter: a record stamped earlier is processed late) ({_d('reorder_window_ms')})")
    g.add_argument("--max-undecided", type=int, metavar="N", help=f"prepare: while a findings partition holds more than N documents this process sent that decide has not passed (prepared, not yet decided), prepare reads only the input partitions at or behind the earliest document the shards have not released, until it falls under N/2: a backlog cannot grow what decide and the shards hold in memory ({_d('max_undecided')})")
    g.add_argument("--state-dir", type=Path, help="shard: a directory holding each of this process's shard partitions in a RocksDB store (shard-<partition>); decide: one holding the decisions table (decisions); kept between runs so that a restart reads only the newer records of the changelog or table (default: in memory, read from the topics at every start)")
    g.add_argument("--topic-partitions", type=int, metavar="N", help=f"decide: partitions of the output and dead-letter topics when it creates them ({_d('topic_partitions')}: the broker's num.partitions); the internal topics have --shards and --decide-partitions")
    g.add_argument("--topic-replication-factor", type=int, metavar="N", help=f"replication factor of every topic a stage creates: internal topics, changelogs, outputs, dead letters ({_d('topic_replication_factor')}: the broker's default.replication.factor; 3 in production)")
    g.add_argument("--instance", help="this process's name among the stage's processes, stable across restarts: its transactional id is neardup-<app>.<role>-<instance> (default: the host name)")
    g.add_argument("--batch-max-ms", type=int, help=f"longest wait to fill a batch, ms ({_d('batch_max_ms')})")
    g.add_argument("--max-message-bytes", type=int, help=f"prepare: larger values go to the dead-letter topic, bytes ({_d('max_message_bytes')})")
    g.add_argument("--assign-wait-ms", type=int, help=f"a consumer that has no partitions assigned this long after subscribing or losing them, while the broker answers (or twice this long whatever it sees), is replaced by a new one; above the group's longest rebalance (the members' max.poll.interval.ms), ms ({_d('assign_wait_ms')})")
    g.add_argument("--from-beginning", action=argparse.BooleanOptionalAction, default=None, help=f"prepare: a new group starts at the input's earliest offset ({_d('from_beginning')}: at the latest)")
    g.add_argument("-X", dest="kafka", action="append", metavar="KEY=VALUE", type=_kafka_setting, help="librdkafka setting for the consumer and producer; repeatable")
    r = stage.add_argument_group("records")
    r.add_argument("--text-field", action="append", help="prepare: JSON field holding text, dotted path; repeat to join several (default: the whole message value)")
    r.add_argument("--id-field", help="prepare: JSON field holding the document id (default: the message key, else topic/partition/offset)")
    r.add_argument("--batch-size", type=int, help=f"messages per batch ({_d('batch_size')})")
    g = stage.add_argument_group("retention (every stage needs the same window: the shard and decide processes apply it, the shards delete the band records their expired members no longer need, and prepare then sends the sets in the band records)")
    g.add_argument("--retention", metavar="DURATION", help="documents whose record timestamp is older than this, against the latest one a shard has processed, stop being candidates and are removed from the shards' state, e.g. 72h, 7d, 30m; none: keep everything (the default)")
    g.add_argument("--future-tolerance", metavar="DURATION", help="a record timestamp later than now plus this does not move a shard's window beyond now: one record stamped in the future cannot expire the window early; 0 allows none (default 1h)")
    g.add_argument("--retention-documents", metavar="N", help="refused: a window of the last N documents needs one count of every document, which no shard keeps; use --retention")
    g.add_argument("--timestamp-field", help="refused: a document's time is its record timestamp, which orders the shards; stamp the input records with the document time")
    _engine_flags(stage)
    _common_flags(stage)
    _metrics_flags(stage)

    produce = sub.add_parser("produce", help="replay JSONL files into a Kafka topic, one message per line")
    produce.add_argument("inputs", nargs="+", metavar="INPUT", help=".jsonl, .jsonl.gz or - for stdin")
    produce.add_argument("--topic", required=True, help="topic to produce to")
    produce.add_argument("--bootstrap-servers", required=True, help="host:port[,host:port...]")
    produce.add_argument("--id-field", default=FILE_ID_FIELD, help=f"JSON field whose value is the message key (default {FILE_ID_FIELD}; empty: no key)")
    produce.add_argument("--limit", type=int, help="stop after this many messages")
    produce.add_argument("--rate", type=float, help="at most this many messages per second (default: as fast as possible)")
    produce.add_argument("-X", dest="kafka", action="append", metavar="KEY=VALUE", type=_kafka_setting, help="librdkafka producer setting; repeatable")
    produce.add_argument("--log-level", default=default("log_level"), help=f"DEBUG, INFO, WARNING, ERROR ({_d('log_level')})")
    produce.add_argument("--log-format", choices=["text", "json"], default=default("log_format"), help=f"log lines as text or JSON ({_d('log_format')})")

    ev = sub.add_parser("eval", help="measure detection quality against the exact all-pairs ground truth of a corpus")
    ev.add_argument("corpus", metavar="CORPUS", help=".jsonl or .jsonl.gz (up to about 50,000 documents)")
    ev.add_argument("--label-field", help="JSON field with cluster labels to compare against (default: exact connected components)")
    ev.add_argument("--report", type=Path, default=Path("neardup-eval/report.json"), help="JSON report (default neardup-eval/report.json); plots go beside it")
    _engine_flags(ev)
    _record_flags(ev)
    _common_flags(ev)

    query = sub.add_parser("query", help="print the stored documents nearest to texts, without changing the state",
                           epilog="Prints one JSON line per text: {\"query\": N, \"nearest\": [{\"id\", \"similarity\", "
                                  "\"jaccard\", \"containment\", \"cluster\"}, ...]}, most similar first. The engine "
                                  "settings are the state's own; the state is opened read-only (beside a running "
                                  "neardup run or dedup, it sees what they had committed). Exit status 2 when the "
                                  "state directory is missing or not a neardup state.")
    query.add_argument("texts", nargs="*", metavar="TEXT", help="texts to look up (default: --file, else stdin)")
    query.add_argument("--state-dir", type=Path, required=True, help="the state directory of neardup dedup or run")
    query.add_argument("--file", type=Path, action="append", help="read a text from this file (- for stdin); repeatable")
    query.add_argument("--lines", action="store_true", help="each line of --file or stdin is a text (default: the whole file is one)")
    query.add_argument("-k", "--top", type=int, default=5, help="neighbours per text (default 5)")
    query.add_argument("--measure", choices=["jaccard", "containment"], help=f"the similarity reported and ranked by ({_d('measure')})")
    query.add_argument("--containment-direction", choices=["new-in-earlier", "earlier-in-new", "both"], help=f"with --measure containment ({_d('containment_direction')})")

    params = sub.add_parser("params", help="print the LSH banding for a threshold")
    for flag, kind in (("--threshold", float), ("--num-perm", int), ("--bands", int), ("--rows", int),
                       ("--score-floor", float), ("--candidate-threshold", float), ("--containment-ratio", float)):
        params.add_argument(flag, type=kind, default=default(flag[2:].replace("-", "_")))
    params.add_argument("--measure", choices=["jaccard", "containment"], default=default("measure"))
    params.add_argument("--verify", choices=["exact", "estimate"], default=default("verify"))
    params.add_argument("--json", action="store_true", help="print JSON")
    query.formatter_class = argparse.RawDescriptionHelpFormatter
    query.epilog = "\n".join(textwrap.wrap(query.epilog, 88))
    for command in (dedup, run, stage, ev):
        command.formatter_class = argparse.RawDescriptionHelpFormatter
        own = "\n".join(textwrap.wrap(command.epilog, 88)) + "\n\n" if command.epilog else ""
        command.epilog = own + _environment(command)
    return parser


def _environment(command: argparse.ArgumentParser) -> str:
    """The epilog of a command that reads settings: the ``NEARDUP_*`` variable of each of
    its settings flags, generated from them and ``neardup.config.Settings``."""
    flags: dict[str, argparse.Action] = {}
    for action in command._actions:
        if action.dest in Settings.model_fields:
            flags.setdefault(action.dest, action)
    names = list(flags)
    listed = textwrap.fill("  ".join(variable(name) for name in names), 88, initial_indent="  ",
                           subsequent_indent="  ", break_on_hyphens=False)
    renamed = [f"{variable(n)} for {flags[n].option_strings[0]}" for n in names
               if flags[n].option_strings[0] != f"--{n.replace('_', '-')}"]
    lists = [variable(n) for n in names if isinstance(flags[n], argparse._AppendAction) and n != "kafka"]
    notes = f"Lists ({', '.join(lists)}) are comma-separated" if lists else ""
    if "kafka" in names:
        notes += f"{'; ' if notes else ''}{variable('kafka')} is a JSON object of librdkafka settings"
    text = (f"environment: a setting not given as a flag is read from its variable, then from the --config "
            f"TOML file (keys: the variables' names in lower case without NEARDUP_), then the default. "
            f"{'; '.join(renamed) + '. ' if renamed else ''}{notes + '. ' if notes else ''}On and off "
            f"settings take true or false. Other NEARDUP_* variables are refused, save NEARDUP_PREBUILT_KERNELS "
            f"(deploy/README.md), NEARDUP_KERNELS=jit (numba's JIT instead of the kernels built at "
            f"install) and those of the local "
            f"test broker (deploy/local/kafka.sh).")
    return "\n".join(textwrap.wrap(text, 88, break_on_hyphens=False)) + "\n" + listed


_NOT_SETTINGS = {"command", "role", "inputs", "out_dir", "append", "overwrite", "summary_json", "progress", "config",
                 "json", "corpus", "label_field", "report"}


def _settings(args: argparse.Namespace) -> Settings:
    overrides: dict[str, Any] = {k: v for k, v in vars(args).items() if k not in _NOT_SETTINGS}
    if overrides.get("kafka"):
        overrides["kafka"] = dict(overrides["kafka"])  # -X pairs
    return load_settings(overrides, args.config)


def _setup_logging(settings: Settings) -> None:
    handler = logging.StreamHandler(sys.stderr)
    if settings.log_format == "json":
        handler.setFormatter(_JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(settings.log_level.upper())


class _JsonFormatter(logging.Formatter):
    """One JSON object per line; ``time`` in RFC 3339 with milliseconds and the UTC
    offset (``2026-11-26T21:45:47.123+00:00``)."""

    def format(self, record: logging.LogRecord) -> str:
        out = {
            "time": datetime.fromtimestamp(record.created, timezone.utc).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out)


def _compile_notice() -> None:
    from neardup.detector import kernels_cached

    if not kernels_cached():
        log.info("compiling kernels, first run only (about a minute of CPU time)")


def cmd_params(args: argparse.Namespace) -> int:
    engine = Settings(
        threshold=args.threshold, num_perm=args.num_perm, bands=args.bands, rows=args.rows,
        measure=args.measure, verify=args.verify, candidate_threshold=args.candidate_threshold,
        containment_ratio=args.containment_ratio, score_floor=args.score_floor,
    ).engine()
    lsh = engine.bands
    grid = np.round(np.arange(0.5, 1.0001, 0.05), 2)
    table = {f"{s:.2f}": round(float(lsh.probability(s)), 6) for s in grid}
    fp, fn = false_positive_area(args.threshold, lsh), false_negative_area(args.threshold, lsh)
    if args.json:
        print(json.dumps({"threshold": args.threshold, "num_perm": args.num_perm,
                          "banding_threshold": engine.banding_threshold, "score_floor": engine.floor,
                          "score_floor_probability": round(float(lsh.probability(engine.floor)), 6), "bands": lsh.bands,
                          "rows": lsh.rows, "false_positive_area": fp, "false_negative_area": fn,
                          "probability": table}))
        return 0
    print(f"threshold {args.threshold}  num_perm {args.num_perm}")
    print(f"bands {lsh.bands}  rows {lsh.rows}  (uses {lsh.bands * lsh.rows} of {args.num_perm} slots), "
          f"tuned for similarity {engine.banding_threshold:.2f}")
    print(f"false-positive area {fp:.5f}  false-negative area {fn:.5f}")
    print(f"score floor {engine.floor:.2f}: a pair there is a candidate with probability "
          f"{lsh.probability(engine.floor):.4f} (scores reach down to it)")
    print("similarity  P(candidate)")
    for s, p in table.items():
        print(f"{s:>10}  {p:.4f}")
    return 0


def _metrics_server(settings: Settings, engine: EngineSettings, port: int, ready: Any = None) -> tuple[Any, Any]:
    """(Metrics, started MetricsServer or None when ``port`` is 0)."""
    from neardup.metrics import Metrics
    from neardup.server import MetricsServer, always_ready

    metrics = Metrics()
    metrics.set_build_info(engine)
    if not port:
        return metrics, None
    return metrics, MetricsServer(metrics, settings.metrics_host, port, ready or always_ready).start()


def cmd_dedup(args: argparse.Namespace, settings: Settings, engine: EngineSettings) -> int:
    from neardup.embedded import dedup_files

    port = settings.metrics_port or 0
    metrics, server = _metrics_server(settings, engine, port) if port else (None, None)  # imports only when served
    try:
        summary = dedup_files(
            args.inputs,
            engine,
            out_dir=args.out_dir,
            text_fields=settings.text_field or [FILE_TEXT_FIELD],
            id_field=settings.id_field or FILE_ID_FIELD,
            state_dir=settings.state_dir,
            batch_size=settings.batch_size,
            parallel=settings.pipeline,
            time_field=settings.timestamp_field,
            retention=retention_changes(settings),
            text_format=settings.text_format,
            append=args.append,
            overwrite=args.overwrite,
            progress=args.progress,
            on_batch=metrics.observe_results if metrics else None,
        )
    finally:
        if server:
            server.close()
    print(summary.render())
    print(f"outputs in {args.out_dir}/: unique.jsonl, duplicates.jsonl, rejects.jsonl")
    if summary.rejects:
        where = f"the first: {summary.first_reject}; all in {args.out_dir / 'rejects.jsonl'}"
        if not summary.documents:
            print(f"neardup: error: every line was rejected ({summary.rejects:,}; {where})", file=sys.stderr)
            return 1
        print(f"neardup: {summary.rejects:,} of {summary.rejects + summary.documents:,} lines rejected ({where})",
              file=sys.stderr)
    if args.summary_json:
        args.summary_json.write_text(json.dumps(summary.as_dict(), indent=2) + "\n")
    return 0


def _observed(metrics: Any, readiness: Any, lag: Any, observe: Any, refresh: Any = lambda: None) -> dict[str, Any]:
    """The callbacks of a consumer (``neardup run``'s, a stage's) that feed ``metrics`` and
    ``readiness``: ``lag()`` gives the consumer's lag, ``observe(result)`` takes a
    committed batch's result, ``refresh()`` reads what else changes (the state's size)."""

    def on_batch(result: Any) -> None:  # counters last: they tell a scrape the batch is in
        metrics.set_lag(lag())
        refresh()
        observe(result)

    def on_assignment(partitions: list[Any]) -> None:
        readiness.set_assignment(partitions)
        metrics.set_assignment(partitions)

    def on_broker() -> None:  # also every statistics interval when idle
        readiness.broker_answered()
        metrics.set_lag(lag())
        refresh()

    return {"on_batch": on_batch, "on_assignment": on_assignment, "on_broker": on_broker,
            "on_abort": metrics.transaction_aborted}


def cmd_run(settings: Settings, engine: EngineSettings) -> int:
    from neardup.detector import Detector
    from neardup.kafka.changelog import ChangelogWriter
    from neardup.run import KafkaDeduplicator
    from neardup.kafka.progress import Progress
    from neardup.server import Readiness
    from neardup.state.rocksdb import RocksDBStateStore

    from neardup.kafka.kafka_config import check_kafka_settings

    check_kafka_settings(settings)  # before the metrics server or the state start
    token = _query_token(settings)
    if settings.text_format == "html":
        from neardup.extract import require_extractor

        require_extractor()
    state_dir = settings.state_dir or DEFAULT_STATE_DIR
    progress = Progress(name="neardup run")
    readiness = Readiness(progress=progress)
    port = DEFAULT_METRICS_PORT if settings.metrics_port is None else settings.metrics_port
    metrics, server = _metrics_server(settings, engine, port, readiness.check)
    metrics.watch_progress(progress)

    def on_restore(event: Any) -> None:  # True when a restore begins, then its statistics
        readiness.set_restoring(event is True)
        metrics.observe_restore(event)

    changelog = ChangelogWriter(settings, on_restore) if settings.changelog == "on" else None
    try:
        with RocksDBStateStore(state_dir, engine.state_shape(), retention=retention_changes(settings),
                               log=changelog) as store:
            metrics.refresh_state(store, force=True)
            consumer = KafkaDeduplicator(
                settings, Detector(engine, store),
                **_observed(metrics, readiness, lambda: consumer.lag(), metrics.observe_batch,
                            lambda: metrics.refresh_state(store)),
                progress=progress,
            )
            queries = _query_server(settings, engine, store, token)
            try:
                consumer.run()
            finally:
                if queries:
                    queries.close()
    finally:
        if server:
            server.close()
    return 0


def _query_token(settings: Settings) -> str | None:
    """The bearer token of ``--query-token-file`` (its text, stripped), None without one.

    Raises:
        ValueError: the file cannot be read or is empty.
    """
    if settings.query_token_file is None:
        return None
    try:
        token = settings.query_token_file.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read --query-token-file {settings.query_token_file}: "
                         f"{getattr(exc, 'strerror', None) or exc}") from None
    if not token:
        raise ValueError(f"--query-token-file {settings.query_token_file} is empty")
    return token


def _query_server(settings: Settings, engine: EngineSettings, store: Any, token: str | None) -> Any:
    """The started ``QueryServer`` of ``neardup run`` on ``store``, or None when off.

    Raises:
        ServerError: the address cannot be bound.
    """
    if not settings.query_port:
        return None
    from neardup.server import QueryServer

    return QueryServer(store, engine, settings.query_host, settings.query_port, token,
                       settings.query_max_bytes).start()


def cmd_stage(role: str, settings: Settings) -> int:
    """One stage of a sharded deduplication (``neardup.sharded.prepare_stage``, ``shard_stage``,
    ``decide_stage``); every stage gets the same engine and topology settings."""
    import socket

    from neardup.kafka.kafka_config import check_kafka_settings
    from neardup.sharded.topology import Topology

    check_kafka_settings(settings)
    if not settings.bootstrap_servers:
        raise ValueError("--bootstrap-servers is required")
    if not settings.input_topics:
        raise ValueError("--input-topic is required")
    engine = settings.engine()
    if engine.verify != "exact":
        raise ValueError("neardup stage verifies exactly only (--verify exact)")
    if settings.retention_documents is not None:
        raise ValueError("neardup stage keeps a retention window by time only (--retention): a window of the last "
                         "N documents (--retention-documents) needs one count of every document, which no shard has")
    if settings.timestamp_field is not None:
        raise ValueError("neardup stage takes a document's time from its record timestamp, which orders the shards "
                         "(--timestamp-field is not read): stamp the input records with the document time instead")
    retention = (retention_changes(settings) or {}).get("seconds")
    retention_ms = None if retention is None else max(1, round(retention * 1000))
    if retention_ms is not None and engine.cluster_policy == "components":
        raise ValueError("neardup stage keeps a retention window with the canonical cluster policy only: "
                         "a merged cluster's root may be older than the window (use neardup run for both)")
    if settings.text_format != "plain":
        raise ValueError(f"neardup stage reads plain text only (--text-format {settings.text_format}): "
                         "extract the pages' main text before the input topic, or use neardup run")
    if settings.state_dir is not None and role == "prepare":
        raise ValueError("--state-dir is for the shard and decide stages; the prepare stage keeps no state")
    app = settings.app or settings.group_id
    topology = Topology(app, settings.shards, settings.decide_partitions, tuple(settings.input_topics),
                        keep_bands=True)
    instance = settings.instance or socket.gethostname()
    stage_settings = settings.model_copy(update={"group_id": f"{app}.{role}"})
    from neardup.metrics import StageMetrics
    from neardup.kafka.progress import Progress
    from neardup.server import MetricsServer, Readiness

    progress = Progress(name=f"the {role} stage")
    metrics, readiness = StageMetrics(role), Readiness(progress=progress)
    metrics.set_build_info(engine)
    metrics.watch_progress(progress)
    port = settings.metrics_port or 0  # off by default: several stage processes often share a host
    server = MetricsServer(metrics, settings.metrics_host, port, readiness.check).start() if port else None

    callbacks = {**_observed(metrics, readiness, lambda: runtime.lag(), metrics.observe), "progress": progress}
    try:
        if role == "prepare":
            from neardup.sharded.prepare_stage import PrepareStage

            runtime = PrepareStage(stage_settings, topology, instance, **callbacks)
        elif role == "shard":
            from neardup.sharded.shard_stage import ShardStage

            runtime = ShardStage(stage_settings, topology, instance, settings.state_dir, retention_ms,
                                 **callbacks)
        else:
            from neardup.sharded.decide_stage import DecideStage

            runtime = DecideStage(stage_settings, topology, instance, settings.state_dir, retention_ms, **callbacks)
        runtime.run()
    finally:
        if server:
            server.close()
    return 0


def cmd_produce(args: argparse.Namespace) -> int:
    from neardup.kafka.kafka_config import read_value_files
    from neardup.kafka.produce import ProduceError, produce_files

    _setup_logging(Settings(log_level=args.log_level, log_format=args.log_format))
    try:
        summary = produce_files(
            args.inputs, args.topic, args.bootstrap_servers, id_field=args.id_field or None,
            kafka=read_value_files(dict(args.kafka or [])), limit=args.limit, rate=args.rate,
        )
    except ProduceError as exc:
        print(f"neardup: error: {exc}", file=sys.stderr)
        return 1
    print(f"produced {summary.messages} messages ({summary.bytes} bytes) to {args.topic} in {summary.seconds:.2f} s")
    return 0


def _query_texts(args: argparse.Namespace) -> list[str]:
    """The texts of ``neardup query``: the arguments, then each ``--file``; stdin when
    neither is given."""
    texts = list(args.texts)
    sources = list(args.file or [])
    if not texts and not sources:
        sources = [Path("-")]
    for source in sources:
        if str(source) == "-":
            content = sys.stdin.read()
        else:
            content = source.read_text(encoding="utf-8")
        texts += [line for line in content.splitlines() if line.strip()] if args.lines else [content]
    return texts


def cmd_query(args: argparse.Namespace) -> int:
    from neardup.api import Deduplicator

    if args.top < 1:
        raise ValueError(f"--top must be at least 1, not {args.top}")
    texts = _query_texts(args)  # before the state opens: reading stdin may take a while
    options = {"measure": args.measure, "containment_direction": args.containment_direction}
    with Deduplicator(args.state_dir, read_only=True, **{k: v for k, v in options.items() if v}) as index:
        for n, neighbours in enumerate(index.query_many(texts, args.top)):
            sys.stdout.write(json.dumps({"query": n, "nearest": [x.to_dict() for x in neighbours]}) + "\n")
    return 0


def cmd_eval(args: argparse.Namespace, settings: Settings, engine: EngineSettings) -> int:
    try:
        from neardup.evaluate import evaluate, render
    except ImportError as exc:
        raise ValueError(f"neardup eval needs the eval extra: pip install 'neardup[eval]' ({exc})") from None
    from neardup.files import open_binary, read_lines
    from neardup.plots import write_plots
    from neardup.records import lookup

    with open_binary(args.corpus) as stream:
        lines = [line for line in read_lines(stream, settings.text_field or [FILE_TEXT_FIELD], settings.id_field or FILE_ID_FIELD,
                                             text_format=settings.text_format)
                 if line.document is not None]
    docs = [line.document for line in lines]
    labels = [lookup(line.record, args.label_field) for line in lines] if args.label_field else None
    report = evaluate(docs, engine, labels=labels, batch_size=settings.batch_size)
    args.report.parent.mkdir(parents=True, exist_ok=True)
    args.report.write_text(json.dumps({k: v for k, v in report.items() if k not in ("histogram", "score_pairs")}, indent=2) + "\n")
    plots = write_plots(report, args.report.parent)
    print(render(report))
    print(f"report {args.report}; plots {', '.join(str(p) for p in plots)}")
    return 0


class _Terminated(BaseException):
    """SIGTERM before the consumer loop took the signal over."""


#: Set when SIGTERM arrived while starting: a library the signal interrupted may have
#: wrapped ``_Terminated`` into an exception of its own (pydantic building a settings
#: class turns it into a ``SchemaError``), which then still means "stopped".
_terminating = threading.Event()


def _terminated(*_: Any) -> None:
    _terminating.set()
    raise _Terminated


#: The collector's thresholds for a command (``gc.set_threshold``): a young collection
#: every 50,000 net allocations instead of 700, a full one at most every 1,000 young
#: ones (and, as always, only once the objects that survived have grown by a quarter).
GC_THRESHOLDS = (50_000, 20, 100)


def collect_rarely() -> None:
    """Set the cyclic garbage collector for a long batch run (what a command does, not
    an import of the library): the state of a run is millions of small objects that
    live long (bucket lists, shingle sets, waiting documents), which the defaults scan
    again and again. Measured on the sharded stages (``benchmarks/scale_out.py``,
    20,000 documents, 16 shards): 1,151 µs of CPU per document with the defaults, 678
    with these. Objects alive at start-up (the modules) are frozen: never scanned."""
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)


def _compiles(args: argparse.Namespace) -> bool:
    """Whether the command runs compiled kernels (numba: about 0.5 s of start-up to
    import and load; the shard and decide stages run none)."""
    return args.command in ("dedup", "run", "eval", "query") or (args.command == "stage" and args.role == "prepare")


def main(argv: list[str] | None = None) -> int:
    collect_rarely()
    parser = build_parser()
    args = parser.parse_args(argv)
    if _compiles(args):
        numba_math_without_scipy()  # before any compiled call: 0.06-0.09 s of start-up
    if (args.command in ("run", "stage") and threading.current_thread() is threading.main_thread()
            and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL):
        # A consumer is stopped with SIGTERM (Kubernetes, systemd, a test): one that is
        # still starting stops there and exits 0, as it does once its loop runs (the loop
        # installs its own handler, which finishes and commits the batch in progress).
        _terminating.clear()
        signal.signal(signal.SIGTERM, _terminated)
        try:
            return _command(parser, args)
        finally:
            if signal.getsignal(signal.SIGTERM) is _terminated:
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
    return _command(parser, args)


def _command(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    settings: Settings | None = None
    try:
        if args.command == "params":
            return cmd_params(args)
        if args.command == "produce":
            return cmd_produce(args)
        if args.command == "query":
            _setup_logging(Settings())
            return cmd_query(args)
        settings = _settings(args)
        engine = settings.engine()  # built once; validated before anything starts
        retention_changes(settings)
        _setup_logging(settings)
        if _compiles(args):
            _compile_notice()
        if args.command == "dedup":
            return cmd_dedup(args, settings, engine)
        if args.command == "run":
            return cmd_run(settings, engine)
        if args.command == "stage":
            return cmd_stage(args.role, settings)
        if args.command == "eval":
            return cmd_eval(args, settings, engine)
    except KeyboardInterrupt:
        return 130
    except _Terminated:
        log.info("stopped by SIGTERM while starting")
        return 0
    except BrokenPipeError:  # output piped into a reader that stopped (e.g. head)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except Exception as exc:  # the one place where a user error becomes one line
        if _terminating.is_set():  # SIGTERM, wrapped by the library it interrupted
            log.info("stopped by SIGTERM while starting (it interrupted: %s)", type(exc).__name__)
            return 0
        line = user_error(exc, settings, dict(getattr(args, "kafka", None) or []))
        if line is None:
            raise
        print(f"neardup: error: {line}", file=sys.stderr)
        return 2
    parser.error(f"unknown command {args.command}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
