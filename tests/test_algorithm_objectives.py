"""The objectives against TRL 1.16's GRPOTrainer, on identical inputs, in float64.

Our loss is algorithm/loss.py's micro_batch_loss. TRL's is GRPOTrainer._compute_loss itself,
called on a stand-in for the trainer that holds the same settings and returns the given
log-probs and entropies where TRL would run the model (everything after that is TRL's code).
Loss and gradient (with respect to the policy log-probs) must agree within 1e-6, except where
our definition differs on purpose; those tests show the difference (docs/objectives.md)."""
import types
from collections import defaultdict

import pytest
import torch
from trl.trainer import grpo_trainer as trl_trainer  # the test extras install it: a failed import fails

from megagrpo.algorithm import grpo
from megagrpo.algorithm.loss import LossInputs, micro_batch_loss
from megagrpo.config.schema import GRPOConfig
from megagrpo.config.validation import check_objective

B, T = 6, 9


class _Accelerator:
    """One process: TRL's cross-process reductions are identities."""
    num_processes, sync_gradients = 1, True

    def gather(self, x):
        return x

    gather_for_metrics = gather

    def reduce(self, x, reduction="sum"):
        return x

    def pad_across_processes(self, x, dim=0, pad_index=0):
        return x


def _inputs(seed=0):
    gen = torch.Generator().manual_seed(seed)
    mask = torch.ones(B, T, dtype=torch.float64)
    for row, length in enumerate([9, 7, 5, 9, 3, 8]):
        mask[row, length:] = 0
    logp = (-torch.rand(B, T, generator=gen, dtype=torch.float64) * 3).requires_grad_()
    return {
        "logp": logp,
        "entropy": (torch.rand(B, T, generator=gen, dtype=torch.float64) * 2).requires_grad_(),
        "old": logp.detach() + torch.randn(B, T, generator=gen, dtype=torch.float64) * 0.3,
        "ref": logp.detach() + torch.randn(B, T, generator=gen, dtype=torch.float64) * 0.2,
        "sampler": logp.detach() + torch.randn(B, T, generator=gen, dtype=torch.float64) * 0.1,
        "advantages": torch.tensor([1.2, -0.7, 0.3, -1.5, 0.9, -0.2], dtype=torch.float64),
        "mask": mask,
    }


def ours(g: GRPOConfig, x: dict, sampler_weight: bool = True, rows=None, num_tokens=None) -> torch.Tensor:
    """Our loss of rows (default all) with the step's normalisers; the sampler correction
    comes from the sampler log-probs (none when sampler_weight is False)."""
    check_objective(g)
    if not sampler_weight:
        g.importance_sampling_correction = "none"
    rows = list(range(B)) if rows is None else rows
    inputs = LossInputs(x["mask"][rows], x["advantages"][rows], x["sampler"][rows], x["old"][rows], x["ref"][rows])
    normalisers = {"num_sequences": B, "num_tokens": float(x["mask"].sum()) if num_tokens is None else num_tokens,
                   "max_sampled_tokens": T}
    return micro_batch_loss(g, x["logp"][rows], x["entropy"][rows], inputs, normalisers, 1.0, None)


def trl_importance_ratio(x: dict, mode: str, cap: float) -> torch.Tensor:
    """TRL's vLLM importance-sampling ratio (GRPOTrainer._generate_and_score_completions, which
    computes it inline), restated: per-token or summed per-sequence log differences, then
    truncated at clip_max or masked beyond it."""
    diff = (x["old"] - x["sampler"]) * x["mask"]
    if mode.startswith("sequence"):
        diff = diff.sum(dim=-1, keepdim=True)
    ratio = torch.exp(diff)
    if mode.endswith("truncate"):
        return torch.clamp(ratio, min=None, max=cap)
    return ratio.masked_fill(ratio > cap, 0.0)


def trl(g: GRPOConfig, x: dict, importance_ratio=None, rows=None, grad_accum: int = 1,
        cispo_cap=None) -> torch.Tensor:
    """TRL's _compute_loss with the settings of g."""
    rows = list(range(B)) if rows is None else rows
    logp, entropy = x["logp"][rows], x["entropy"][rows]
    epsilon_high = g.epsilon_high if g.epsilon_high is not None else g.epsilon
    args = types.SimpleNamespace(use_bias_correction_kl=g.use_bias_correction_kl, delta=g.delta,
                                 sapo_temperature_pos=g.sapo_temperature_pos,
                                 sapo_temperature_neg=g.sapo_temperature_neg, steps_per_generation=grad_accum)
    fake = types.SimpleNamespace(
        args=args, accelerator=_Accelerator(), model=types.SimpleNamespace(training=True),
        aux_loss_enabled=False, top_entropy_quantile=g.top_entropy_quantile,
        off_policy_mask_threshold=g.off_policy_mask_threshold, importance_sampling_level=g.importance_sampling_level,
        beta=g.kl_coef, loss_type=g.loss_type, epsilon_low=g.epsilon,
        epsilon_high=cispo_cap if cispo_cap is not None else epsilon_high,
        use_vllm=importance_ratio is not None, vllm_importance_sampling_correction=importance_ratio is not None,
        current_gradient_accumulation_steps=grad_accum, max_completion_length=T,
        _entropy_bonus_enabled=g.entropy_coef != 0, entropy_coef=g.entropy_coef, use_adaptive_entropy=False,
        _metrics=defaultdict(lambda: defaultdict(list)),
        get_off_policy_mask=trl_trainer.GRPOTrainer.get_off_policy_mask,
        _get_per_token_logps_and_entropies=lambda *a, **k: (logp, entropy, None))
    fake.get_high_entropy_mask = types.MethodType(trl_trainer.GRPOTrainer.get_high_entropy_mask, fake)
    mask = x["mask"][rows]
    inputs = {"prompt_ids": torch.zeros(len(rows), 1, dtype=torch.long), "prompt_mask": torch.ones(len(rows), 1),
              "completion_ids": torch.zeros(len(rows), T, dtype=torch.long), "completion_mask": mask,
              "advantages": x["advantages"][rows], "old_per_token_logps": x["old"][rows],
              "ref_per_token_logps": x["ref"][rows], "sampling_per_token_logps": x["sampler"][rows],
              "num_items_in_batch": x["mask"].sum()}
    if importance_ratio is not None:
        inputs["importance_sampling_ratio"] = importance_ratio[rows]
    return trl_trainer.GRPOTrainer._compute_loss(fake, None, inputs)


def _grad(loss: torch.Tensor, x: dict) -> torch.Tensor:
    """The gradient with respect to the policy's log-probs and entropies, side by side."""
    x["logp"].grad = x["entropy"].grad = None
    loss.backward()
    entropy_grad = x["entropy"].grad if x["entropy"].grad is not None else torch.zeros_like(x["logp"])
    return torch.cat([x["logp"].grad, entropy_grad], dim=1)


def _assert_equal(ours_loss, trl_loss, x):
    ours_grad, trl_grad = _grad(ours_loss, x), _grad(trl_loss, x)
    assert float(ours_loss.detach()) == pytest.approx(float(trl_loss.detach()), abs=1e-6)
    assert torch.allclose(ours_grad, trl_grad, atol=1e-6, rtol=0), (ours_grad - trl_grad).abs().max()
    assert ours_grad.abs().sum() > 0


CASES = {
    "grpo": {"loss_type": "grpo"},
    "dapo": {"loss_type": "dapo", "epsilon_high": 0.28},
    "dr_grpo": {"loss_type": "dr_grpo"},
    "sapo": {"loss_type": "sapo", "sapo_temperature_pos": 0.8, "sapo_temperature_neg": 1.3},
    "gspo": {"loss_type": "grpo", "importance_sampling_level": "sequence", "epsilon": 3e-4, "epsilon_high": 4e-4},
    "gspo_sapo": {"loss_type": "sapo", "importance_sampling_level": "sequence"},
    "delta": {"loss_type": "grpo", "delta": 1.5},
    "delta_dapo": {"loss_type": "dapo", "delta": 1.4, "epsilon_high": 0.28},
    "entropy_quantile": {"loss_type": "dapo", "top_entropy_quantile": 0.2},
    "off_policy_mask": {"loss_type": "grpo", "off_policy_mask_threshold": 0.05},
    "no_kl": {"loss_type": "dapo", "kl_coef": 0.0},
    "entropy_bonus": {"loss_type": "dapo", "entropy_coef": 0.01},
    "entropy_bonus_grpo": {"loss_type": "grpo", "entropy_coef": 0.05},
    "kl_without_bias_correction": {"loss_type": "grpo", "use_bias_correction_kl": False},
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_loss_and_gradient_equal_trl(case):
    g = GRPOConfig(**{"kl_coef": 0.05, **CASES[case]})
    x = _inputs(seed=len(case))
    _assert_equal(ours(g, x, sampler_weight=False), trl(g, x), x)


@pytest.mark.parametrize("mode", ["token_truncate", "sequence_truncate", "sequence_mask"])
def test_sampler_correction_modes_equal_trl(mode):
    g = GRPOConfig(kl_coef=0.05, loss_type="dapo", importance_sampling_correction=mode, importance_sampling_cap=1.3)
    x = _inputs(seed=7)
    ratio = trl_importance_ratio(x, mode, 1.3)
    weights = grpo.importance_weights(x["old"], x["sampler"], x["mask"], mode, 1.3)
    assert weights.shape == ratio.shape and float(((weights - ratio) * x["mask"]).abs().max()) == 0  # padding aside
    if mode == "sequence_mask":
        assert 0 < int((ratio == 0).sum()) < B  # some sequences left out, not all
    _assert_equal(ours(g, x), trl(g, x, importance_ratio=ratio), x)


def test_cispo_caps_the_weight_at_one_plus_epsilon_high():
    """Ours caps at 1 + epsilon_high (as the clip range of the other objectives reads); TRL's
    epsilon_high is the cap itself: the same objective with TRL's epsilon_high = 1 + ours."""
    g = GRPOConfig(kl_coef=0.05, loss_type="cispo", epsilon_high=0.25)
    x = _inputs(seed=3)
    _assert_equal(ours(g, x, sampler_weight=False), trl(g, x, cispo_cap=1.25), x)
    assert float(ours(g, x, sampler_weight=False).detach()) != pytest.approx(float(trl(g, x).detach()), abs=1e-6)


def test_bnpo_divides_by_the_step_tokens_trl_by_each_micro_batch():
    """One micro-batch: equal. Two: our shares sum to the one-batch loss and gradient (the
    step's token count divides every micro-batch); TRL's micro-batch means do not."""
    g = GRPOConfig(kl_coef=0.05, loss_type="bnpo")
    x = _inputs(seed=5)
    _assert_equal(ours(g, x, sampler_weight=False), trl(g, x), x)
    halves = [[0, 1, 2], [3, 4, 5]]
    whole = ours(g, x, sampler_weight=False)
    whole_grad = _grad(whole, x)
    split = sum(ours(g, x, sampler_weight=False, rows=rows) for rows in halves)
    assert float(split.detach()) == pytest.approx(float(whole.detach()), abs=1e-12)
    assert torch.allclose(_grad(split, x), whole_grad, atol=1e-12)
    trl_split = sum(trl(g, x, rows=rows, grad_accum=2) for rows in halves)
    assert abs(float(trl_split.detach()) - float(whole.detach())) > 1e-3  # the micro-batches' token counts differ


def test_kl_bias_correction_changes_the_gradient_not_the_value_on_policy():
    """On-policy (old = current) the ratio is 1: the loss value is the same with and without
    the correction, the gradient is not (it gains k3 x grad log pi)."""
    x = _inputs(seed=11)
    x["old"] = x["logp"].detach().clone()
    on, off = (GRPOConfig(kl_coef=0.1, loss_type="grpo", use_bias_correction_kl=flag) for flag in (True, False))
    loss_on, loss_off = ours(on, x, sampler_weight=False), ours(off, x, sampler_weight=False)
    assert float(loss_on.detach()) == pytest.approx(float(loss_off.detach()), abs=1e-12)
    assert (_grad(loss_on, x) - _grad(loss_off, x)).abs().max() > 1e-4


def test_objective_combinations_are_checked():
    from megagrpo.config.schema import ConfigError
    for bad, message in [({"importance_sampling_level": "sequence", "loss_type": "dapo"}, "use grpo.loss_type=grpo"),
                         ({"delta": 1.1}, "must be above 1 + epsilon_high"),
                         ({"delta": 3.0, "loss_type": "cispo"}, "not loss_type cispo"),
                         ({"top_entropy_quantile": 0.0}, "must be in (0, 1]"),
                         ({"sapo_temperature_neg": 0.0}, "must be > 0")]:
        with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)").replace("+", r"\+")):
            check_objective(GRPOConfig(**bad))


def test_dynamic_sampling_keeps_informative_groups_and_their_details():
    from megagrpo.algorithm.dynamic_sampling import DynamicSampling
    from megagrpo.rewards import Rewards
    from megagrpo.stack import SampledGroups

    def round_of(rewards, tag):
        n = len(rewards)
        scored = Rewards(torch.tensor(rewards), torch.tensor(rewards)[:, None],
                         {"f/x": torch.tensor(rewards) * 10}, {"f": [tag] * n})
        return SampledGroups([f"{tag}p{i // 2}" for i in range(n)], [f"{tag}c{i}" for i in range(n)],
                             [f"{tag}t{i}" for i in range(n)], scored, 2)

    def run(rounds_given, share, max_rounds, enabled=True):
        rounds = DynamicSampling(share, max_rounds, enabled=enabled)
        while rounds.wants_more():
            rounds.add(rounds_given[rounds.count])
        return rounds.count, *rounds.result()

    rounds = [round_of([1.0, 1.0, 0.0, 1.0, 0.0, 0.0], "a"), round_of([0.0, 0.0, 1.0, 0.0], "b"),
              round_of([0.5, 0.0, 0.0, 0.0], "c")]
    count, kept, metrics = run(rounds, share=2, max_rounds=3)
    assert count == 2  # the second round filled the share; no third
    assert kept.completions == ["ac2", "ac3", "bc2", "bc3"] and kept.prompts == ["ap1", "ap1", "bp1", "bp1"]
    assert kept.rewards.total.tolist() == [0.0, 1.0, 1.0, 0.0] and kept.rewards.per_function.shape == (4, 1)
    assert kept.rewards.components["f/x"].tolist() == [0.0, 10.0, 10.0, 0.0]
    assert kept.rewards.reasons["f"] == ["a", "a", "b", "b"]
    assert metrics == {"sampling/rounds": 2, "sampling/groups_sampled": 5.0,
                       "sampling/groups_informative": 2.0, "sampling/groups_kept": 2.0}
    count, none, metrics = run([round_of([1.0, 1.0], "z")] * 2, share=1, max_rounds=2)
    assert count == 2 and none.num_groups == 1 and metrics["sampling/groups_informative"] == 0  # no advantage
    # without dynamic sampling: one round, taken whole (its uninformative groups too), no metrics
    count, whole, metrics = run(rounds, share=2, max_rounds=3, enabled=False)
    assert (count, whole.completions, metrics) == (1, rounds[0].completions, {})


@pytest.mark.multirank
def test_moving_reference_mixes_partition_by_partition_on_two_zero3_ranks(tiny, tmp_path):
    """Every 2 steps the reference becomes 0.5 x policy + 0.5 x reference (ZeRO-3, 2 ranks,
    each rank mixing its own partitions); in between it stays as it was."""
    from conftest import ROOT, run, tiny_overrides, torchrun
    out = tmp_path / "ref"
    run([*torchrun(2, "tests/helpers/reference_probe.py"),
         "--config", "configs/tiny_arith.yaml",
         *tiny_overrides(tiny, out, **{"data.eval_file": "null", "grpo.per_device_train_batch_size": 16,
                                       "grpo.learning_rate": 1e-3, "grpo.sync_ref_model": "true",
                                       "grpo.ref_model_sync_steps": 2, "grpo.ref_model_mixup_alpha": 0.5})],
        env={"PYTHONPATH": ROOT})
    records = torch.load(out / "reference_probe.pt", weights_only=True)
    for step in (1, 2, 3):
        before, now = records[step - 1]["reference"], records[step]["reference"]
        policy = records[step]["policy"]
        for name in now:
            expected = 0.5 * policy[name] + 0.5 * before[name] if step % 2 == 0 else before[name]
            torch.testing.assert_close(now[name], expected, atol=1e-6, rtol=0, msg=f"step {step} {name}")
    moved = max((records[2]["reference"][k] - records[0]["reference"][k]).abs().max() for k in records[0]["reference"])
    assert moved > 1e-4


@pytest.mark.parametrize("case", sorted(set(CASES) - {"entropy_quantile"}) + ["cispo", "sequence_mask"])
def test_any_micro_batch_split_gives_the_same_loss_and_gradient(case):
    """The step's normalisers make the shares of any split sum to the one-batch loss and
    gradient, for every objective (the entropy quantile is taken per micro-batch, so it is the
    exception, as in TRL)."""
    settings = {"cispo": {"loss_type": "cispo", "entropy_coef": 0.02},
                "sequence_mask": {"loss_type": "dapo", "importance_sampling_correction": "sequence_mask",
                                  "importance_sampling_cap": 1.3}}.get(case, CASES.get(case))
    g = GRPOConfig(**{"kl_coef": 0.05, **settings})
    x = _inputs(seed=21)
    whole = ours(g, x)
    whole_grad = _grad(whole, x)
    for split in ([[0, 1, 2], [3, 4, 5]], [[0], [1, 2, 3, 4], [5]]):
        parts = sum(ours(g, x, rows=rows) for rows in split)
        assert float(parts.detach()) == pytest.approx(float(whole.detach()), abs=1e-12), split
        assert torch.allclose(_grad(parts, x), whole_grad, atol=1e-12), split
