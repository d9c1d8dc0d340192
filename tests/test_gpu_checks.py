"""The GPU checks (marker `gpu_check`; `bash bench/gpu_check.sh` runs them on a machine with an
NVIDIA GPU), run by the ordinary suite on CPU as well: the device is CUDA where torch sees one,
else the CPU, and only what exists on CUDA alone is skipped here, each skip naming why.

- packed log-probs: SDPA on packed rows against SDPA on padded rows (bf16), and on CUDA
  flash-attn varlen (one packed row) against SDPA padded;
- collectives: all_reduce, all_gather, broadcast through torchrun, NCCL on CUDA, gloo on CPU;
- one co-located vLLM engine (tests/helpers/vllm_engine_probe.py, bf16) around a train step: the
  same greedy completions after sleep/wake-up (sleep mode and its memory figures: CUDA only),
  and after the weight sync vLLM's log-probs equal the trainer model's, before it they do not.

The other checks live beside the CPU tests they extend, so that each launch happens once:
tests/test_train_configurations.py (bf16 ZeRO-3 through the DeepSpeed launcher against the
float32 run) and tests/test_rollout_sharded_generator.py (vLLM at tensor parallel 2 against
tp 1: per-rank weight bytes and log-probs).

Tolerances are per device (bf16 throughout, as GPUs train): the gap measured on this 2-core
CPU machine, with margin; on CUDA the kernels differ (vLLM's fused kernels against transformers'
SDPA), so its bounds are wider where nothing was measured yet (docs/benchmarks.md#gpu-check).
"""
import importlib.util
import json
import os
import random

import pytest
import torch
from conftest import PYTHON, run, torchrun
from transformers import AutoModelForCausalLM

from megagrpo.policy.batch import Completion, make_batch
from megagrpo.policy.logprobs import _one_row, completion_logprobs, install_logprob_head

pytestmark = pytest.mark.gpu_check
CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
GPUS = torch.cuda.device_count() if CUDA else 0


def cuda_only(what: str):
    """Skip where torch sees no CUDA device: `what` exists on CUDA alone."""
    return pytest.mark.skipif(not CUDA, reason=f"CUDA only: {what} (torch sees no CUDA device)")


# max |log p| difference, SDPA packed rows against SDPA padded rows, bf16. Measured: 1.7e-3 on
# CPU, 2.9e-6 on an H200 (2026-12-04); the same completions under other prompts move by 1.1
SDPA_PACKED_TOLERANCE = {"cpu": 1e-2, "cuda": 1e-3}[DEVICE]
# flash-attn varlen against SDPA padded, bf16 (CUDA only; not measured yet: flash-attn was absent)
FLASH_TOLERANCE = 2e-2
# max |log p| difference, vLLM after the weight sync against the trainer's model, bf16. Measured:
# 2.1e-3 on CPU (4.8e-7 in float32); before the sync the gap is 0.35. CUDA: vLLM's kernels
# (flash attention, fused RMSNorm) against transformers' SDPA, a wider bound until measured
SYNC_TOLERANCE = {"cpu": 1e-2, "cuda": 3e-2}[DEVICE]
CLEAR_GAP = 5  # "differs clearly": a gap of at least this many tolerances


def random_batch(vocab_size: int, prompt_seed: int = 0, rows: int = 16):
    """A RolloutBatch of random prompts and completions of skewed lengths (what packing is for);
    the completions do not depend on prompt_seed."""
    prompt_rng, completion_rng = random.Random(prompt_seed), random.Random(0)
    prompts, completions = [], []
    for _ in range(rows):
        prompts.append([prompt_rng.randrange(1, vocab_size) for _ in range(prompt_rng.randint(4, 40))])
        n = completion_rng.choice([1, 3, 8, 24, 64])
        completions.append(Completion([completion_rng.randrange(1, vocab_size) for _ in range(n)], [0.0] * n, False))
    return make_batch(prompts, completions, torch.zeros(rows), pad_id=0).to(DEVICE)


def load_model(path: str, attn: str):
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, attn_implementation=attn)
    install_logprob_head(model, chunk_size=1024)
    return model.to(DEVICE).eval()


@pytest.fixture(scope="module")
def padded(tiny):
    """(SDPA model, batch, completion mask, log-probs on padded rows) in bf16 on DEVICE."""
    model = load_model(tiny["model"], "sdpa")
    batch = random_batch(model.config.vocab_size)
    with torch.no_grad():
        logp, _ = completion_logprobs(model, batch, 1.0, packing=False, fused=False)
    return model, batch, batch.completion_mask.bool(), logp


def test_sdpa_packed_logprobs_equal_padded(padded, record_property):
    """The trainer's packed, fused pass equals the plain padded one, and the comparison would
    see a masking error: the same completions after other prompts move far more."""
    model, batch, mask, ref = padded
    with torch.no_grad():
        packed, _ = completion_logprobs(model, batch, 1.0, packing=True, fused=True)
        moved, _ = completion_logprobs(model, random_batch(model.config.vocab_size, prompt_seed=1), 1.0,
                                       packing=False, fused=False)
    gap, context = float((packed - ref).abs()[mask].max()), float((moved - ref).abs()[mask].max())
    record_property("max_abs_diff", gap)
    record_property("context_effect_max_abs_diff", context)
    record_property("tolerance", SDPA_PACKED_TOLERANCE)
    assert gap <= SDPA_PACKED_TOLERANCE, (gap, SDPA_PACKED_TOLERANCE)
    assert context > CLEAR_GAP * SDPA_PACKED_TOLERANCE, context


@cuda_only("flash-attn's kernels")
def test_flash_attn_packed_logprobs_equal_sdpa_padded(tiny, padded, record_property):
    """flash_attention_2 packs the whole batch into one varlen row; its log-probs and entropies
    equal SDPA's on padded rows within bf16's rounding."""
    pytest.importorskip("flash_attn", reason="missing: flash_attn")
    _, batch, mask, ref = padded
    flash = load_model(tiny["model"], "flash_attention_2")
    assert _one_row(flash)
    with torch.no_grad():
        logp, _ = completion_logprobs(flash, batch, 1.0, packing=True, fused=True)
    gap = float((logp - ref).abs()[mask].max())
    record_property("max_abs_diff", gap)
    record_property("tolerance", FLASH_TOLERANCE)
    assert gap <= FLASH_TOLERANCE, (gap, FLASH_TOLERANCE)


@pytest.mark.multirank
def test_collectives(tmp_path, record_property):
    """all_reduce, all_gather and broadcast return the right values on every rank: 2 ranks over
    gloo on CPU, over NCCL on 2 GPUs; one GPU gets a world of 1 (NCCL takes no 2 ranks on one
    device), which still runs NCCL's kernels."""
    if CUDA and not torch.distributed.is_nccl_available():
        pytest.skip("missing: NCCL (torch.distributed.is_nccl_available() is False)")
    world = min(GPUS, 2) if CUDA else 2
    run([*torchrun(world, "tests/helpers/collectives_probe.py"), "--out", str(tmp_path)], timeout=300)
    ranks = [json.load(open(tmp_path / f"collectives_rank{r}.json")) for r in range(world)]
    for r in ranks:
        assert (r["world"], r["backend"]) == (world, "nccl" if CUDA else "gloo"), r
        assert r["all_reduce"] == [world * (world + 1) / 2], r
        assert r["all_gather"] == [[float(k)] * 4 for k in range(world)], r
        assert r["broadcast"] == [42.0] * 4, r
        assert r["big_all_reduce"] == [float(world) ** 2], r  # ones, summed twice (warm-up, timed)
    seconds = ranks[0]["big_all_reduce_s"]
    record_property("world", world)
    record_property("backend", ranks[0]["backend"])
    if CUDA:
        record_property("nccl_version", ranks[0]["nccl_version"])
    record_property("all_reduce_mib", ranks[0]["big_bytes"] / 2**20)
    record_property("all_reduce_s", seconds)
    if world > 1:  # a world of 1 moves no bytes between ranks
        record_property("busbw_gb_per_s", ranks[0]["big_bytes"] / 1e9 / seconds * 2 * (world - 1) / world)


@pytest.fixture(scope="module")
def engine(tiny, tmp_path_factory):
    """The probe's results: one vLLM engine (bf16) in a process of its own, around a train step
    and a weight sync (tests/helpers/vllm_engine_probe.py)."""
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("missing: vllm")
    out = tmp_path_factory.mktemp("vllm_engine") / "probe.json"
    run([PYTHON, "tests/helpers/vllm_engine_probe.py", "--model", tiny["model"], "--data",
         os.path.join(tiny["data"], "train.jsonl"), "--dtype", "bfloat16", "--out", str(out)], timeout=400)
    result = json.load(open(out))
    assert result["device"] == DEVICE, result["device"]  # a CPU build of vLLM on a GPU machine
    return result


def test_vllm_greedy_same_after_train_step(engine, record_property):
    """A training step in the engine's process (on CUDA with the engine asleep, level 1, and
    woken as the trainer wakes it) leaves the engine's greedy completions as they were."""
    first, again = engine["greedy_first"], engine["greedy_after_wake"]
    assert len(first) == 8 and all(first), first
    assert again == first
    assert engine["awake_after"]
    # the engine did move with the sync that followed: the comparison can fail
    assert engine["greedy_after_sync"] != first
    record_property("startup_s", engine["startup_s"])


@cuda_only("vLLM's sleep mode (CuMemAllocator) and its GPU memory figures; on CPU VLLMGenerator.sleep() is a no-op")
def test_vllm_sleep_frees_gpu_memory(engine, record_property):
    """sleep(level=1) frees GPU memory, the weights' wake-up takes some back and the KV cache's
    the rest; VLLMGenerator tracks what is asleep."""
    assert engine["can_sleep"] and engine["asleep"] == ["kv_cache", "weights"], engine
    awake, asleep = engine["free_gib_awake"], engine["free_gib_asleep"]
    weights, woken = engine["free_gib_weights_woken"], engine["free_gib_woken"]
    for key in ("free_gib_awake", "free_gib_asleep", "free_gib_weights_woken", "free_gib_woken", "train_peak_gib"):
        record_property(key, engine[key])
    record_property("freed_by_sleep_gib", asleep - awake)
    assert asleep - awake > 0.1, (awake, asleep)
    assert asleep > weights > woken, (asleep, weights, woken)


def test_weight_sync_generator_logprobs_equal_trainer(engine, record_property):
    """After sync_weights(named_full_tensors(model), generator) the engine's log-probs of a fixed
    sequence equal the trainer model's within bf16's bound; before it (the trainer had stepped)
    they differ clearly."""
    trainer, before, after = engine["trainer"], engine["engine_before"], engine["engine_after"]
    assert len(trainer) == len(before) == len(after) == 16
    gap_before = max(abs(a - b) for a, b in zip(before, trainer))
    gap_after = max(abs(a - b) for a, b in zip(after, trainer))
    record_property("gap_before_sync", gap_before)
    record_property("gap_after_sync", gap_after)
    record_property("tolerance", SYNC_TOLERANCE)
    if CUDA:
        gb = engine["sync_bytes"] / 1e9
        record_property("sync_gb_per_s", gb / engine["sync_s"])
        record_property("copy_gb_per_s", gb / engine["copy_s"])
        record_property("sync_to_copy_ratio", engine["sync_s"] / engine["copy_s"])
    assert gap_after <= SYNC_TOLERANCE, (gap_after, SYNC_TOLERANCE)
    assert gap_before > CLEAR_GAP * SYNC_TOLERANCE, gap_before
