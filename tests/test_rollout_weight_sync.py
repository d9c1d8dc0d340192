"""The weight swap is real: after a training step and the in-place sync, vLLM scores a fixed
completion exactly as the trainer does, and differently from before the step. Two ranks,
ZeRO-3 (the sync gathers partitioned parameters) feeding one vLLM engine sharded over both
(rollout.tensor_parallel_size 2: each rank keeps its slices of the whole tensors), through
torchrun; transformers' generate; and tensor parallelism (the sync gathers AutoTP
shards into the tp=2 engine, the default generator layout under trainer tp 2). The sync into an
unsharded engine under ZeRO-3 is held by test_policy_lora.py's layouts."""
import json
import os

import pytest
from conftest import run, tiny_overrides, torchrun
from transformers import AutoTokenizer


@pytest.mark.multirank
@pytest.mark.parametrize("engine,tp,generator_tp", [("vllm", 1, 2), ("hf", 1, 1), ("vllm", 2, 2)])
def test_weight_sync_after_step(tiny, tmp_path, engine, tp, generator_tp):
    out = tmp_path / "weight_sync"
    run([*torchrun(2, "tests/helpers/swap_probe.py"), "--config", "configs/tiny_arith.yaml",
         *tiny_overrides(tiny, out, **{"rollout.engine": engine, "grpo.learning_rate": 1e-3,
                                       "grpo.max_steps": 1, "parallel.tensor_parallel_size": tp,
                                       "rollout.tensor_parallel_size": generator_tp})])
    # The probe scores one fixed completion: the tokens of its text, then EOS (13 with the tiny
    # tokenizer: 12 + 1). Each side gives one log-prob per completion token, so every list has
    # exactly that length; a short list would otherwise hide behind zip().
    tokenizer = AutoTokenizer.from_pretrained(tiny["warm"])
    for rank in (0, 1):
        r = json.load(open(os.path.join(out, f"swap_rank{rank}.json")))
        expected = tokenizer(r["completion_text"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        assert r["completion"] == expected, (rank, r)
        n = len(expected)
        assert n > 1 and r["grad_norm"] > 0
        for key in ("engine_before", "trainer_before", "engine_after", "trainer_after"):
            assert len(r[key]) == n, (rank, key, len(r[key]), n)
        for key in ("before", "after"):
            for engine_lp, trainer_lp in zip(r[f"engine_{key}"], r[f"trainer_{key}"], strict=True):
                assert abs(engine_lp - trainer_lp) < 1e-4, (rank, key, r)
        moved = max(abs(a - b) for a, b in zip(r["engine_after"], r["engine_before"], strict=True))
        assert moved > 1e-3, f"the engine still scores with the pre-step weights: {r}"
