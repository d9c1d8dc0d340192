"""Every built-in reward against hostile completions (issue 13): whatever the policy writes, a
reward returns one finite float per completion in its range, raises nothing and finishes. Then
one case per bug that this found, showing that an honest completion still scores as before.

(The code reward has its own adversarial tests: test_rewards_code_adversarial.py.)"""
import math
import os
import signal
import sys
import threading
from types import SimpleNamespace

import pytest
import torch

import megagrpo.rewards.reward_model as reward_model_module
from megagrpo.rewards import answer_match, format_match, length_penalty
from megagrpo.rewards.reward_model import CHARS_PER_TOKEN, RewardModel
from megagrpo.rewards.text import (
    FRIENDLINESS_CHARS,
    MAX_ANSWER_CHARS,
    _MathChild,
    customer_service,
    extract_keywords,
    friendliness,
    math_accuracy,
    overlong_penalty,
    think_answer_format,
)

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools"))

HOSTILE = [
    "", " \n\t ", "a" * 1_000_000, "x " * 5_000_000,                       # empty, 1 MB, 10 MB
    "1" * 100_000, "Answer: " + "1" * 100_000, "<answer>" + "1" * 100_000 + "</answer>",
    "\\boxed{" + "9" * 100_000 + "}",                                       # float() is inf, int() refuses
    "Answer: 1e999", "Answer: nan", "Answer: inf", "Answer: -0", "<answer>nan</answer>",
    "<answer>\\infty</answer>", "<answer>-0</answer>",
    "Answer: \ud800 7 \udfff", "<answer>\udc80</answer>", "Answer: 7\x00\x00",  # lone surrogates, NUL
    "".join(chr(i) for i in range(32)) + "\x7f\x85\u2028\u2029", "\u202eAnswer: 7\u200f\u202c",
    "\\boxed{" * 10_000, "{" * 100_000, "}" * 100_000, "\\frac{1}{" * 5_000,
    "\\frac{1}{" * 2_000 + "2" + "}" * 2_000, "<answer>" + "{" * 300 + "</answer>",
    "<answer>" + "(" * 300 + "1" + ")" * 300 + "</answer>", "<answer>" + "x^" * 100 + "x</answer>",
    "$10^{10^{10^{10}}}$", "<answer>10^{10^{10^{10}}}</answer>", "<answer>9**9**9**9</answer>",
    "<answer>(10^{10})!</answer>", "<answer>2^{2^{34}}</answer>",
    "Answer: " * 200_000, "<think>" * 100_000, "<think>x</think><answer>" * 50_000,
    "<answer>1</answer>" * 50_000, "$" * 100_000, "$1$ " * 50_000, "\\boxed{1}" * 50_000,
    "\\begin{array}" * 10_000, "The final answer is " * 10_000,
    "Answer: \u0667", "Answer: " + "," * 100_000 + "7", "Answer: " + "-" * 100_000,
    "\U0001F602" * 100_000, "good but " * 10_000,                           # VADER's worst cases
]


@pytest.fixture(scope="module")
def reward_model(tmp_path_factory):
    """A tiny sequence-classification model and byte-level BPE tokenizer, built here in a second."""
    from make_tiny_model import build_tokenizer
    from transformers import Qwen2Config, Qwen2ForSequenceClassification

    path = tmp_path_factory.mktemp("rm")
    tokenizer = build_tokenizer([], 300)
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=64, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=1, intermediate_size=128, max_position_embeddings=512,
                         num_labels=1, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    Qwen2ForSequenceClassification(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return RewardModel(path=str(path), batch_size=16, max_length=256)


n = len(HOSTILE)
REWARDS = {  # name: (call, lowest, highest)
    "answer_match": (lambda c: answer_match(["q"] * n, c, answer=["7"] * n), 0.0, 1.0),
    "format": (lambda c: format_match(["q"] * n, c), 0.0, 1.0),
    "length_penalty": (lambda c: length_penalty(["q"] * n, c), -1.0, 1.0),
    "customer_service": (lambda c: customer_service(["My router keeps dropping, please fix it"] * n, c), -0.2, 1.0),
    # timeout_s=1 (default 5) keeps this test short: a few inputs run out of time
    "math_accuracy": (lambda c: math_accuracy(["q"] * n, c, answer=["7"] * n, timeout_s=1), 0.0, 1.0),
    "think_answer_format": (lambda c: think_answer_format(["q"] * n, c), 0.0, 1.0),
    "overlong_penalty": (lambda c: overlong_penalty(["q"] * n, c, completion_length=[min(len(x), 200) for x in c],
                                                    max_length=100, cache_length=10), -1.0, 0.0),
}


@pytest.mark.parametrize("name", [*REWARDS, "reward_model"])
def test_hostile_completions_score_finite_floats_in_range(name, request):
    if name == "reward_model":
        rm = request.getfixturevalue("reward_model")
        call, lowest, highest = (lambda c: rm(["What is 2 + 2?"] * n, c)), -math.inf, math.inf
    else:
        call, lowest, highest = REWARDS[name]
    scores = call(HOSTILE)
    assert len(scores) == len(HOSTILE)
    for i, s in enumerate(scores):
        assert type(s) is float and math.isfinite(s) and lowest <= s <= highest, (i, HOSTILE[i][:40], s)


def test_think_answer_format_reads_tag_floods_in_linear_time():
    # "<think>x</think><answer>" * 50_000 took 445 s (the lazy groups retried at every tag)
    honest = "<think>3 + 4 = 7</think>\n<answer>7</answer>"
    assert think_answer_format(["q"] * 2, [honest, honest * 50_000]) == [1.0, 0.0]


def test_math_accuracy_reads_the_tail_of_long_answers():
    # a 10 MB completion made math-verify run out of time, and findall over an unclosed
    # "<think>x</think><answer>" * 50_000 never finished: the answer text is cut, found by rfind
    reasoning = "We add the numbers step by step. " * 1_000
    honest = [reasoning + "So the answer is \\boxed{7}.",
              reasoning + "<answer>" + " " * MAX_ANSWER_CHARS + "7</answer>",
              "<think>" + reasoning + "</think><answer>\\frac{14}{2}</answer>",
              "<answer>" + "<think>x</think><answer>" * 50_000 + "7</answer>"]
    assert math_accuracy(["q"] * 4, honest, answer=["7"] * 4, timeout_s=1) == [1.0, 1.0, 1.0, 1.0]


def test_math_accuracy_off_the_main_thread_is_bounded():
    # off the main thread math-verify had no timeout: 10^{10^{10^{10}}} computed for ever in C
    got = {}
    completions = ["\\boxed{7}", "<answer>10^{10^{10^{10}}}</answer>", "<answer>7</answer>", "\\boxed{8}"]
    thread = threading.Thread(target=lambda: got.update(
        scores=math_accuracy(["q"] * 4, completions, answer=["7"] * 4, timeout_s=1)))
    thread.start()
    thread.join(timeout=120)
    assert not thread.is_alive() and got["scores"] == [1.0, 0.0, 1.0, 0.0]


def test_math_child_that_stops_answering_is_killed_and_replaced():
    with _MathChild() as child:
        assert child("7", "\\boxed{7}", 1)
        os.kill(child.proc.pid, signal.SIGSTOP)  # as if stuck in C code that no timeout reaches
        assert child("7", "\\boxed{7}", 1) is False and child.proc is None
        assert child("7", "\\boxed{7}", 1)


def test_friendliness_and_keywords_bounded():
    # VADER is quadratic in words ("\U0001F602" * 2_000 took 3 s): it reads the first
    # FRIENDLINESS_CHARS characters, the whole of an honest reply
    from vaderSentiment.vaderSentiment import SentimentIntensityAnalyzer
    reply = "Thank you so much for your patience, we are happy to fix the router for you!"
    compound = SentimentIntensityAnalyzer().polarity_scores(reply)["compound"]
    assert len(reply) < FRIENDLINESS_CHARS and friendliness(reply) == (compound + 1) / 2 > 0.8
    assert 0.5 < friendliness("\U0001F602" * 100_000) <= 1.0
    # keywords were deduplicated through a list: quadratic in the prompt's distinct words
    prompt = " ".join(f"word{i}x" for i in range(100_000))
    assert extract_keywords(prompt + " router word0x")[:2] == ["word0x", "word1x"]
    assert len(extract_keywords(prompt)) == 100_000


def test_reward_model_cuts_completions_and_survives_bad_text(reward_model, monkeypatch):
    # 10 MB took 16 s to tokenize, for max_length tokens: the cut leaves the score as it was
    rm = reward_model
    long = "The answer is 4. " * 6_000
    assert len(long) > CHARS_PER_TOKEN * rm.max_length
    cut = rm(["What is 2 + 2?"], [long])
    monkeypatch.setattr(reward_model_module, "CHARS_PER_TOKEN", 10**9)
    assert rm(["What is 2 + 2?"], [long]) == pytest.approx(cut, abs=1e-6)
    # a lone surrogate made the tokenizer raise TypeError
    assert rm(["q"] * 2, ["4 \ud800", "4 ?"]) == pytest.approx([rm(["q"], ["4 ?"])[0]] * 2)


def test_reward_model_non_finite_score_is_the_batch_lowest(reward_model, monkeypatch):
    rm = reward_model
    logits = torch.tensor([[math.nan], [1.0], [-2.0], [math.inf]])
    monkeypatch.setattr(rm, "model", lambda input_ids, attention_mask: SimpleNamespace(logits=logits))
    assert rm(["q"] * 4, ["a", "b", "c", "d"]) == [-2.0, 1.0, -2.0, -2.0]
    logits = torch.full((2, 1), math.nan)  # a whole batch: the model is broken, the run stops
    with pytest.raises(ValueError, match="no finite score"):
        rm(["q"] * 2, ["a", "b"])
