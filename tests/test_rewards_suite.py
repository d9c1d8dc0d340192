"""The reward suite against hand-computed values on fixed texts, and the reward model against
a plain transformers forward."""

import pytest
import torch

from megagrpo.config.schema import RewardFunctionConfig
from megagrpo.rewards import Scores, build_reward_functions, close_reward_functions, component_metrics, compute_rewards
from megagrpo.rewards.text import (
    customer_service,
    extract_keywords,
    friendliness,
    math_accuracy,
    overlong_penalty,
    think_answer_format,
)

QUERY = "My internet connection keeps dropping every evening, can you fix the router?"
NEUTRAL = "We will reset the router and check the connection tonight."  # 58 characters


def _fns(*entries):
    return build_reward_functions([RewardFunctionConfig(**e) for e in entries])


def test_customer_service_by_hand():
    assert extract_keywords(QUERY) == ["internet", "connection", "keeps", "dropping", "every",
                                       "evening", "fix", "router"]
    assert len(NEUTRAL) == 58 and friendliness(NEUTRAL) == 0.5  # VADER compound 0: no sentiment words
    s = customer_service([QUERY], [NEUTRAL], target=100)
    # solved 2/8 keywords, friendliness 0.5, length 1 - |58 - 100| / 100 = 0.58
    assert s.components == {"solved": [0.25], "friendliness": [0.5], "length": [pytest.approx(0.58)]}
    assert s[0] == pytest.approx(0.5 * 0.25 + 0.3 * 0.5 + 0.2 * 0.58)  # 0.391
    # keywords from the row (list or comma string), weights and target configurable
    s = customer_service([QUERY, QUERY], [NEUTRAL, NEUTRAL], keywords=["router, refund", ["Router"]],
                         solved_weight=1.0, friendly_weight=0.0, length_weight=0.0)
    assert list(s) == [0.5, 1.0]
    # a friendly answer: VADER's compound c -> (c + 1) / 2, above the neutral one
    from vaderSentiment.vaderSentiment import SentimentIntensityAnalyzer
    friendly = "Thank you so much for your patience, we are happy to fix the router for you!"
    compound = SentimentIntensityAnalyzer().polarity_scores(friendly)["compound"]
    assert compound > 0.5
    s = customer_service([QUERY], [friendly])  # default target 150 characters
    assert s.components["friendliness"] == [pytest.approx((compound + 1) / 2)]
    assert s.components["solved"] == [2 / 8]  # "fix", "router"
    assert s[0] == pytest.approx(0.5 * 0.25 + 0.3 * (compound + 1) / 2 + 0.2 * (1 - abs(len(friendly) - 150) / 150))


def test_customer_service_chat_prompts_and_components_through_compute_rewards():
    fns = _fns({"name": "customer_service", "weight": 2.0, "args": {"target": 100}})
    chat = [{"role": "system", "content": "Be kind."}, {"role": "user", "content": QUERY}]
    scored = compute_rewards(fns, [chat, QUERY], [NEUTRAL, ""], {})
    total, per = scored.total, scored.per_function
    assert per[:, 0].tolist() == pytest.approx([0.391, 0.5 * 0 + 0.3 * 0.5 + 0.2 * 0.0])
    assert total.tolist() == pytest.approx((2 * per[:, 0]).tolist())
    assert set(scored.components) == {"customer_service/solved", "customer_service/friendliness",
                                          "customer_service/length"}
    metrics = component_metrics(scored)
    assert metrics["rewards/customer_service/solved"] == pytest.approx(0.125)
    assert metrics["rewards/customer_service/length"] == pytest.approx(0.29)


def test_math_accuracy_with_math_verify():
    completions = ["so \\boxed{\\frac{1}{2}}", "<think>half</think><answer>1/2</answer>",
                   "the answer is 3", "<answer>0.50</answer>", "x = 2, so $x^2 = 4$",
                   "<answer>\\{1, 2\\}</answer>", "no answer at all"]
    answers = ["0.5", "0.5", "0.5", "\\frac{1}{2}", "4", "\\{2, 1\\}", "7"]
    assert math_accuracy(["q"] * 7, completions, answer=answers) == [1.0, 1.0, 0.0, 1.0, 1.0, 1.0, 0.0]
    with pytest.raises(ValueError, match="needs an 'answer' field"):
        math_accuracy(["q"], ["1"])


def test_think_answer_format():
    completions = ["<think>\n3 + 4 = 7\n</think>\n<answer>7</answer>",
                   "  <think>x</think><answer> 7 </answer>\n",
                   "<answer>7</answer>",                                  # no think
                   "<think>x</think><answer>7</answer> trailing",          # text after
                   "<think>a</think><think>b</think><answer>7</answer>",   # two thinks
                   "<think>x</think><answer> </answer>"]                   # empty answer
    assert think_answer_format(["q"] * 6, completions) == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0]


def test_dapo_soft_overlong_penalty():
    # max 20 tokens, last 5 of them penalised linearly: free up to 15
    lengths = [10, 15, 16, 17, 20, 21]
    got = overlong_penalty(["q"] * 6, [""] * 6, completion_length=lengths, max_length=20, cache_length=5)
    assert got == pytest.approx([0.0, 0.0, -0.2, -0.4, -1.0, -1.0])
    # max_length defaults to the trainer's max_new_tokens field
    got = overlong_penalty(["q"] * 2, [""] * 2, completion_length=[2, 3], max_new_tokens=[4, 4], cache_length=2)
    assert got == [0.0, -1.0 / 2]
    with pytest.raises(ValueError, match="completion_length"):
        overlong_penalty(["q"], ["x"], max_length=4)


def test_suite_names_resolve_and_weights_combine():
    fns = _fns({"name": "think_answer_format", "weight": 0.5}, {"name": "math_accuracy"},
               {"name": "overlong_penalty", "weight": 0.1, "args": {"cache_length": 4}})
    completions = ["<think>1+1</think><answer>2</answer>", "3"]
    scored = compute_rewards(fns, ["q", "q"], completions,
                                 {"answer": ["2", "2"], "completion_length": [10, 7],
                                  "max_new_tokens": [8, 8]})
    total, per = scored.total, scored.per_function
    assert per.tolist() == [[1.0, 1.0, -1.0], [0.0, 0.0, -0.75]]
    assert total.tolist() == pytest.approx([0.5 + 1.0 - 0.1, -0.075])


def make_reward_model(tiny, path, seed=0):
    """A tiny sequence-classification model (one output) from the tiny model's config and
    tokenizer; random score head, nothing downloaded."""
    from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(tiny["warm"])
    config = AutoConfig.from_pretrained(tiny["warm"], num_labels=1, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(seed)
    model = AutoModelForSequenceClassification.from_config(config)
    with torch.no_grad():
        model.score.weight.normal_(0, 1.0)  # scores of order 1, clearly different per text
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def reference_scores(path, prompts, completions):
    """The reward model's scores by a plain transformers forward, one text at a time."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    out = []
    for p, c in zip(prompts, completions):
        text = tokenizer.apply_chat_template([{"role": "user", "content": p},
                                              {"role": "assistant", "content": c}], tokenize=False)
        ids = tokenizer(text, return_tensors="pt", add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            out.append(float(model(input_ids=ids).logits[0, 0]))
    return out


def test_reward_model_scores_equal_a_plain_forward_and_combine_by_weight(tiny, tmp_path):
    path = make_reward_model(tiny, tmp_path / "rm")
    prompts = ["What is 2 + 2?", "What is 3 + 4?", "What is 1 + 1?"]
    completions = ["2 + 2 = 4. Answer: 4", "Answer: 8", "a much longer completion that pads the batch"]
    fns = _fns({"name": "reward_model", "weight": 0.5, "args": {"path": path, "batch_size": 2}},
               {"name": "answer_match", "weight": 1.0})
    scored = compute_rewards(fns, prompts, completions, {"answer": ["4", "7", "2"]})
    total, per = scored.total, scored.per_function
    expected = reference_scores(path, prompts, completions)
    assert per[:, 0].tolist() == pytest.approx(expected, abs=1e-4)
    assert len({round(v, 3) for v in expected}) == 3 and max(abs(v) for v in expected) > 0.05
    assert total.tolist() == pytest.approx((0.5 * per[:, 0] + per[:, 1]).tolist(), abs=1e-6)
    close_reward_functions(fns)


def test_scores_type_and_class_rewards_get_the_config():
    class Probe:
        def __init__(self, config=None, scale=1.0):
            self.config, self.scale = config, scale

        def __call__(self, prompts, completions, **_):
            return Scores([self.scale * len(c) for c in completions], components={"len": [len(c) for c in completions]})

    import megagrpo.rewards as rewards
    rewards.SUITE["probe_for_test"] = "test_rewards_suite:_PROBE"
    globals()["_PROBE"] = Probe
    try:
        fns = build_reward_functions([RewardFunctionConfig(name="probe_for_test", args={"scale": 2.0})],
                                     config="the config")
        assert fns[0].fn.config == "the config" and fns[0].args == {}
        scored = compute_rewards(fns, ["q", "q"], ["ab", "abcd"], {})
        assert scored.total.tolist() == [4.0, 8.0]
        assert scored.components["probe_for_test/len"].tolist() == [2.0, 4.0]
        assert scored.reasons["probe_for_test"] == ["", ""]
    finally:
        del rewards.SUITE["probe_for_test"]
