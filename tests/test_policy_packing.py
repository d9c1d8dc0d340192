"""Packed vs padded and fused vs naive through the real model; token-budget micro-batches vs
one big batch. The tiny Qwen2 model in float32, sequences of very different lengths."""
import pytest
import torch
from transformers import AutoModelForCausalLM

from megagrpo.algorithm import grpo
from megagrpo.policy.batch import Completion, make_batch
from megagrpo.policy.logprobs import completion_logprobs, install_logprob_head
from megagrpo.policy.packing import balanced_microbatches, pack

PATHS = [(True, True), (True, False), (False, True), (False, False)]  # (packing, fused)


def _model(path, seed=0):
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    install_logprob_head(model, chunk_size=7)  # a chunk size that divides nothing here
    return model


def _batch(lengths, vocab, seed=0):
    gen = torch.Generator().manual_seed(seed)
    prompts, completions = [], []
    for prompt_len, completion_len in lengths:
        prompts.append(torch.randint(3, vocab, (prompt_len,), generator=gen).tolist())
        ids = torch.randint(3, vocab, (completion_len,), generator=gen).tolist()
        completions.append(Completion(ids, [-1.0] * completion_len, False))
    advantages = torch.randn(len(lengths), generator=gen)
    return make_batch(prompts, completions, advantages, pad_id=0)


LENGTHS = [(3, 1), (17, 40), (5, 3), (30, 90), (9, 12), (2, 60)]


def test_pack_indexes_completion_tokens():
    packed = pack([[1, 2], [3]], [[7, 8, 9], [4]])
    assert packed.input_ids.tolist() == [[1, 2, 7, 8, 9, 3, 4]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 3, 4, 0, 1]]
    assert packed.predict_at.tolist() == [1, 2, 3, 5] and packed.targets.tolist() == [7, 8, 9, 4]
    assert packed.rows.tolist() == [0, 0, 0, 1] and packed.cols.tolist() == [0, 1, 2, 0]
    # rows no longer than the longest sequence (the SDPA layout): first fit, longest first
    packed = pack([[1, 2], [3], [5]], [[7, 8, 9], [4], [6, 6]], row_tokens=5)
    assert packed.input_ids.tolist() == [[1, 2, 7, 8, 9], [3, 4, 5, 6, 6]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 3, 4], [0, 1, 0, 1, 2]]
    assert packed.predict_at.tolist() == [1, 2, 3, 5, 7, 8] and packed.rows.tolist() == [0, 0, 0, 1, 2, 2]
    packed = pack([[1], [3]], [[7, 8, 9], [4]], row_tokens=4)  # a padded row: its own block
    assert packed.input_ids.tolist() == [[1, 7, 8, 9], [3, 4, 0, 0]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 3], [0, 1, 0, 1]]


def test_balanced_microbatches():
    lengths = [1000, 10, 300, 300, 290, 20, 500, 5]
    groups = balanced_microbatches(lengths, max_tokens=1024)
    assert sorted(i for g in groups for i in g) == list(range(8))
    loads = [sum(lengths[i] for i in g) for g in groups]
    assert len(groups) == 3 and max(loads) <= 1024 and max(loads) - min(loads) <= 500
    assert balanced_microbatches([5000, 10], max_tokens=1024) == [[0], [1]]  # too long: alone
    assert balanced_microbatches([10, 10], 1024, min_count=3) == [[0], [1], []]


def test_all_paths_give_the_same_logprobs_and_gradients(tiny):
    model = _model(tiny["model"])
    batch = _batch(LENGTHS, model.config.vocab_size)
    results = {}
    for packing, fused in PATHS:
        model.zero_grad()
        logp, entropy = completion_logprobs(model, batch, 0.7, packing=packing, fused=fused)
        (logp * batch.completion_mask * torch.linspace(-1, 1, logp.shape[1])).sum().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        results[(packing, fused)] = (logp * batch.completion_mask, entropy, grads)
    ref_logp, ref_entropy, ref_grads = results[(False, False)]
    assert ref_logp.abs().sum() > 0
    for key, (logp, entropy, grads) in results.items():
        torch.testing.assert_close(logp, ref_logp, atol=1e-5, rtol=0, msg=str(key))
        torch.testing.assert_close(entropy, ref_entropy, atol=1e-5, rtol=0, msg=str(key))
        for name, grad in grads.items():
            torch.testing.assert_close(grad, ref_grads[name], atol=1e-5, rtol=1e-4, msg=f"{key} {name}")


def _grpo_loss(model, batch, rows, loss_type, normalisers, packing=True):
    mb = batch.select(rows)
    logp, _ = completion_logprobs(model, mb, 1.0, packing=packing, fused=True)
    old = logp.detach() + 0.3 * torch.cos(mb.completion_ids.float())  # ratio != 1: clipping on
    ref = logp.detach() - 0.1
    token = grpo.per_token_loss(logp, old, mb.advantages, 0.2, 0.28, 0.04, ref)
    return grpo.aggregate(token.loss, mb.completion_mask, loss_type, **normalisers)


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dapo", "dr_grpo"])
def test_token_budget_split_equals_one_batch(tiny, loss_type):
    model = _model(tiny["model"])
    batch = _batch(LENGTHS, model.config.vocab_size, seed=1)
    normalisers = {"num_sequences": len(batch), "num_tokens": float(batch.completion_mask.sum()),
                   "max_sampled_tokens": 90}
    everything = list(range(len(batch)))
    _grpo_loss(model, batch, everything, loss_type, normalisers).backward()
    whole = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    groups = balanced_microbatches(batch.token_counts(), max_tokens=80)
    assert len(groups) >= 4
    for rows in groups:
        _grpo_loss(model, batch, rows, loss_type, normalisers).backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, whole[name], atol=1e-5, rtol=1e-4, msg=name)


def test_packed_and_padded_updates_are_identical(tiny):
    """One optimizer step from the same start with the packed and the padded pass. SGD: Adam's
    first step is lr * sign(grad), which turns float rounding on near-zero gradients into
    lr-sized differences and would test nothing about the passes."""
    params = {}
    for packing in (True, False):
        model = _model(tiny["model"])
        batch = _batch(LENGTHS, model.config.vocab_size, seed=2)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        normalisers = {"num_sequences": len(batch), "num_tokens": float(batch.completion_mask.sum()),
                       "max_sampled_tokens": 90}
        _grpo_loss(model, batch, list(range(len(batch))), "dapo", normalisers, packing).backward()
        optimizer.step()
        params[packing] = {n: p.detach().clone() for n, p in model.named_parameters()}
    start = _model(tiny["model"])
    moved = max((params[True][n] - p).abs().max().item() for n, p in start.named_parameters())
    assert moved > 1e-4
    for name, value in params[True].items():
        torch.testing.assert_close(value, params[False][name], atol=1e-5, rtol=0, msg=name)
