"""Rewards: built-ins, weighting, and the errors that stop a run."""
import math

import pytest

from megagrpo.config.schema import RewardFunctionConfig
from megagrpo.rewards import RewardError, build_reward_functions, compute_rewards


def _fns(*entries):
    return build_reward_functions([RewardFunctionConfig(**e) for e in entries])


def test_builtins_and_weights():
    fns = _fns({"name": "answer_match", "weight": 1.0}, {"name": "format", "weight": 0.5},
               {"name": "length_penalty", "weight": 0.1, "args": {"target": 10}})
    completions = ["3 + 4 = 7. Answer: 7", "Answer: 8", "seven", "Answer: 7.0"]
    scored = compute_rewards(fns, ["p"] * 4, completions, {"answer": ["7", "7", "7", "7"]})
    total, per = scored.total, scored.per_function
    assert per[:, 0].tolist() == [1.0, 0.0, 0.0, 1.0]
    assert per[:, 1].tolist() == [1.0, 1.0, 0.0, 1.0]
    lengths = [len(c) for c in completions]
    assert per[:, 2].tolist() == pytest.approx([max(-1, 1 - abs(n - 10) / 10) for n in lengths])
    assert total.tolist() == pytest.approx((per[:, 0] + 0.5 * per[:, 1] + 0.1 * per[:, 2]).tolist())


def nan_reward(prompts, completions, **_):
    return [0.0, math.nan]


def raising_reward(prompts, completions, **_):
    raise KeyError("score")


def short_reward(prompts, completions, **_):
    return [1.0]


def test_nan_reward_names_function_and_sample():
    with pytest.raises(RewardError, match=r"'test_rewards:nan_reward' returned nan for sample 1 "
                                          r"\(prompt 'q2', completion 'b'\)"):
        compute_rewards(_fns({"name": "test_rewards:nan_reward"}), ["q1", "q2"], ["a", "b"], {})


def test_raising_reward_names_function():
    with pytest.raises(RewardError, match=r"'test_rewards:raising_reward' raised KeyError"):
        compute_rewards(_fns({"name": "test_rewards:raising_reward"}), ["q"] * 2, ["a", "b"], {})


def test_wrong_count_and_unknown_name():
    with pytest.raises(RewardError, match=r"returned 1 values for 2 completions"):
        compute_rewards(_fns({"name": "test_rewards:short_reward"}), ["q"] * 2, ["a", "b"], {})
    with pytest.raises(RewardError, match=r"reward 'exact' is not a built-in"):
        _fns({"name": "exact"})
