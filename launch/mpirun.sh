#!/usr/bin/env bash
# GRPO under OpenMPI's mpirun. Each rank finds its rank, world size, local rank and rank 0's
# address through mpi4py (DeepSpeed's MPI discovery in deepspeed.init_distributed), then
# builds the usual torch.distributed group on MASTER_PORT.
#
#   HOSTFILE=hostfiles/4x8 CONFIG=configs/qwen2.5_32b_4x8.yaml bash launch/mpirun.sh [key.sub=value ...]
#   DRY_RUN=1 HOSTFILE=... bash launch/mpirun.sh ...   # world size, layout, the command; start nothing
#
# Needs OpenMPI (`mpirun`) on every node, mpi4py in the venv (`pip install -e ".[mpi]"`),
# passwordless ssh to the other hosts (OpenMPI starts its daemons over ssh), and this
# repository and its venv at the same path everywhere. OpenMPI treats `localhost` and
# `127.0.0.1` as the same node: list a machine once, with all its slots.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

HOSTFILE="${HOSTFILE:-hostfiles/single_node}"  # `host slots=N` lines (OpenMPI reads the same format)
NP="${NP:-}"                          # ranks (default: the hostfile's slots added up)
MASTER_PORT="${MASTER_PORT:-29500}"   # rendezvous port on rank 0's node
CONFIG="${CONFIG:-configs/tiny_arith.yaml}"
MPIRUN_ARGS="${MPIRUN_ARGS:-}"        # extra mpirun arguments, e.g. "--mca btl_tcp_if_include ib0"
TIMEOUT_MINUTES="${TIMEOUT_MINUTES:-30}"
SOCKET_IFNAME="${SOCKET_IFNAME:-}"    # NCCL_/GLOO_SOCKET_IFNAME, e.g. eth0, ib0
VENV="${VENV:-$ROOT/.venv}"
DRY_RUN="${DRY_RUN:-0}"
OVERRIDES=("$@")
if [ "${1:-}" = "--dry-run" ]; then DRY_RUN=1; OVERRIDES=("${@:2}"); fi

source "$ROOT/launch/rank_env.sh"
PY="$VENV/bin/python"; [ -x "$PY" ] || PY=python3
export MASTER_PORT
RANK_ENV_VARS+=(MASTER_PORT)
if [ -z "$NP" ]; then
  NP="$(awk '{sub(/#.*/, "")} match($0, /slots=[0-9]+/) {n += substr($0, RSTART + 6, RLENGTH - 6)} END {print n + 0}' "$HOSTFILE")"
fi

# --map-by slot fills each host's slots in order (ranks 0..7 on the first host, as deepspeed
# does); --bind-to none leaves each rank free to use every core its threads want
CMD=(mpirun -np "$NP" --hostfile "$HOSTFILE" --map-by slot --bind-to none)
[ "$(id -u)" -eq 0 ] && CMD+=(--allow-run-as-root)
for name in "${RANK_ENV_VARS[@]}"; do [ -n "${!name+x}" ] && CMD+=(-x "$name"); done
# shellcheck disable=SC2206
[ -n "$MPIRUN_ARGS" ] && CMD+=($MPIRUN_ARGS)
CMD+=("$PY" -u -m megagrpo.train --timeout-minutes "$TIMEOUT_MINUTES" --config "$CONFIG" "${OVERRIDES[@]}")

if [ "$DRY_RUN" = 1 ]; then
  "$PY" -m megagrpo.cli plan --config "$CONFIG" --hostfile "$HOSTFILE" "${OVERRIDES[@]}"
  printf 'command:'; printf ' %q' "${CMD[@]}"; echo
  exit 0
fi

"$PY" -m megagrpo.hostfile check "$HOSTFILE"
"$PY" -m megagrpo.cli validate --config "$CONFIG" "${OVERRIDES[@]}" > /dev/null
check_memory --config "$CONFIG" --hostfile "$HOSTFILE" "${OVERRIDES[@]}"
if ! "$PY" -c "import mpi4py" 2>/dev/null; then
  echo "megagrpo: mpi4py is missing in $VENV: pip install -e '.[mpi]' (needs OpenMPI's libmpi)" >&2
  exit 2
fi
echo "megagrpo: launching:$(printf ' %q' "${CMD[@]}")"
# mpirun stops every rank when one exits non-zero, and exits non-zero itself; a copy of the
# output says, at the end, when a rank was killed (SIGKILL: likely out of memory)
LOG="$(mktemp "${TMPDIR:-/tmp}/megagrpo-launch.XXXXXX")"
trap 'rm -f "$LOG"' EXIT
set +e
"${CMD[@]}" > >(tee -a "$LOG") 2>&1
rc=$?
wait  # tee
set -e
[ "$rc" -ne 0 ] && explain_sigkill "$LOG"
exit "$rc"
