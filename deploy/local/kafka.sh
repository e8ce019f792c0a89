#!/usr/bin/env bash
# A real single-node Apache Kafka broker (KRaft, broker+controller in one JVM) for
# development and CI, built from the jars published on Maven Central. No Docker.
#
# Usage: bash deploy/local/kafka.sh {fetch|start|stop|kill|restart|status|logs}
#   fetch   copy the broker's runtime jars into <cache>/libs (Maven; skipped when complete)
#   start   fetch if needed, start a fresh broker on free 127.0.0.1 ports, print its
#           bootstrap address (the last stdout line); if one already runs, print its address
#   stop    stop the broker started from this cache (TERM, then KILL after 30 s)
#   kill    SIGKILL the broker, as a crash would: run/ (data, ports) is kept
#   restart start the broker of run/ again in place: same data, same ports, same cluster;
#           print its bootstrap address. A broker still running is SIGKILLed first.
#   status  print the bootstrap address and exit 0 if the broker answers, else exit 1
#   logs    print the tail of the broker's log
#
# Cache: $NEARDUP_KAFKA_HOME, default <repo>/.cache/kafka. Layout:
#   libs/                 runtime jars (+ .complete marker holding the pom's checksum)
#   run/                  wiped at every start (kept by kill and restart): server.properties,
#                         server.log (broker log; server.log.previous: before the last restart),
#                         stdout.log (JVM output), data/ (log.dirs), kafka.pid, bootstrap,
#                         format.log + storage-tool.log (storage formatting)
# JVM options: $NEARDUP_KAFKA_HEAP_OPTS (default -Xms256m -Xmx512m) and
# $NEARDUP_KAFKA_JVM_OPTS (default none; the tests set -XX:TieredStopAtLevel=1
# -XX:+UseSerialGC, which halves the broker's CPU on their short runs).
# Requires: java (17+), mvn (only for the first fetch), python3.
set -euo pipefail

SCRIPT_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO_ROOT=$(cd "$SCRIPT_DIR/../.." && pwd)
POM="$SCRIPT_DIR/pom.xml"
LOG4J_CONF="$SCRIPT_DIR/log4j2.properties"

CACHE_DIR=${NEARDUP_KAFKA_HOME:-$REPO_ROOT/.cache/kafka}
LIBS="$CACHE_DIR/libs"
MARKER="$LIBS/.complete"
RUN="$CACHE_DIR/run"
PID_FILE="$RUN/kafka.pid"
BOOTSTRAP_FILE="$RUN/bootstrap"
SERVER_LOG="$RUN/server.log"
STDOUT_LOG="$RUN/stdout.log"

START_TIMEOUT=${NEARDUP_KAFKA_START_TIMEOUT:-90}
STOP_TIMEOUT=30
HEAP_OPTS=${NEARDUP_KAFKA_HEAP_OPTS:--Xms256m -Xmx512m}
JVM_OPTS=${NEARDUP_KAFKA_JVM_OPTS:-}

log() { echo "kafka.sh: $*" >&2; }
die() { log "$*"; exit 1; }

# Checksum of the pom: the libs folder is complete only for the pom it was fetched with.
pom_sum() { sha256sum "$POM" | cut -d' ' -f1; }

libs_complete() { [[ -f "$MARKER" && "$(cat "$MARKER")" == "$(pom_sum)" ]]; }

cmd_fetch() {
    if libs_complete; then
        return 0
    fi
    command -v mvn >/dev/null || die "mvn not found (needed once to fetch the Kafka jars)"
    log "fetching Kafka jars into $LIBS (Maven)..."
    local tmp="$CACHE_DIR/libs.tmp.$$"
    rm -rf "$tmp"
    mkdir -p "$CACHE_DIR"
    if ! mvn -B -q -Dstyle.color=never -f "$POM" dependency:copy-dependencies \
            -DincludeScope=runtime -DoutputDirectory="$tmp" >"$CACHE_DIR/mvn.log" 2>&1; then
        cat "$CACHE_DIR/mvn.log" >&2
        rm -rf "$tmp"
        die "Maven failed to fetch the Kafka jars (log: $CACHE_DIR/mvn.log)"
    fi
    ls "$tmp"/kafka_2.13-*.jar >/dev/null 2>&1 || { rm -rf "$tmp"; die "no kafka_2.13 jar after fetch"; }
    pom_sum >"$tmp/.complete"
    rm -rf "$LIBS"
    mv "$tmp" "$LIBS"
    log "fetched $(ls "$LIBS"/*.jar | wc -l) jars"
}

# Prints the pid of the broker started from this cache if that process is alive.
broker_pid() {
    [[ -f "$PID_FILE" ]] || return 1
    local pid
    pid=$(cat "$PID_FILE")
    [[ "$pid" =~ ^[0-9]+$ ]] || return 1
    kill -0 "$pid" 2>/dev/null || return 1
    # Guard against pid reuse: the process must be a Kafka broker run from this RUN dir.
    tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null | grep -qF "kafka.Kafka $RUN/server.properties" || return 1
    echo "$pid"
}

# Exit 0 if a broker answers at $1 (host:port). Uses confluent_kafka's AdminClient when
# importable (answers only once the broker is registered and unfenced), else a TCP connect.
probe() {
    python3 - "$1" 2>/dev/null <<'PY'
import sys
host, port = sys.argv[1].rsplit(":", 1)
try:
    from confluent_kafka.admin import AdminClient
except ImportError:
    import socket
    try:
        socket.create_connection((host, int(port)), timeout=2).close()
    except OSError:
        sys.exit(1)
    sys.exit(0)
try:
    md = AdminClient({"bootstrap.servers": sys.argv[1], "log_level": 0}).list_topics(timeout=2)
except Exception:
    sys.exit(1)
sys.exit(0 if md.brokers else 1)
PY
}

running_bootstrap() {
    broker_pid >/dev/null || return 1
    [[ -s "$BOOTSTRAP_FILE" ]] || return 1
    local bs
    bs=$(cat "$BOOTSTRAP_FILE")
    probe "$bs" || return 1
    echo "$bs"
}

show_log_tail() {
    if [[ -s "$SERVER_LOG" ]]; then
        echo "----- ERROR/FATAL lines of $SERVER_LOG -----" >&2
        grep -E "^\[[^]]*\] (ERROR|FATAL) " "$SERVER_LOG" | tail -n 20 >&2 || true
        echo "----- tail of $SERVER_LOG -----" >&2
        tail -n 40 "$SERVER_LOG" >&2
    fi
    if [[ -s "$STDOUT_LOG" ]]; then
        echo "----- tail of $STDOUT_LOG -----" >&2
        tail -n 40 "$STDOUT_LOG" >&2
    fi
}

stop_pid() {
    local pid=$1 i
    kill -TERM "$pid" 2>/dev/null || return 0
    for ((i = 0; i < STOP_TIMEOUT * 10; i++)); do
        kill -0 "$pid" 2>/dev/null || return 0
        sleep 0.1
    done
    log "broker (pid $pid) still alive after ${STOP_TIMEOUT}s, sending KILL"
    kill -KILL "$pid" 2>/dev/null || true
    for ((i = 0; i < 50; i++)); do
        kill -0 "$pid" 2>/dev/null || return 0
        sleep 0.1
    done
}

# Two distinct free TCP ports on 127.0.0.1 (both held open while choosing), below the
# kernel's ephemeral range: a port of that range, free when chosen, can be handed to an
# outgoing connection before the broker binds it seconds later ("Address already in use",
# seen with many clients connecting at once).
free_ports() {
    python3 -c '
import random, socket
try:
    low = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
except (OSError, ValueError, IndexError):
    low = 32768
held = []
while len(held) < 2:
    s = socket.socket()
    try:
        s.bind(("127.0.0.1", random.randrange(10000, max(10001, low))))
    except OSError:
        s.close()
        continue
    if s.getsockname()[1] in [x.getsockname()[1] for x in held]:
        s.close()
        continue
    held.append(s)
print(*(x.getsockname()[1] for x in held))
for x in held:
    x.close()
'
}

# 22-char URL-safe base64 of a random UUID. A leading "-" would be parsed as an option
# by the storage tool's argument parser, so such ids are redrawn (as Kafka's Uuid does).
new_cluster_id() {
    python3 -c '
import base64, uuid
while True:
    s = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
    if not s.startswith("-"):
        print(s)
        break
'
}

write_server_properties() {
    local port=$1 cport=$2
    cat >"$RUN/server.properties" <<EOF
# Generated by deploy/local/kafka.sh: single-node KRaft broker for development and tests.
process.roles=broker,controller
node.id=1
controller.quorum.bootstrap.servers=127.0.0.1:$cport
listeners=PLAINTEXT://127.0.0.1:$port,CONTROLLER://127.0.0.1:$cport
advertised.listeners=PLAINTEXT://127.0.0.1:$port,CONTROLLER://127.0.0.1:$cport
inter.broker.listener.name=PLAINTEXT
controller.listener.names=CONTROLLER
listener.security.protocol.map=CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT
log.dirs=$RUN/data

# One node: every internal topic has replication factor 1.
offsets.topic.replication.factor=1
offsets.topic.num.partitions=1
transaction.state.log.replication.factor=1
transaction.state.log.min.isr=1
transaction.state.log.num.partitions=1
share.coordinator.state.topic.replication.factor=1
share.coordinator.state.topic.min.isr=1

# Test-friendly settings.
group.initial.rebalance.delay.ms=0
group.min.session.timeout.ms=1000
auto.create.topics.enable=true
num.partitions=1
default.replication.factor=1
transaction.abort.timed.out.transaction.cleanup.interval.ms=2000
# Records are kept however old their timestamps: replayed stories are stamped in the
# past, and the retention check (every 5 minutes) would otherwise delete a topic's
# records, outputs too, while they are still read (seen in a test: stamped in 2023).
log.retention.ms=-1
EOF
}

# Start the broker of $RUN/server.properties (formatted storage) in the background and
# wait until it answers at $1 (controller port $2); print $1.
launch() {
    local bs=$1 cport=$2
    local -a jvm_log=(-Dlog4j2.configurationFile="$LOG4J_CONF" -Dkafka.logs.dir="$RUN")
    # setsid: own session, so terminal signals to the caller's process group do not reach it.
    # 9>&-: do not hand the start lock to the broker.
    local -a launcher=(nohup)
    command -v setsid >/dev/null && launcher+=(setsid)
    # shellcheck disable=SC2086
    "${launcher[@]}" java $HEAP_OPTS $JVM_OPTS -XX:+ExitOnOutOfMemoryError -Djava.awt.headless=true \
        "${jvm_log[@]}" -cp "$LIBS/*" kafka.Kafka "$RUN/server.properties" \
        >"$STDOUT_LOG" 2>&1 </dev/null 9>&- &
    local pid=$!
    echo "$pid" >"$PID_FILE"
    log "broker pid $pid starting on $bs (controller 127.0.0.1:$cport), log: $SERVER_LOG"

    local deadline=$((SECONDS + START_TIMEOUT))
    while ((SECONDS < deadline)); do
        if ! kill -0 "$pid" 2>/dev/null; then
            show_log_tail
            rm -f "$PID_FILE"
            die "broker exited during startup"
        fi
        if grep -q "Kafka Server started" "$SERVER_LOG" 2>/dev/null && probe "$bs"; then
            echo "$bs" >"$BOOTSTRAP_FILE"
            log "broker ready after $((SECONDS + START_TIMEOUT - deadline))s"
            echo "$bs"
            return 0
        fi
        sleep 0.5
    done
    show_log_tail
    stop_pid "$pid"
    rm -f "$PID_FILE"
    die "broker did not answer within ${START_TIMEOUT}s"
}

cmd_start() {
    local bs
    if bs=$(running_bootstrap); then
        log "broker already running (pid $(cat "$PID_FILE"))"
        echo "$bs"
        return 0
    fi
    local old
    if old=$(broker_pid); then
        log "broker pid $old is alive but does not answer; restarting it"
        stop_pid "$old"
    fi

    cmd_fetch
    command -v java >/dev/null || die "java not found"

    rm -rf "$RUN"
    mkdir -p "$RUN/data"
    local ports port cport cluster_id
    ports=$(free_ports)
    read -r port cport <<<"$ports"
    bs="127.0.0.1:$port"
    write_server_properties "$port" "$cport"
    cluster_id=$(new_cluster_id)

    local -a jvm_log=(-Dlog4j2.configurationFile="$LOG4J_CONF" -Dkafka.logs.dir="$RUN")
    if ! java -Xmx256m -XX:TieredStopAtLevel=1 "${jvm_log[@]}" -Dkafka.log.file=storage-tool.log \
            -cp "$LIBS/*" kafka.tools.StorageTool \
            format --standalone -t "$cluster_id" -c "$RUN/server.properties" \
            >"$RUN/format.log" 2>&1; then
        cat "$RUN/format.log" >&2
        grep -E " (ERROR|FATAL) " "$RUN/storage-tool.log" >&2 2>/dev/null || true
        die "formatting the storage in $RUN/data failed"
    fi

    launch "$bs" "$cport"
}

cmd_stop() {
    local pid
    if pid=$(broker_pid); then
        log "stopping broker pid $pid"
        stop_pid "$pid"
    fi
    rm -f "$PID_FILE" "$BOOTSTRAP_FILE"
    return 0
}

cmd_kill() {
    local pid
    if pid=$(broker_pid); then
        log "killing broker pid $pid (SIGKILL; data and ports kept)"
        kill -KILL "$pid" 2>/dev/null || true
        local i
        for ((i = 0; i < 100; i++)); do
            kill -0 "$pid" 2>/dev/null || break
            sleep 0.1
        done
    fi
    rm -f "$PID_FILE" "$BOOTSTRAP_FILE"
    return 0
}

cmd_restart() {
    [[ -f "$RUN/server.properties" ]] || die "no broker to restart in $RUN (use start)"
    cmd_kill
    cmd_fetch
    command -v java >/dev/null || die "java not found"
    # The old log says "Kafka Server started": keep it apart, launch waits for a new one.
    [[ -f "$SERVER_LOG" ]] && mv -f "$SERVER_LOG" "$SERVER_LOG.previous"
    local port cport
    port=$(sed -n 's/^listeners=PLAINTEXT:\/\/127\.0\.0\.1:\([0-9]*\),.*/\1/p' "$RUN/server.properties")
    cport=$(sed -n 's/^controller\.quorum\.bootstrap\.servers=127\.0\.0\.1:\([0-9]*\)$/\1/p' "$RUN/server.properties")
    [[ -n "$port" && -n "$cport" ]] || die "no ports in $RUN/server.properties"
    launch "127.0.0.1:$port" "$cport"
}

cmd_status() {
    local bs
    bs=$(running_bootstrap) || { log "no broker running from $CACHE_DIR"; return 1; }
    echo "$bs"
}

cmd_logs() { tail -n "${1:-100}" "$SERVER_LOG"; }

# Serialize commands on one cache dir (two concurrent starts would wipe each other's run dir).
with_lock() {
    mkdir -p "$CACHE_DIR"
    if command -v flock >/dev/null; then
        exec 9>"$CACHE_DIR/.lock"
        flock -w 300 9 || die "could not lock $CACHE_DIR/.lock"
    fi
    "$@"
}

case "${1:-}" in
    fetch) with_lock cmd_fetch ;;
    start) with_lock cmd_start ;;
    stop) with_lock cmd_stop ;;
    kill) with_lock cmd_kill ;;
    restart) with_lock cmd_restart ;;
    status) cmd_status ;;
    logs) cmd_logs "${2:-100}" ;;
    *)
        echo "usage: $0 {fetch|start|stop|kill|restart|status|logs [N]}" >&2
        exit 2
        ;;
esac
