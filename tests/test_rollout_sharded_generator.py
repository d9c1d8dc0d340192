"""The generator sharded by vLLM tensor parallelism (rollout.tensor_parallel_size): on 4 ranks two
tp=2 engines, each stepping through batches of its own (different sizes and lengths, so that
engines tied in lockstep would hang), return on both ranks of an engine the same completions,
and the same as one tp=1 engine: token for token, sampled and greedy, with log-probs within
1e-4. Each rank holds about half of the weight bytes. Whole and partial weight syncs into the
shards give the log-probs transformers computes for the streamed weights. The GRPO runs of
test_policy_parallel.py (trainer tp 2, generator tp 2 by default) and the syncs of
test_rollout_weight_sync.py and test_policy_lora.py (a ZeRO-3 trainer on 2 ranks feeding one
tp=2 engine) hold the trainer side.

The 4-rank test is also one of the GPU checks (marker gpu_check, bench/gpu_check.sh): on CUDA it
runs one tp=2 engine over 2 GPUs (4 ranks with 4 GPUs), and is skipped with one GPU."""
import json
import os

import pytest
import torch
from conftest import PYTHON, run, torchrun
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from megagrpo.cluster.generator_layout import generator_layout
from megagrpo.config.schema import ConfigError
from megagrpo.validation import load_config

PROBE = "tests/helpers/sharded_generator_probe.py"
CUDA = torch.cuda.is_available()
GPUS = torch.cuda.device_count() if CUDA else 0
# max |log p| difference, float32: measured at 1e-5 and below on CPU; on CUDA (not measured yet)
# tp=2's all-reduce adds the partial products in another order than one GPU's matmul, and TF32
# may round them
LOGP_TOLERANCE = 2e-3 if CUDA else 1e-4
RANKS = 4 if not CUDA or GPUS >= 4 else 2  # one rank a GPU: 2 GPUs hold one tp=2 engine


def _probe_args(tiny, out, generator_tp):
    return ["--out", str(out), "--model", tiny["warm"], "--other-model", tiny["model"],
            "--data", os.path.join(tiny["data"], "train.jsonl"), "--generator-tp", str(generator_tp)]


def _hf_logprobs(weights, model_dir, sequence, start):
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model.load_state_dict(weights, strict=False)
    model.tie_weights()
    with torch.no_grad():
        logp = model(input_ids=torch.tensor([sequence])).logits[0, :-1].float().log_softmax(-1)
    return logp[torch.arange(len(sequence) - 1), torch.tensor(sequence[1:])][start - 1:].tolist()


@pytest.mark.multirank
@pytest.mark.gpu_check
@pytest.mark.skipif(CUDA and GPUS < 2, reason=f"missing: a second GPU ({GPUS} visible; vLLM at tp=2 shards over 2)")
def test_tp2_engines_on_4_ranks_equal_one_tp1_engine(tiny, tmp_path, record_property):
    sharded, whole = tmp_path / "tp2", tmp_path / "tp1"
    run([*torchrun(RANKS, PROBE),
         *_probe_args(tiny, sharded, 2)], timeout=600)
    run([PYTHON, PROBE, *_probe_args(tiny, whole, 1), "--all-batches"], timeout=600)
    ranks = [json.load(open(sharded / f"sharded_rank{r}.json")) for r in range(RANKS)]
    reference = json.load(open(whole / "sharded_rank0.json"))
    expected = {(row["batch"], row["greedy"]): row for row in reference["rounds"]}
    assert len(expected) == 4
    record_property("ranks", RANKS)
    record_property("weight_bytes_tp1", reference["weight_bytes"])
    record_property("weight_bytes_tp2_per_rank", [r["weight_bytes"] for r in ranks])
    gaps = []
    for r in ranks:
        partner = ranks[r["rank"] ^ 1]  # the other rank of its engine
        assert r["rounds"] == partner["rounds"], f"the two ranks of engine {r['group']} returned different completions"
        assert [row["batch"] for row in r["rounds"]] == [r["group"] % 2] * 2 + [(r["group"] + 1) % 2] * 2
        for row in r["rounds"]:
            want = expected[row["batch"], row["greedy"]]
            assert row["tokens"] == want["tokens"], (r["rank"], row["batch"], row["greedy"])
            got = [lp for g in row["logprobs"] for c in g for lp in c]
            ref = [lp for g in want["logprobs"] for c in g for lp in c]
            assert len(got) == len(ref)
            gaps.append(max(abs(a - b) for a, b in zip(got, ref)))
            assert gaps[-1] < LOGP_TOLERANCE, (r["rank"], row["batch"], row["greedy"], gaps[-1])
        # each rank holds its slices: about half of the whole model's bytes (the norms are whole)
        share = r["weight_bytes"] / reference["weight_bytes"]
        assert 0.45 < share < 0.6, (r["weight_bytes"], reference["weight_bytes"])
    # the weight syncs: the streamed weights are what the shards score with
    other = load_file(os.path.join(tiny["model"], "model.safetensors"))
    original = load_file(os.path.join(tiny["warm"], "model.safetensors"))
    sequence, start = reference["sequence"], reference["prompt_len"]
    mixed = {**other, **{name: original[name] for name in reference["perturbed"]}}
    for name, weights in (("other_logprobs", other), ("mixed_logprobs", mixed)):
        want = _hf_logprobs(weights, tiny["warm"], sequence, start)
        for r in [reference, *ranks]:
            gap = max(abs(a - b) for a, b in zip(r[name], want, strict=True))
            gaps.append(gap)
            assert gap < LOGP_TOLERANCE, (name, r["rank"], gap)
    record_property("max_logp_gap", max(gaps))
    assert reference["other_logprobs"] != reference["mixed_logprobs"]  # the partial stream moved the engine


def test_refused_generator_layouts(tiny, tmp_path, monkeypatch):
    base = [f"model.name_or_path={tiny['warm']}", f"data.train_file={os.path.join(tiny['data'], 'train.jsonl')}",
            "data.eval_file=null", f"output_dir={tmp_path}"]
    def generator_tp(overrides):
        return generator_layout(load_config("configs/tiny_arith.yaml", overrides)).generator_tp

    assert generator_tp(base) == 1
    assert generator_tp(base + ["parallel.tensor_parallel_size=2"]) == 2  # the trainer's tp by default
    pipeline = base + ["parallel.pipeline_parallel_size=2", "deepspeed=configs/ds_zero1.json"]
    assert generator_tp(pipeline) == 1
    assert generator_tp(base + ["rollout.engine=hf", "parallel.tensor_parallel_size=2"]) == 1
    cases = [
        (pipeline + ["rollout.tensor_parallel_size=2"], r"rollout.tensor_parallel_size=2 with "
         r"parallel.pipeline_parallel_size=2: under pipeline parallelism only the first stage"),
        (base + ["rollout.engine=hf", "rollout.tensor_parallel_size=2"], r"needs rollout.engine=vllm"),
        (base + ["rollout.tensor_parallel_size=4"], r"does not divide the model's 2 attention heads"),
        (base + ["rollout.tensor_parallel_size=0"], r"rollout.tensor_parallel_size=0 must be >= 1"),
    ]
    for overrides, message in cases:
        with pytest.raises(ConfigError, match=message):
            load_config("configs/tiny_arith.yaml", overrides)
    monkeypatch.setenv("WORLD_SIZE", "6")
    with pytest.raises(ConfigError, match=r"rollout.tensor_parallel_size=3 with parallel.tensor_parallel_size=2: "
                                          r"a generator group \(3 consecutive ranks\) must lie inside one trainer"):
        load_config("configs/tiny_arith.yaml", base + ["rollout.tensor_parallel_size=3",
                                                       "parallel.tensor_parallel_size=2"])
    with pytest.raises(ConfigError, match=r"world size 6 is not divisible by it; launch a multiple of 4"):
        load_config("configs/tiny_arith.yaml", base + ["rollout.tensor_parallel_size=4"])
