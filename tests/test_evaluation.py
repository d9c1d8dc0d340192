"""Evaluation: metrics against the libraries and closed forms, `megagrpo eval` on the vLLM
engine, and a GRPO run (2 ranks through torchrun, ZeRO-3) with the code reward
and a reward model, evaluated every eval_steps."""
import itertools
import json
import math
import os

import pytest
import torch
from conftest import BIN, ROOT, run, tiny_overrides, torchrun, write_jsonl
from runs import metrics
from test_rewards_suite import make_reward_model, reference_scores

from megagrpo.evaluation import distinct_n, pass_at_k, pass_k_values, perplexity, summarize

HYPS = ["the cat sat on the mat", "a quick brown fox jumps", "hello world hello"]
REFS = ["the cat is on the mat", "the quick brown fox jumped over", "hello there world"]


def record(i, completions, rewards, reference=None, ref_logprob=None, ref_tokens=0):
    return {"index": i, "prompt": f"p{i}", "reference": reference, "completions": completions,
            "reward": [sum(r) for r in zip(*rewards.values())], "rewards": rewards, "reasons": {},
            "ref_logprob": ref_logprob, "ref_tokens": ref_tokens}


def test_text_metrics_equal_the_libraries():
    import sacrebleu
    from rouge_score import rouge_scorer
    records = [record(i, [h, "x"], {"f": [1.0, 0.0]}, r, -2.0 * (i + 1), 4) for i, (h, r) in enumerate(zip(HYPS, REFS))]
    out = summarize(records, ["f"], 2)
    assert out["bleu"] == sacrebleu.corpus_bleu(HYPS, [REFS]).score / 100  # on ROUGE's 0-1 scale
    assert 0 < out["bleu"] < 1
    scorer = rouge_scorer.RougeScorer(["rouge1", "rouge2", "rougeL"], use_stemmer=True)
    for key in ("rouge1", "rouge2", "rougeL"):
        expected = sum(scorer.score(r, h)[key].fmeasure for h, r in zip(HYPS, REFS)) / 3
        assert out[key] == pytest.approx(expected, abs=1e-12)
    assert out["rouge1"] != out["rouge2"]
    # perplexity: exp(12 / 12) from log-prob sums -2, -4, -6 over 4 tokens each
    assert out["perplexity"] == pytest.approx(math.exp(1.0))
    assert perplexity([-1.0, -3.0], [2, 2]) == pytest.approx(math.exp(1.0))
    # distinct-n over every completion (whitespace tokens), by hand
    texts = ["a b a b", "a b c"]
    assert distinct_n(texts, 1) == 3 / 7            # {a, b, c} of 7 tokens
    assert distinct_n(texts, 2) == 3 / 5            # {ab, ba, bc} of 5 bigrams
    assert distinct_n(texts, 3) == 3 / 3            # {aba, bab, abc}
    assert distinct_n(["one"], 2) == 0.0
    # pass@1 with the greedy completion, pass@2 over both; mean rewards
    assert out["pass@1/f"] == pytest.approx(pass_at_k(2, 1, 1)) and out["pass@2/f"] == 1.0
    assert out["reward"] == 0.5 and out["rewards/f"] == 0.5


def test_pass_at_k_is_the_unbiased_closed_form():
    for n in range(1, 11):
        for c in range(n + 1):
            for k in range(1, n + 1):
                closed = 1.0 - math.comb(n - c, k) / math.comb(n, k)
                assert pass_at_k(n, c, k) == pytest.approx(closed, abs=1e-12), (n, c, k)
    # and it is the chance that k samples drawn without replacement hold a correct one
    samples = [1, 0, 0, 1, 0, 0, 0]
    subsets = list(itertools.combinations(samples, 3))
    assert pass_at_k(7, 2, 3) == pytest.approx(sum(any(s) for s in subsets) / len(subsets))
    assert pass_k_values(1) == [1] and pass_k_values(8) == [1, 2, 4, 8] and pass_k_values(6) == [1, 2, 4, 6]
    with pytest.raises(ValueError):
        pass_at_k(2, 1, 3)


def code_rows(path, rows, with_reference):
    """The demo arithmetic rows, with unit tests that a bare `Answer: N` line (valid Python: an
    annotation) passes when N is right, and a reference answer text."""
    out = []
    for line in open(path):
        row = json.loads(line)
        row["tests"] = ["assert True", f"assert __annotations__['Answer'] == {row['answer']}"]
        if with_reference:
            a, b = row["prompt"].removeprefix("What is ").rstrip("?").split(" + ")
            row["reference"] = f"{a} + {b} = {row['answer']}. Answer: {row['answer']}"
        out.append(row)
        if len(out) == rows:
            break
    return out


def test_megagrpo_eval_on_vllm(tiny, tmp_path):
    data = write_jsonl(tmp_path / "held_out.jsonl",
                       code_rows(os.path.join(tiny["data"], "eval.jsonl"), 6, with_reference=True))
    out = tmp_path / "eval"
    max_new_tokens = 24
    proc = run([f"{BIN}/megagrpo", "eval", "--model", tiny["warm"], "--data", data, "--output", str(out),
                "model.dtype=float32", f"rollout.max_new_tokens={max_new_tokens}",
                "logging.eval_num_generations=4", "data.max_prompt_length=64",
                "rewards.functions=[{name: answer_match}, {name: code, weight: 0.5, args: {timeout_s: 3}, "
                "pass_threshold: 1.0}]"])
    assert "results:" in proc.stdout
    results = json.load(open(out / "eval_results.json"))
    records = [json.loads(line) for line in open(out / "eval_samples.jsonl")]
    assert len(records) == results["num_prompts"] == 6 and all(len(r["completions"]) == 4 for r in records)
    # the numbers in the JSON are those of the samples file
    assert results == pytest.approx({**summarize(records, ["answer_match", "code"], 4, {"code": 1.0}),
                                     "num_prompts": 6, "dropped_prompts": 0, "num_generations": 4})
    assert 0 < results["rewards/answer_match"] < 1 and results["pass@4/answer_match"] >= results["pass@1/answer_match"]
    codes = [v for r in records for v in r["rewards"]["code"]]
    assert {0.0} < set(codes)  # worked answers are not Python (0), bare `Answer: N` lines run
    reasons = [x for r in records for x in r["reasons"]["code"]]
    assert any(x.startswith("syntax_error:") for x in reasons)
    # perplexity of the references (their first max_new_tokens tokens, as eval scores them)
    # equals the model's own log-likelihood (transformers forward). Both sides run in float32:
    # vLLM's prompt log-probs differ from this forward only by the rounding of other float32
    # kernels (~1e-6 per token, relative ~1e-7 in the logits), and the perplexity, exp of minus
    # the mean log-prob, moves by that mean difference: 1e-5 relative holds with room, a wrong
    # token, position or offset moves it by far more (in bfloat16, 1e-3 would be needed).
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tiny["warm"])
    model = AutoModelForCausalLM.from_pretrained(tiny["warm"], dtype=torch.float32).eval()
    total, tokens = 0.0, 0
    for r in records:
        text = tok.apply_chat_template([{"role": "user", "content": r["prompt"]}], add_generation_prompt=True,
                                       tokenize=False)
        prompt_ids = tok(text, add_special_tokens=False)["input_ids"]
        ref_ids = tok(r["reference"], add_special_tokens=False)["input_ids"][:max_new_tokens]
        ids = torch.tensor([list(prompt_ids) + ref_ids])
        with torch.no_grad():
            logp = model(input_ids=ids).logits[0, :-1].log_softmax(-1)
        total += float(logp[torch.arange(ids.shape[1] - 1), ids[0, 1:]][len(prompt_ids) - 1:].sum())
        tokens += len(ref_ids)
    assert tokens == sum(r["ref_tokens"] for r in records)  # the same tokens were scored
    assert results["perplexity"] == pytest.approx(math.exp(-total / tokens), rel=1e-5)
    values = metrics(out)
    assert values["eval/bleu"] == [(0, pytest.approx(results["bleu"], rel=1e-6))]
    assert {"eval/rouge1", "eval/rouge2", "eval/rougeL", "eval/distinct_3", "eval/pass@4/code"} <= set(values)


@pytest.mark.multirank
def test_grpo_with_code_reward_and_reward_model(tiny, tmp_path):
    """2 ranks, ZeRO-3, through torchrun: the code reward runs tiny-model
    completions in the sandbox, a reward model (a ZeRO-3 inference engine) adds its score by
    weight; the reward metrics and eval metrics land in TensorBoard. A third reward judges, in
    every batch, honest programs mixed with hostile ones (tests/helpers/hostile_programs.py,
    the quick ones): the run goes to its end, honest ones score 1 and hostile ones at most 0.2."""
    rm = make_reward_model(tiny, tmp_path / "rm")
    train = write_jsonl(tmp_path / "train.jsonl",
                        code_rows(os.path.join(tiny["data"], "train.jsonl"), 64, with_reference=False))
    held_out = write_jsonl(tmp_path / "eval.jsonl",
                           code_rows(os.path.join(tiny["data"], "eval.jsonl"), 4, with_reference=True))
    out = tmp_path / "run"
    rewards = ("[{name: code, weight: 1.0, args: {workers: 2, timeout_s: 3, sandbox: strict}, pass_threshold: 1.0}, "
               f"{{name: reward_model, weight: 0.1, args: {{path: '{rm}', batch_size: 8}}}}, "
               "{name: 'hostile_programs:HostileCode', weight: 0.1, "
               "args: {workers: 2, timeout_s: 3, sandbox: strict}}]")
    run([*torchrun(2, "-m", "megagrpo.train"), "--config", "configs/tiny_arith.yaml",
         *tiny_overrides(tiny, out), f"data.train_file={train}", f"data.eval_file={held_out}",
         "rollout.engine=hf", "grpo.max_steps=2", "grpo.per_device_train_batch_size=16",
         "checkpoint.save_hf_at_end=false", "logging.eval_steps=2", "logging.eval_num_generations=2",
         f"rewards.functions={rewards}"],
        env={"PYTHONPATH": os.pathsep.join([ROOT, os.path.join(ROOT, "tests", "helpers")])})
    values = metrics(out)
    hostile = "train/rewards/hostile_programs:HostileCode"
    # half honest (1.0), half hostile (<= 0.2 each): the mean lies in [0.5, 0.6]
    assert [s for s, _ in values[f"{hostile}/mean"]] == [1, 2], sorted(values)
    assert all(0.5 - 1e-6 <= v <= 0.6 + 1e-6 for _, v in values[f"{hostile}/mean"]), values[f"{hostile}/mean"]
    for name in ("rewards/code/mean", "rewards/code/syntax", "rewards/code/tests", "rewards/code/efficiency",
                 "rewards/code/fail/syntax_error", "rewards/code/fail/timeout", "rewards/reward_model/mean",
                 "reward"):
        assert [s for s, _ in values[f"train/{name}"]] == [1, 2], name
    code_mean = [v for _, v in values["train/rewards/code/mean"]]
    assert all(0.0 <= v <= 1.0 for v in code_mean) and max(code_mean) > 0
    assert all(v == 0 for _, v in values["train/rewards/code/fail/timeout"])
    for name in ("bleu", "rouge1", "rougeL", "perplexity", "distinct_1", "pass@1/code", "pass@2/code",
                 "rewards/code", "rewards/reward_model"):
        assert values[f"eval/{name}"], name
    history = [json.loads(line) for line in open(out / "eval_history.jsonl")]
    assert [h["step"] for h in history] == [0, 2, 2]  # before, eval_steps, after
    assert history[1]["bleu"] == pytest.approx(values["eval/bleu"][0][1], rel=1e-6)
    # the reward model's scores under ZeRO-3 on 2 ranks equal a plain forward of the same texts
    records = [json.loads(line) for line in open(out / "eval_samples" / "step_00000000.jsonl")]
    assert len(records) == 4
    prompts = [r["prompt"] for r in records for _ in r["completions"]]
    completions = [c for r in records for c in r["completions"]]
    got = [v for r in records for v in r["rewards"]["reward_model"]]
    assert got == pytest.approx(reference_scores(rm, prompts, completions), abs=1e-4)


def test_megagrpo_eval_needs_no_reward_function(tiny, tmp_path):
    """Text metrics only, on the transformers engine, output next to the model by default."""
    import shutil
    model = tmp_path / "model"
    shutil.copytree(tiny["warm"], model)
    rows = code_rows(os.path.join(tiny["data"], "eval.jsonl"), 3, with_reference=True)
    data = write_jsonl(tmp_path / "held_out.jsonl", rows)
    proc = run([f"{BIN}/megagrpo", "eval", "--model", str(model), "--data", data, "rollout.engine=hf",
                "rollout.max_new_tokens=16", "data.max_prompt_length=64"])
    results = json.load(open(model / "eval" / "eval_results.json"))
    assert not any(k.startswith(("reward", "pass@")) for k in results)
    # it says why there is no reward and how to get one, and prints no reward line
    assert "no reward functions are configured" in proc.stderr
    assert "rewards.functions=[{name: answer_match}]" in proc.stderr
    assert not any(line.split()[:1] == ["reward"] for line in proc.stdout.splitlines())
    records = [json.loads(line) for line in open(model / "eval" / "eval_samples.jsonl")]
    hyps = [r["completions"][0] for r in records]
    import sacrebleu
    assert results["bleu"] == pytest.approx(sacrebleu.corpus_bleu(hyps, [[r["reference"] for r in rows]]).score / 100)
    assert results["perplexity"] > 1.0 and 0 <= results["distinct_2"] <= 1
    proc = run([f"{BIN}/megagrpo", "eval", "--model", str(model), "--data", data, "rollout.engine=hf",
                "logging.eval_num_generations=0"], check=False)
    assert proc.returncode == 2 and "logging.eval_num_generations: 0 is below the minimum 1" in proc.stderr


def test_pass_at_k_is_left_out_for_a_continuous_reward_without_a_threshold():
    """customer-service style rewards in (0, 1): no pass@k unless a pass_threshold says what passes."""
    records = [record(i, ["a", "b"], {"cs": [0.7, 0.4], "match": [1.0, 0.0]}) for i in range(3)]
    out = summarize(records, ["cs", "match"], 2)
    assert "pass@1/cs" not in out and out["pass@1/match"] == pytest.approx(0.5) and out["rewards/cs"] == 0.55
    out = summarize(records, ["cs", "match"], 2, {"cs": 0.6})
    assert out["pass@1/cs"] == pytest.approx(0.5) and out["pass@2/cs"] == 1.0
