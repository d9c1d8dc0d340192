# Sourced by launch/train.sh, launch/mpirun.sh and launch/slurm.sbatch: the environment every
# rank needs, on every node. Needs ROOT (the repository) and VENV (the virtualenv) set first.
#
# Ranks on other nodes do not inherit the launcher's shell: ssh (pdsh) starts a login shell
# with its own PATH, and mpirun forwards only what `-x` names. So the launchers forward the
# variables listed in RANK_ENV_VARS:
#   train.sh (deepspeed runner): writes them to a .deepspeed_env-style file named by
#            DS_ENV_FILE; the runner turns each line into an `export` on every node
#   mpirun.sh: one `-x NAME` per variable
#   slurm.sbatch: srun passes the whole environment (--export=ALL, SLURM's default)
# What is forwarded: PATH and VIRTUAL_ENV (the venv first on PATH), PYTHONPATH (the
# repository), PYTHONUNBUFFERED, and every variable set here whose name starts with NCCL_,
# GLOO_, HF_, TRANSFORMERS_, TORCH_, VLLM_, OMP_, MKL_, UCX_ or DEEPSPEED_, plus the
# names in EXTRA_ENV (space separated). SOCKET_IFNAME=eth0 (or ib0, ...) sets both
# NCCL_SOCKET_IFNAME and GLOO_SOCKET_IFNAME: the interface the ranks talk over when a node
# has several.

if [ -f "$VENV/bin/activate" ]; then
  # shellcheck disable=SC1091
  source "$VENV/bin/activate"
fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
if [ -n "${SOCKET_IFNAME:-}" ]; then
  export NCCL_SOCKET_IFNAME="$SOCKET_IFNAME" GLOO_SOCKET_IFNAME="$SOCKET_IFNAME"
fi
RANK_ENV_VARS=(PATH PYTHONPATH PYTHONUNBUFFERED)
[ -n "${VIRTUAL_ENV:-}" ] && RANK_ENV_VARS+=(VIRTUAL_ENV)
while IFS='=' read -r name _; do
  case "$name" in
    NCCL_*|GLOO_*|HF_*|TRANSFORMERS_*|TORCH_*|VLLM_*|OMP_*|MKL_*|UCX_*|DEEPSPEED_*)
      RANK_ENV_VARS+=("$name") ;;
  esac
done < <(env)
for name in ${EXTRA_ENV:-}; do RANK_ENV_VARS+=("$name"); done

# After a failed job: a rank that died of SIGKILL (the deepspeed runner's "return code = -9",
# mpirun's "signal 9", srun's "Killed") was most likely ended by the kernel's out-of-memory
# killer; say so, and how to check. $1: the job's captured output.
explain_sigkill() {
  grep -aqE "return code = -9|signal 9|task [0-9]+: Killed|oom[-_]kill" "$1" || return 0
  cat >&2 <<'MSG'
megagrpo: a rank was killed by SIGKILL, most likely by the kernel's out-of-memory killer. Check:
  dmesg -T | grep -iE 'out of memory|killed process'     (on the rank's node; or journalctl -k)
  sacct -j <jobid> -o JobID,State,MaxRSS                 (under SLURM: OUT_OF_MEMORY, peak RSS)
and compare with the peak memory per rank that `megagrpo plan --config ...` prints, with the
switches it names (docs/parallelism.md, "Memory").
MSG
}

# Before any rank starts: refuse a layout whose planned peak memory does not fit a node
# (megagrpo plan --check-memory exits 3 and names the switches that would help). MEMORY_CHECK=0
# skips it; NODE_MEMORY_GIB sets a node's (CPU) or a GPU's memory when this node is not like
# the ranks' nodes. Arguments: those of `megagrpo plan` (--config, --hostfile or --world-size,
# overrides).
check_memory() {
  [ "${MEMORY_CHECK:-1}" = 0 ] && return 0
  "$PY" -m megagrpo.cli plan --check-memory ${NODE_MEMORY_GIB:+--node-memory-gib "$NODE_MEMORY_GIB"} "$@" > /dev/null
}
