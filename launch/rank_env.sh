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
