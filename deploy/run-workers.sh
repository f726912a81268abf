#!/usr/bin/env bash
# Start one eggroll-worker per GPU on this host and supervise them.
#
#   deploy/run-workers.sh HOST[:PORT] [worker flags...]
#
# Each worker sees exactly one GPU (its own CUDA_VISIBLE_DEVICES), is named
# <name>-gpu<index>, and has its output lines prefixed with "[gpu<index>] ".
# SIGINT/SIGTERM stop every worker cleanly; a worker that fails as every worker would
# (exit status 2, 1, ...) stops the rest (see collect() for the whole table).
set -euo pipefail

readonly PROG=${0##*/}
# Tests and unusual installs point this at another executable.
readonly WORKER_BIN=${EGGROLL_WORKER_BIN:-eggroll-worker}
# Seconds a worker gets to stop after SIGTERM before it is killed: a supervisor that
# waits forever on one stuck worker would hang the whole host's shutdown.
readonly STOP_TIMEOUT_S=${EGGROLL_STOP_TIMEOUT_S:-30}

usage() {
    cat <<EOF
Usage: $PROG HOST[:PORT] [--dry-run] [worker flags...]

Start one eggroll-worker per GPU of this host, all serving the coordinator at HOST[:PORT].

GPUs come from CUDA_VISIBLE_DEVICES when it is set (comma-separated indices or UUIDs;
set but empty means none), else from 'nvidia-smi -L'. Worker i runs with
CUDA_VISIBLE_DEVICES=<its GPU> and --name <name>-gpu<i>, where <name> is the --name
given here, else \$EGGROLL_NAME, else the short host name. All other flags go to every
worker unchanged (see 'eggroll-worker --help'); so do EGGROLL_* environment variables.
Every worker gets EGGROLL_WORKERS_PER_HOST=<number of workers> (unless it is set), so that
a CPU (NumPy) backend uses its share of the host's cores, not all of them.

Options read here:
  --dry-run    print the command for each GPU, run nothing
  --name NAME  base of the worker names (NAME-gpu0, NAME-gpu1, ...)
  -h, --help   show this help

Output: every worker line is prefixed with [gpu<i>], stdout and stderr kept apart.
SIGINT or SIGTERM: every worker gets SIGTERM (a clean stop); another signal later on,
or EGGROLL_STOP_TIMEOUT_S seconds (default 30) without every worker gone, kills the rest.
Exit status: that of the worker whose end stopped the others, else the first non-zero
one, else 0. A worker that exits with 2 (a bad flag, a config or data the run refuses)
or 1 (bad data) stops the others; one that exits with 0 (the run is complete), with 3
(it computes differently from the run: a faulty GPU?) or is killed by a signal (128+N;
the OOM killer) ends alone. A worker killed by the SIGTERM of a stop counts as stopped (0).
No GPU: exit 1; on a CPU host run 'eggroll-worker HOST[:PORT] --backend numpy' instead.
Environment: EGGROLL_WORKER_BIN, the worker command (default: eggroll-worker on PATH).
EOF
}

say() {
    printf '%s: %s\n' "$PROG" "$*" >&2
}

die() {  # die STATUS MESSAGE...
    local status=$1
    shift
    say "$@"
    exit "$status"
}

no_gpu() {
    die 1 "no GPU found ($1); on a CPU host run 'eggroll-worker HOST[:PORT] --backend numpy' directly"
}

# ---------------------------------------------------------------- arguments

DRY_RUN=0
NAME_BASE=${EGGROLL_NAME:-}
WORKER_ARGS=()

parse_args() {
    local passthrough=0
    while (($# > 0)); do
        if ((passthrough)); then
            WORKER_ARGS+=("$1")
        else
            case $1 in
                --)
                    passthrough=1
                    WORKER_ARGS+=("$1")
                    ;;
                --dry-run) DRY_RUN=1 ;;
                -h | --help)
                    usage
                    exit 0
                    ;;
                --name)
                    (($# >= 2)) || die 2 "--name needs a value"
                    NAME_BASE=$2
                    shift
                    ;;
                --name=*) NAME_BASE=${1#--name=} ;;
                *) WORKER_ARGS+=("$1") ;;
            esac
        fi
        shift
    done
    if ((${#WORKER_ARGS[@]} == 0)) && [[ -z ${EGGROLL_COORDINATOR:-} ]]; then
        die 2 "usage: $PROG HOST[:PORT] [--dry-run] [worker flags...] (or set EGGROLL_COORDINATOR; --help for more)"
    fi
    if [[ -z $NAME_BASE ]]; then
        NAME_BASE=$(uname -n)
        NAME_BASE=${NAME_BASE%%.*}  # the short host name, like hostname -s
    fi
}

# ---------------------------------------------------------------- GPUs

GPU_IDS=()     # what each worker's CUDA_VISIBLE_DEVICES is set to
GPU_LABELS=()  # the <index> in its name and output prefix
GPU_SOURCE=""

gpus_from_visible_devices() {
    local -a entries=()
    local entry all_numeric=1
    IFS=',' read -r -a entries <<<"$CUDA_VISIBLE_DEVICES"
    for entry in "${entries[@]}"; do
        entry=${entry//[[:space:]]/}
        [[ -n $entry ]] || continue
        GPU_IDS+=("$entry")
        [[ $entry =~ ^[0-9]+$ ]] || all_numeric=0
    done
    ((${#GPU_IDS[@]} > 0)) || no_gpu "CUDA_VISIBLE_DEVICES is set and empty"
    # Indices label themselves; UUIDs (GPU-..., MIG-...) are labelled by their position,
    # which is also the index CUDA gives them inside this list.
    local i
    for i in "${!GPU_IDS[@]}"; do
        if ((all_numeric)); then
            GPU_LABELS+=("${GPU_IDS[i]}")
        else
            GPU_LABELS+=("$i")
        fi
    done
    GPU_SOURCE="CUDA_VISIBLE_DEVICES"
}

gpus_from_nvidia_smi() {
    local listing line
    command -v nvidia-smi >/dev/null 2>&1 || no_gpu "CUDA_VISIBLE_DEVICES is unset and nvidia-smi is not on PATH"
    if ! listing=$(nvidia-smi -L 2>&1); then
        no_gpu "'nvidia-smi -L' failed: ${listing%%$'\n'*}"
    fi
    # "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-...)"; indented MIG lines are not GPUs here.
    while IFS= read -r line; do
        if [[ $line =~ ^GPU\ ([0-9]+): ]]; then
            GPU_IDS+=("${BASH_REMATCH[1]}")
            GPU_LABELS+=("${BASH_REMATCH[1]}")
        fi
    done <<<"$listing"
    ((${#GPU_IDS[@]} > 0)) || no_gpu "'nvidia-smi -L' lists none"
    GPU_SOURCE="nvidia-smi -L"
}

find_gpus() {
    if [[ -n ${CUDA_VISIBLE_DEVICES+set} ]]; then
        gpus_from_visible_devices
    else
        gpus_from_nvidia_smi
    fi
    # Two workers on one GPU would share a name in the coordinator's logs and metrics.
    local -A seen=()
    local label
    for label in "${GPU_LABELS[@]}"; do
        [[ -z ${seen[$label]:-} ]] || die 2 "$GPU_SOURCE lists GPU $label twice"
        seen[$label]=1
    done
}

# ---------------------------------------------------------------- workers

WORKER_PIDS=()
PREFIXER_PIDS=()
COLLECTED=()     # 1 once a worker's exit status has been collected
STOPPING=""      # why the workers are being stopped; empty while they run
STOP_TIMER_PID=""  # a sleep that ends when the stopping workers have had their time
STOP_STARTED_MS=0  # when the stop began
EXIT_STATUS=0    # the first non-zero status a worker's end gave
CAUSE_STATUS=""  # the status of the worker whose end stopped the others
FIFO_DIR=""

# The command for GPU number $1 (an index into GPU_IDS), into the array CMD.
worker_command() {
    CMD=("$WORKER_BIN" --name "$NAME_BASE-gpu${GPU_LABELS[$1]}" "${WORKER_ARGS[@]}")
}

# Workers sharing this host's cores (a CPU backend sizes its thread pool by it).
workers_per_host() {
    printf '%s' "${EGGROLL_WORKERS_PER_HOST:-${#GPU_IDS[@]}}"
}

print_commands() {
    local i
    for i in "${!GPU_IDS[@]}"; do
        worker_command "$i"
        printf 'CUDA_VISIBLE_DEVICES=%q EGGROLL_WORKERS_PER_HOST=%q' "${GPU_IDS[i]}" "$(workers_per_host)"
        printf ' %q' "${CMD[@]}"
        printf '\n'
    done
}

# Copy standard input to standard output with PREFIX before every line. A bash loop
# rather than awk or sed: mawk (the default awk on Debian and Ubuntu) reads its input in
# blocks, which would hold worker lines back; read and printf pass on each line at once.
prefix_lines() {  # prefix_lines PREFIX
    local line
    while IFS= read -r line || [[ -n $line ]]; do
        printf '%s%s\n' "$1" "$line"
    done
}

# INT and TERM are ignored: a prefixer must outlive its worker to pass on the worker's
# last lines; it ends at end of input, once the worker has exited.
start_prefixer() {  # start_prefixer PREFIX FIFO, with stdout already redirected
    (
        trap '' INT TERM
        prefix_lines "$1" <"$2"
    ) &
    PREFIXER_PIDS+=("$!")
}

start_worker() {  # start_worker I
    local i=$1 label=${GPU_LABELS[$1]}
    local out=$FIFO_DIR/gpu$i.out err=$FIFO_DIR/gpu$i.err
    # Named pipes rather than "worker | prefixer": $! must be the worker itself, so that
    # signals and exit statuses are the worker's, and both ends stay children of ours.
    mkfifo "$out" "$err"
    start_prefixer "[gpu$label] " "$out"
    start_prefixer "[gpu$label] " "$err" >&2
    worker_command "$i"
    # Opening a named pipe waits for its other end. A SIGTERM then (a stop at start-up)
    # must not end the worker before both of its ends are open, or a prefixer would wait
    # for ever on a pipe nobody opens: it waits until they are, then ends it.
    (
        trap 'stopped=1' TERM
        exec >"$out" 2>"$err"
        trap - TERM
        [[ -z ${stopped:-} ]] || exit $((128 + 15))
        CUDA_VISIBLE_DEVICES=${GPU_IDS[i]} EGGROLL_WORKERS_PER_HOST=$(workers_per_host) \
            exec "${CMD[@]}"
    ) &
    WORKER_PIDS[i]=$!
}

signal_workers() {  # signal_workers SIGNAL
    local i
    for i in "${!WORKER_PIDS[@]}"; do
        if [[ -z ${COLLECTED[i]:-} ]]; then
            kill -s "$1" "${WORKER_PIDS[i]}" 2>/dev/null || true
        fi
    done
}

# Milliseconds on the shell's clock, into NOW_MS (no subshell: this runs in traps too).
clock_ms() {
    if [[ -n ${EPOCHREALTIME:-} ]]; then  # bash 5: microseconds; "." or "," by locale
        local us=${EPOCHREALTIME/[.,]/}
        NOW_MS=$((10#$us / 1000))
    else
        NOW_MS=$((SECONDS * 1000))
    fi
}

stop_workers() {  # stop_workers REASON
    STOPPING=$1
    clock_ms
    STOP_STARTED_MS=$NOW_MS
    signal_workers TERM
    # A child of ours, so that its end wakes up the wait in supervise(); it ignores INT and
    # TERM so that a signal to the whole process group does not end it early.
    (
        trap '' INT TERM
        exec sleep "$STOP_TIMEOUT_S"
    ) &
    STOP_TIMER_PID=$!
}

# After the stop timeout, kill the workers still running.
check_stop_timer() {
    if [[ -z $STOP_TIMER_PID ]] || kill -0 "$STOP_TIMER_PID" 2>/dev/null; then
        return 0
    fi
    wait "$STOP_TIMER_PID" 2>/dev/null || true
    STOP_TIMER_PID=""
    local i
    for i in "${!WORKER_PIDS[@]}"; do
        if [[ -z ${COLLECTED[i]:-} ]]; then
            say "worker for GPU ${GPU_LABELS[i]} still running ${STOP_TIMEOUT_S} s after SIGTERM: killing it"
            kill -s KILL "${WORKER_PIDS[i]}" 2>/dev/null || true
        fi
    done
}

# shellcheck disable=SC2317  # called from a trap
on_signal() {  # on_signal NAME
    if [[ -n $STOPPING ]]; then
        # The same signal often comes twice at once, to this script and to its process
        # group (timeout(1), kill -- -PGID): only a later one means "kill them now".
        clock_ms
        if ((NOW_MS - STOP_STARTED_MS >= 1500)); then
            say "SIG$1 while stopping: killing the workers"
            signal_workers KILL
        fi
    else
        say "SIG$1: stopping the workers (SIGTERM to each)"
        # TERM, not the signal received: bash starts background jobs with SIGINT ignored,
        # so a worker still setting up would not notice a forwarded SIGINT.
        stop_workers "SIG$1"
    fi
}

# Record the exit status of worker I and act on it, by the table of deploy/README.md
# ("When a worker exits"), whose source of truth is exit_policy in worker/exits.py (used by
# eggroll-local and eggroll-ray): keep the two alike. A failure every worker would share
# (2, 1, any other) stops the others; 0, 3 and a death by signal N (128+N) end one alone.
collect() {  # collect I STATUS
    local i=$1 status=$2 code=$2 why stop_all=0
    COLLECTED[i]=1
    if ((status == 0)); then
        why="exited with status 0"
    elif ((status > 128 && status <= 128 + 64)); then
        why="was killed by SIG$(kill -l "$status" 2>/dev/null || echo $((status - 128)))"
        if [[ -n $STOPPING ]] && ((status == 128 + 15)); then
            code=0  # our own SIGTERM, before the worker's handlers were in place
        fi
    elif ((status == 3)); then  # told DIVERGED again and again: maybe this GPU alone
        why="computes differently from the run (status 3: a faulty GPU?)"
    else
        why="failed with status $status"
        [[ -n $STOPPING ]] || stop_all=1
    fi
    if ((code != 0 && EXIT_STATUS == 0)); then
        EXIT_STATUS=$code
    fi
    local what="worker for GPU ${GPU_LABELS[i]} (CUDA_VISIBLE_DEVICES=${GPU_IDS[i]}, pid ${WORKER_PIDS[i]})"
    if [[ -n $STOPPING ]]; then
        if ((status != 0)); then
            say "$what exited with status $status"
        fi
    elif ((stop_all)); then
        CAUSE_STATUS=$code
        say "$what $why; stopping the other workers"
        stop_workers "GPU ${GPU_LABELS[i]} failed"
    else
        say "$what $why; the other workers keep running"
    fi
}

# Wait until every worker has exited, collecting each status as it comes.
supervise() {
    local i pid status remaining=${#WORKER_PIDS[@]}
    while ((remaining > 0)); do
        # Returns when any child exits, or at once when a trapped signal arrives (the
        # trap runs right after); the scan below then finds which workers are gone.
        wait -n 2>/dev/null || true
        for i in "${!WORKER_PIDS[@]}"; do
            [[ -z ${COLLECTED[i]:-} ]] || continue
            pid=${WORKER_PIDS[i]}
            if kill -0 "$pid" 2>/dev/null; then
                continue  # still running
            fi
            # bash keeps the status of a child it has reaped until this wait asks for it.
            status=0
            wait "$pid" 2>/dev/null || status=$?
            collect "$i" "$status"
            remaining=$((remaining - 1))
        done
        if ((remaining > 0)); then
            check_stop_timer
        fi
    done
    # Let the prefixers pass on the workers' last lines before this script exits.
    for pid in "${PREFIXER_PIDS[@]}"; do
        while kill -0 "$pid" 2>/dev/null; do
            wait "$pid" 2>/dev/null || true
        done
    done
}

user_gave_log_format() {
    local arg
    for arg in "${WORKER_ARGS[@]}"; do
        if [[ $arg == --log-format || $arg == --log-format=* ]]; then
            return 0
        fi
    done
    return 1
}

# shellcheck disable=SC2317  # called from a trap
cleanup() {
    # Only reached with workers running if this script itself failed: leave no orphans.
    if [[ -z $STOPPING ]]; then
        signal_workers TERM
    fi
    if [[ -n $STOP_TIMER_PID ]]; then
        kill -s KILL "$STOP_TIMER_PID" 2>/dev/null || true
        wait "$STOP_TIMER_PID" 2>/dev/null || true  # reaped here, bash reports no "Killed"
    fi
    if [[ -n $FIFO_DIR ]]; then
        rm -rf -- "$FIFO_DIR"
    fi
}

main() {
    parse_args "$@"
    [[ $STOP_TIMEOUT_S =~ ^[0-9]+([.][0-9]+)?$ ]] ||
        die 2 "EGGROLL_STOP_TIMEOUT_S must be a number of seconds, not '$STOP_TIMEOUT_S'"
    find_gpus
    if ((DRY_RUN)); then
        print_commands
        exit 0
    fi
    command -v "$WORKER_BIN" >/dev/null 2>&1 ||
        die 1 "$WORKER_BIN: command not found; install eggroll-distributed or set EGGROLL_WORKER_BIN"

    # Workers write to named pipes, so their --log-format auto would always pick JSON;
    # keep the text a terminal would have given them unless the user chose.
    if [[ -t 2 && -z ${EGGROLL_LOG_FORMAT:-} ]] && ! user_gave_log_format; then
        export EGGROLL_LOG_FORMAT=text
    fi

    trap cleanup EXIT
    FIFO_DIR=$(mktemp -d "${TMPDIR:-/tmp}/run-workers.XXXXXX")
    trap 'on_signal INT' INT
    trap 'on_signal TERM' TERM

    say "starting ${#GPU_IDS[@]} worker(s) for GPUs ${GPU_LABELS[*]} (from $GPU_SOURCE)"
    local i
    for i in "${!GPU_IDS[@]}"; do
        [[ -z $STOPPING ]] || break  # a signal during start-up: start no more
        start_worker "$i"
    done
    supervise
    EXIT_STATUS=${CAUSE_STATUS:-$EXIT_STATUS}
    if [[ -n $STOPPING ]]; then
        say "all workers stopped ($STOPPING); exit status $EXIT_STATUS"
    fi
    exit "$EXIT_STATUS"
}

main "$@"
