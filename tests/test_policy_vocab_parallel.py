"""Vocab-parallel log-softmax (tensor parallel LM head): 2 ranks through the deepspeed launcher,
each with half the vocabulary, equal to the gathered full-vocabulary reference, forward and
backward (float64)."""
import json
import os

import pytest
from conftest import BIN, free_port, run


@pytest.mark.multirank
def test_vocab_parallel_matches_gathered_reference(tmp_path):
    run([f"{BIN}/deepspeed", "--num_gpus", "2", "--master_port", str(free_port()),
         "tests/helpers/vocab_parallel_probe.py", str(tmp_path)])
    # the launcher's --local_rank=N argument is not taken for the output folder (it once was)
    assert sorted(os.listdir(tmp_path)) == ["vocab_parallel_rank0.json", "vocab_parallel_rank1.json"]
    for rank in (0, 1):
        results = json.load(open(os.path.join(tmp_path, f"vocab_parallel_rank{rank}.json")))
        assert len(results) == 3
        for r in results:
            assert r["grad_hidden_norm"] > 0.1, r
            for key in ("logp", "entropy", "grad_hidden", "grad_weight_shard"):
                assert r[key] < 1e-10, (rank, key, r)
