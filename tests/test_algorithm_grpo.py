"""The GRPO math against hand-computed values and a float64 autograd reference."""
import math

import pytest
import torch

from megagrpo.algorithm import grpo


def test_group_advantages_hand_computed():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0])
    adv = grpo.group_advantages(rewards, 4, "none")
    assert adv.tolist() == [0.5, -0.5, -0.5, 0.5, 0.0, 0.0, 0.0, 0.0]
    adv = grpo.group_advantages(rewards, 4, "group", eps=0.0)
    std = math.sqrt(1 / 3)  # unbiased std of [1, 0, 0, 1]
    assert adv[:4].tolist() == pytest.approx([0.5 / std, -0.5 / std, -0.5 / std, 0.5 / std])
    assert grpo.group_advantages(rewards, 4, "group")[4:].abs().max() == 0  # no signal, no NaN
    adv = grpo.group_advantages(rewards, 4, "batch", batch_std=torch.tensor(2.0), eps=0.0)
    assert adv.tolist() == [0.25, -0.25, -0.25, 0.25, 0.0, 0.0, 0.0, 0.0]


def test_k3_kl_hand_computed():
    logp, ref = torch.tensor([-1.0, -2.0, -0.5]), torch.tensor([-1.0, -1.0, -1.5])
    expected = [math.exp(r - p) - (r - p) - 1 for p, r in zip(logp.tolist(), ref.tolist())]
    assert grpo.k3_kl(logp, ref).tolist() == pytest.approx(expected)
    assert grpo.k3_kl(logp, ref)[0] == 0 and (grpo.k3_kl(logp, ref) >= 0).all()


def test_clipped_ratio_hand_computed():
    # ratios 1.5 (A>0, clipped high at 1.2), 0.5 (A<0, clipped low at 0.8), 1.1 (inside)
    old = torch.zeros(1, 3)
    logp = torch.log(torch.tensor([[1.5, 0.5, 1.1]]))
    tl = grpo.per_token_loss(logp, old, torch.tensor([1.0]), 0.2, 0.2)
    assert tl.loss.tolist()[0] == pytest.approx([-1.2, -0.5, -1.1])
    tl = grpo.per_token_loss(logp, old, torch.tensor([-1.0]), 0.2, 0.2)
    # A<0: -min(r*A, clip(r)*A) = max(r, clip(r)) * 1
    assert tl.loss.tolist()[0] == pytest.approx([1.5, 0.8, 1.1])
    assert tl.clipped_low.tolist()[0] == [False, True, False]
    tl = grpo.per_token_loss(logp, old, torch.tensor([1.0]), 0.2, 0.6)  # clip-higher
    assert tl.loss.tolist()[0] == pytest.approx([-1.5, -0.5, -1.1])


def test_kl_and_importance_weights_enter_loss():
    logp = torch.tensor([[-1.0, -2.0]])
    ref = torch.tensor([[-1.5, -1.0]])
    w = grpo.truncated_importance_weights(torch.tensor([[-1.0, -2.0]]), torch.tensor([[-1.2, -5.0]]), 2.0)
    assert w.tolist()[0] == pytest.approx([math.exp(0.2), 2.0])
    tl = grpo.per_token_loss(logp, logp.detach(), torch.tensor([2.0]), 0.2, 0.2, kl_coef=0.1,
                             ref_logp=ref, is_weights=w)
    kl = [math.exp(-0.5) + 0.5 - 1, math.exp(1.0) - 1.0 - 1]
    assert tl.loss.tolist()[0] == pytest.approx([-2 * w[0, 0].item() + 0.1 * kl[0], -2 * 2.0 + 0.1 * kl[1]])


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dapo", "dr_grpo"])
def test_aggregations_hand_computed(loss_type):
    token_loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    expected = {"grpo": (2.0 + 4.0) / 2, "bnpo": 10.0 / 4, "dapo": 10.0 / 4, "dr_grpo": 10.0 / (2 * 5)}
    got = grpo.aggregate(token_loss, mask, loss_type, num_sequences=2, num_tokens=4.0,
                         max_sampled_tokens=5)
    assert got.item() == pytest.approx(expected[loss_type])


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dapo", "dr_grpo"])
def test_microbatch_split_sums_to_full_batch(loss_type):
    torch.manual_seed(0)
    token_loss, mask = torch.randn(6, 5), (torch.rand(6, 5) > 0.3).float()
    norms = dict(num_sequences=6, num_tokens=float(mask.sum()), max_sampled_tokens=5)
    full = grpo.aggregate(token_loss, mask, loss_type, **norms)
    parts = sum(grpo.aggregate(token_loss[i:i + 2], mask[i:i + 2], loss_type, **norms) for i in (0, 2, 4))
    assert parts.item() == pytest.approx(full.item(), abs=1e-6)


def _reference_loss(logp, old, ref, adv, mask, eps_lo, eps_hi, beta):
    """Written out element by element in float64, independently of grpo.py."""
    total = 0.0
    for i in range(logp.shape[0]):
        seq, n = 0.0, 0.0
        for t in range(logp.shape[1]):
            if mask[i, t] == 0:
                continue
            r = torch.exp(logp[i, t] - old[i, t])
            unclipped, clipped = r * adv[i], torch.clamp(r, 1 - eps_lo, 1 + eps_hi) * adv[i]
            d = ref[i, t] - logp[i, t]
            seq = seq + (-torch.minimum(unclipped, clipped) + beta * (torch.exp(d) - d - 1))
            n += 1
        total = total + seq / n
    return total / logp.shape[0]


def test_gradients_match_float64_reference():
    torch.manual_seed(1)
    B, T = 3, 4
    logp64 = (torch.randn(B, T, dtype=torch.float64) * 0.3 - 1).requires_grad_()
    old = (logp64.detach() + 0.2 * torch.randn(B, T, dtype=torch.float64))
    ref = logp64.detach() + 0.3 * torch.randn(B, T, dtype=torch.float64)
    adv = torch.randn(B, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0]], dtype=torch.float64)
    expected = _reference_loss(logp64, old, ref, adv, mask, 0.2, 0.28, 0.05)
    (g_expected,) = torch.autograd.grad(expected, logp64)

    logp32 = logp64.detach().float().requires_grad_()
    tl = grpo.per_token_loss(logp32, old.float(), adv.float(), 0.2, 0.28, 0.05, ref.float())
    got = grpo.aggregate(tl.loss, mask.float(), "grpo", num_sequences=B, num_tokens=0,
                         max_sampled_tokens=T)
    got.backward()
    assert got.item() == pytest.approx(expected.item(), abs=1e-6)
    torch.testing.assert_close(logp32.grad.double(), g_expected, atol=1e-6, rtol=1e-5)


def test_lr_schedule_counts_optimizer_steps():
    """Warmup and cosine are sized in optimizer steps: num_iterations per training step."""
    from megagrpo.config.schema import Config
    from megagrpo.policy.models import lr_lambda
    cfg = Config()
    cfg.grpo.lr_scheduler_type, cfg.grpo.warmup_steps, cfg.grpo.num_iterations = "cosine", 2, 2
    factor = lr_lambda(cfg, total_steps=10)  # 20 optimizer steps, 4 of warmup
    assert [factor(s) for s in range(4)] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    assert factor(12) == pytest.approx(0.5 * (1 + math.cos(math.pi * 8 / 16)))
    assert factor(19) > 0 and factor(20) == pytest.approx(0.0)
