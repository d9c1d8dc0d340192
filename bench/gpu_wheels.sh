#!/usr/bin/env bash
# The wheels bench/gpu_check.sh needs on a GPU machine whose image has a CUDA torch but not the
# rest of megagrpo's stack, built or downloaded here into .whl/ (gpu_check.sh installs them with
# pip --no-index into its run folder). Versions are the ones in this checkout's .venv.
#
#   bash bench/gpu_wheels.sh [PYTHON_VERSION]     # default 3.12, the device image's python3
#
# The image lent to this project (docs/benchmarks.md#gpu-check) lacks DeepSpeed (built here
# without ops: pure Python, its ops JIT-compile on the GPU machine), datasets, pydantic and their
# pure-Python needs, and pytest-timeout (gpu_check.sh's limit per test). vLLM cannot be carried: its CUDA wheel is 311 MiB (a device call carries
# 64 MiB) and pins torch 2.13, where that image has 2.11.
set -euo pipefail
cd "$(dirname "$0")/.."
PYV="${1:-3.12}"
PY=.venv/bin/python
mkdir -p .whl
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || { mkdir -p .git/info; echo /.whl/ >> .git/info/exclude; }
version() { "$PY" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$1"; }
PURE=(datasets dill multiprocess hjson pydantic annotated-types typing-inspection pytest-timeout)
SPECS=()
for dist in "${PURE[@]}"; do SPECS+=("$dist==$(version "$dist")"); done
SPECS+=("pydantic-core==$(version pydantic-core)")
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$PYV" --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .whl "${SPECS[@]}"
DS_BUILD_OPS=0 "$PY" -m pip wheel -q --no-deps --no-build-isolation -w .whl "deepspeed==$(version deepspeed)"
ls -1 .whl
echo "carry .whl in the device call (carry: [\".whl\"]), then: bash bench/gpu_check.sh"
