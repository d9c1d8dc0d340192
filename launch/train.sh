#!/usr/bin/env bash
# Multi-node GRPO through the DeepSpeed launcher: `deepspeed --hostfile` over pdsh (ssh to every
# host; the default) or OpenMPI (LAUNCHER=openmpi: the runner calls mpirun).
#
#   HOSTFILE=hostfiles/4x8 CONFIG=configs/qwen2.5_32b_4x8.yaml bash launch/train.sh [key.sub=value ...]
#   DRY_RUN=1 HOSTFILE=... bash launch/train.sh ...   # world size, layout, the command; start nothing
#
# Every setting below can be set in the environment instead of edited here. Before any rank
# starts, the hostfile is parsed (a malformed line stops with file:line), every host is probed
# with passwordless ssh (an unreachable host stops with its name), the config is validated, and
# the planned peak memory per rank is checked against this node's (MEMORY_CHECK=0 skips it).
# Needs: passwordless ssh from this node to every host (also to itself when it is listed), pdsh
# (or OpenMPI) on this node, this repository and its venv at the same path on every node.
# Paths (CONFIG, data, model, output_dir) are relative to the repository root.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

HOSTFILE="${HOSTFILE:-hostfiles/single_node}"  # `host slots=N` lines, one per node (see hostfiles/)
NUM_NODES="${NUM_NODES:-}"            # use only the first N hosts of the hostfile (default: all)
GPUS_PER_NODE="${GPUS_PER_NODE:-}"    # ranks per node (default: each host's slots)
MASTER_ADDR="${MASTER_ADDR:-}"        # rank 0's address (default: first host's `hostname -I`)
MASTER_PORT="${MASTER_PORT:-29500}"   # rendezvous port on MASTER_ADDR
CONFIG="${CONFIG:-configs/tiny_arith.yaml}"
LAUNCHER="${LAUNCHER:-pdsh}"          # pdsh | openmpi
LAUNCHER_ARGS="${LAUNCHER_ARGS:-}"    # extra pdsh/mpirun arguments, e.g. "--mca btl_tcp_if_include ib0"
SSH_PORT="${SSH_PORT:-}"              # sshd port on the hosts when not 22
TIMEOUT_MINUTES="${TIMEOUT_MINUTES:-30}"  # a collective waiting longer than this fails the job
SOCKET_IFNAME="${SOCKET_IFNAME:-}"    # NCCL_/GLOO_SOCKET_IFNAME, e.g. eth0, ib0
VENV="${VENV:-$ROOT/.venv}"
DRY_RUN="${DRY_RUN:-0}"
OVERRIDES=("$@")                      # key.sub=value settings for the config
if [ "${1:-}" = "--dry-run" ]; then DRY_RUN=1; OVERRIDES=("${@:2}"); fi

source "$ROOT/launch/rank_env.sh"
PY="$VENV/bin/python"; [ -x "$PY" ] || PY=python3

SELECT=()
[ -n "$NUM_NODES" ] && SELECT+=(--num-nodes "$NUM_NODES")
[ -n "$GPUS_PER_NODE" ] && SELECT+=(--slots-per-node "$GPUS_PER_NODE")

CMD=(deepspeed --hostfile "$HOSTFILE" --launcher "$LAUNCHER" --master_port "$MASTER_PORT")
NODES="$("$PY" -m megagrpo.hostfile check "$HOSTFILE" --no-probe --count "${SELECT[@]}")"
if [ "$NODES" = 1 ]; then
  # one node: the runner starts the ranks here, without ssh (it would still probe the host)
  CMD+=(--no_ssh_check --master_addr "${MASTER_ADDR:-127.0.0.1}")
elif [ -n "$MASTER_ADDR" ]; then
  CMD+=(--master_addr "$MASTER_ADDR")
fi
[ -n "$SSH_PORT" ] && CMD+=(--ssh_port "$SSH_PORT")
[ -n "$NUM_NODES" ] && CMD+=(--num_nodes "$NUM_NODES")
[ -n "$GPUS_PER_NODE" ] && CMD+=(--num_gpus "$GPUS_PER_NODE")
if [ "$LAUNCHER" = openmpi ] && [ "$(id -u)" -eq 0 ]; then
  LAUNCHER_ARGS="--allow-run-as-root $LAUNCHER_ARGS"
fi
[ -n "${LAUNCHER_ARGS// /}" ] && CMD+=(--launcher_args "$LAUNCHER_ARGS")
CMD+=(--module megagrpo.train --timeout-minutes "$TIMEOUT_MINUTES" --config "$CONFIG" "${OVERRIDES[@]}")

if [ "$DRY_RUN" = 1 ]; then
  "$PY" -m megagrpo.cli plan --config "$CONFIG" --hostfile "$HOSTFILE" "${SELECT[@]}" "${OVERRIDES[@]}"
  echo "rank environment: ${RANK_ENV_VARS[*]}"
  printf 'command:'; printf ' %q' "${CMD[@]}"; echo
  exit 0
fi

# checks that fail fast, before any rank starts
"$PY" -m megagrpo.hostfile check "$HOSTFILE" "${SELECT[@]}" ${SSH_PORT:+--ssh-port "$SSH_PORT"}
"$PY" -m megagrpo.cli validate --config "$CONFIG" "${OVERRIDES[@]}" > /dev/null
check_memory --config "$CONFIG" --hostfile "$HOSTFILE" "${SELECT[@]}" "${OVERRIDES[@]}"

# the environment of the ranks on every node: the runner reads this file (DS_ENV_FILE) and
# exports each line on every host before starting deepspeed.launcher.launch there
export DS_ENV_FILE
DS_ENV_FILE="$(mktemp "${TMPDIR:-/tmp}/megagrpo-deepspeed-env.XXXXXX")"
for name in "${RANK_ENV_VARS[@]}"; do
  [ -n "${!name+x}" ] && printf '%s=%s\n' "$name" "${!name}" >> "$DS_ENV_FILE"
done
[ "$LAUNCHER" = openmpi ] && echo "MASTER_PORT=$MASTER_PORT" >> "$DS_ENV_FILE"

# forward SIGINT/SIGTERM to the runner (it stops the ranks on every node); keep a copy of
# the output to summarise a failure at the end
LOG="$(mktemp "${TMPDIR:-/tmp}/megagrpo-launch.XXXXXX")"
child=""
stop() { [ -n "$child" ] && kill -TERM "$child" 2>/dev/null; }
trap stop INT TERM
trap 'rm -f "$DS_ENV_FILE" "$LOG"' EXIT
echo "megagrpo: launching:$(printf ' %q' "${CMD[@]}")"
set +e
"${CMD[@]}" > >(tee -a "$LOG") 2>&1 &
child=$!
wait "$child"; rc=$?
while kill -0 "$child" 2>/dev/null; do wait "$child"; rc=$?; done  # a trapped signal ends wait early
wait  # tee
set -e
if [ "$rc" -ne 0 ]; then
  # ranks that stopped because a peer vanished report errors first; the rank that died
  # (negative return code: killed by that signal, e.g. -9 for SIGKILL or the OOM killer) last
  {
    echo "megagrpo: the job failed (launcher exit code $rc). Rank errors and exits:"
    grep -aE "megagrpo: error on rank|exits with return code = [0-9]" "$LOG" | tail -n 20
    grep -aE "exits with return code = -" "$LOG" | tail -n 20
  } | sed -E "s/\['.*'\] exits with/rank exits with/" | cut -c1-400 >&2
  explain_sigkill "$LOG"
fi
exit "$rc"
