"""Data: loading errors that name the file and line, rendering, the distributed sampler."""
import pytest
from conftest import write_jsonl

from megagrpo.data import DataError, PromptOrder, load_prompts
from megagrpo.policy.models import load_tokenizer


@pytest.fixture(scope="module")
def tokenizer(tiny):
    return load_tokenizer(tiny["model"])


def test_malformed_jsonl_line_names_file_and_line(tokenizer, tmp_path):
    path = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "1 + 1", "answer": "2"}, '{"prompt": "2 + 2",',
                                               {"prompt": "3 + 3", "answer": "6"}])
    with pytest.raises(DataError, match=r"bad.jsonl:2: malformed JSON"):
        load_prompts(path, tokenizer, 64)


def test_missing_prompt_field_names_row(tokenizer, tmp_path):
    path = write_jsonl(tmp_path / "rows.jsonl", [{"prompt": "1 + 1"}, {"question": "2 + 2"}])
    with pytest.raises(DataError, match=r"rows.jsonl:2: missing string field 'prompt'.*\['question'\]"):
        load_prompts(path, tokenizer, 64)


def test_rendering_fields_messages_and_length_filter(tokenizer, tmp_path):
    rows = [{"prompt": "What is 1 + 1?", "answer": "2"},
            {"messages": [{"role": "user", "content": "What is 2 + 2?"}], "answer": "4"},
            {"prompt": "long " * 200, "answer": "0"}]
    prompts, dropped = load_prompts(write_jsonl(tmp_path / "d.jsonl", rows), tokenizer, 64)
    assert dropped == 1 and len(prompts) == 2
    text = tokenizer.decode(prompts[0].token_ids)
    assert text == "<|im_start|>user\nWhat is 1 + 1?<|im_end|>\n<|im_start|>assistant\n"
    assert prompts[0].fields == {"answer": "2"} and prompts[1].fields == {"answer": "4"}


def test_csv_and_parquet_load(tokenizer, tmp_path):
    import pandas as pd
    frame = pd.DataFrame({"prompt": ["What is 1 + 2?", "What is 3 + 4?"], "answer": ["3", "7"]})
    frame.to_csv(tmp_path / "d.csv", index=False)
    frame.to_parquet(tmp_path / "d.parquet")
    for name in ("d.csv", "d.parquet"):
        prompts, _ = load_prompts(str(tmp_path / name), tokenizer, 64)
        assert [str(p.fields["answer"]) for p in prompts] == ["3", "7"]


def test_sampler_disjoint_reshuffled_resumable():
    ranks = [PromptOrder(40, 4, r, 3, seed=7) for r in range(3)]
    epoch0 = [sum((s.next_indices() for _ in range(3)), []) for s in ranks]
    flat = sum(epoch0, [])
    assert len(flat) == len(set(flat)) == 36  # disjoint across ranks, no repeats in an epoch
    epoch1 = ranks[0].next_indices()
    assert ranks[0].epoch == 1 and epoch1 != epoch0[0][:4]  # a fresh permutation
    # resume: a new sampler loaded with the state continues identically
    state = ranks[1].state_dict()
    clone = PromptOrder(40, 4, 1, 3, seed=7)
    clone.load_state_dict(state)
    assert [clone.next_indices() for _ in range(4)] == [ranks[1].next_indices() for _ in range(4)]


def test_sampler_too_small_dataset():
    with pytest.raises(DataError, match=r"3 prompts cannot fill one step of 8 prompts"):
        PromptOrder(3, 4, 0, 2, seed=0)
