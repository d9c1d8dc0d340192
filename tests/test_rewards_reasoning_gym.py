"""The reasoning_gym reward: the answer extraction rule, the tasks' own scorers on real
reasoning-gym entries, hostile completions, refused tasks, and tools/prepare_data.py's rows."""
import json
import os
import subprocess
import sys

import pytest
import reasoning_gym

from megagrpo.config.schema import RewardFunctionConfig
from megagrpo.rewards import build_reward_functions, compute_rewards
from megagrpo.rewards.reasoning_gym import ReasoningGymError, check_task, extract_answer
from megagrpo.rewards.reasoning_gym import reasoning_gym as rg_reward

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("completion, reference, expected", [
    ("Let me think. <answer>42</answer> and more", None, "42"),
    ("<answer>1</answer> then <ANSWER> 2 </ANSWER>", None, "2"),
    ("so \\boxed{\\frac{1}{2}} is it", None, "\\frac{1}{2}"),
    ("First 3 + 4 = 7.\nAnswer: 7.\nThanks", None, "7"),
    ("The final answer is **ainomma**.", None, "ainomma"),
    ("I answered badly.\nthe answer is: `cat`", None, "cat"),
    ("no marker here\n\n  last line.  \n", None, "last line"),
    ("So 3 + 4 = 7.", "7", "7"),
    ("Answer: 1,234 apples", "1234", "1234"),
    ("Answer: -4 (since 5 - 3 - 6 = -4)", "-4", "-4"),
    ("Answer: seven", "7", "seven"),
    ("", "7", ""),
])
def test_extraction_rule(completion, reference, expected):
    assert extract_answer(completion, reference) == expected


def _rows(task, size=4, seed=3, **options):
    return [json.dumps(entry) for entry in reasoning_gym.create_dataset(task, size=size, seed=seed, **options)]


def test_the_tasks_own_scorer_decides():
    rows = _rows("chain_sum") + _rows("spell_backward")
    answers = [json.loads(r)["answer"] for r in rows]
    right = [f"Working it out...\nAnswer: {a}" for a in answers]
    wrong = [f"Answer: {a}x9" for a in answers]
    assert rg_reward(None, right, reasoning_gym=rows) == [1.0] * len(rows)
    scored = rg_reward(None, wrong, reasoning_gym=rows)
    assert all(s < 1.0 for s in scored)
    assert scored.components["answered"] == [1.0] * len(rows)


def test_reward_through_the_registry_with_components():
    fns = build_reward_functions([RewardFunctionConfig(name="reasoning_gym")])
    rows = _rows("chain_sum", size=2)
    answer = json.loads(rows[0])["answer"]
    scored = compute_rewards(fns, ["p", "p"], [f"Answer: {answer}", "I do not know"], {"reasoning_gym": rows})
    assert scored.total[0] == 1.0 and scored.total[1] == 0.0
    assert scored.reasons["reasoning_gym"][0] == f"answer {answer!r}"
    assert scored.components["reasoning_gym/score"].tolist() == [1.0, 0.0]


HOSTILE = ["", "a" * 1_000_000, "Answer: 7" + "*." * 500_000, "`*" * 500_000,  # emphasis and periods to strip
           "<answer>" * 200_000, "<think>x</think><answer>" * 50_000,
           "\\boxed{" * 100_000, "Answer: " * 200_000, "Answer: " + "9" * 100_000, "Answer: \ud800\x00",
           "<answer>__import__('os').system('touch /tmp/pwned')</answer>", "Answer: 1e999", "Answer: nan"]


@pytest.mark.parametrize("task", ["chain_sum", "spell_backward", "number_sorting", "word_sorting"])
def test_hostile_completions_score_in_range(task):
    rows = _rows(task, size=1) * len(HOSTILE)
    scores = rg_reward(None, HOSTILE, reasoning_gym=rows)
    assert all(type(s) is float and 0.0 <= s <= 1.0 for s in scores)
    assert not os.path.exists("/tmp/pwned")


def test_a_scorer_that_raises_scores_zero_with_the_reason():
    # fraction_simplification's scorer raises on some text; whatever raises must score 0
    row = json.loads(_rows("chain_sum", size=1)[0])
    row["answer"] = None  # the scorer compares with it: TypeError inside reasoning-gym
    scored = rg_reward(None, ["Answer: 3"], reasoning_gym=[json.dumps(row)])
    assert scored == [0.0] and "raised" in scored.reasons[0]


def test_unsafe_and_unknown_tasks_refused():
    with pytest.raises(ReasoningGymError, match="'countdown' scores answers by running them as code"):
        check_task("countdown")
    with pytest.raises(ReasoningGymError, match="no task 'chain_summ'"):
        check_task("chain_summ")
    row = json.loads(_rows("chain_sum", size=1)[0])
    row["metadata"]["source_dataset"] = "n_queens"
    with pytest.raises(ReasoningGymError, match="n_queens"):
        rg_reward(None, ["Answer: 1"], reasoning_gym=[json.dumps(row)])


def test_prepare_data_writes_seeded_disjoint_rows(tmp_path):
    def prepare(out, *extra):
        return subprocess.run([sys.executable, "tools/prepare_data.py", "--reasoning-gym", "chain_sum", "--out",
                               str(out), "--train-size", "50", "--eval-size", "10", *extra], cwd=ROOT,
                              capture_output=True, text=True)
    assert prepare(tmp_path / "a").returncode == 0
    assert prepare(tmp_path / "b").returncode == 0
    for name in ("train.jsonl", "eval.jsonl"):
        assert (tmp_path / "a" / name).read_text() == (tmp_path / "b" / name).read_text()  # seeded
    train = [json.loads(line) for line in open(tmp_path / "a" / "train.jsonl")]
    held_out = [json.loads(line) for line in open(tmp_path / "a" / "eval.jsonl")]
    assert len(train) == 50 and len(held_out) == 10
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in held_out}
    entry = json.loads(train[0]["reasoning_gym"])
    assert entry["answer"] == train[0]["answer"] and train[0]["prompt"].endswith("Answer: <answer>")
    refused = prepare(tmp_path / "c", "--task-args", "[1]")
    assert refused.returncode == 2 and "--task-args must be a JSON object" in refused.stderr
    unsafe = subprocess.run([sys.executable, "tools/prepare_data.py", "--reasoning-gym", "puzzle24", "--out",
                             str(tmp_path / "d")], cwd=ROOT, capture_output=True, text=True)
    assert unsafe.returncode == 2 and "running them as code" in unsafe.stderr
