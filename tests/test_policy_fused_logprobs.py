"""The chunked log-prob/entropy function against the full-logits reference, and its backward
against float64 finite differences."""
import pytest
import torch

from megagrpo.policy.fused_logprobs import fused_token_logprobs, naive_token_logprobs


def make_inputs(N, H, V, dtype=torch.float32, scale=1.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, H, generator=g)
    weight = torch.randn(V, H, generator=g) * scale / H ** 0.5
    targets = torch.randint(0, V, (N,), generator=g)
    token_w = torch.randn(N, generator=g) * (torch.arange(N) % 3 != 2)  # zeros: masked tokens
    return (hidden.to(dtype).requires_grad_(), weight.to(dtype).requires_grad_(), targets, token_w)


def run(fn, hidden, weight, targets, token_w, **kw):
    """logp, entropy, loss = sum(logp * token_w), d loss / d hidden, d loss / d weight."""
    hidden.grad = weight.grad = None
    logp, entropy = fn(hidden, weight, targets, with_entropy=True, **kw)
    loss = (logp * token_w).sum()
    loss.backward()
    return logp.detach(), entropy.detach(), loss.detach(), hidden.grad.clone(), weight.grad.clone()


@pytest.mark.parametrize("N,H,V,chunk", [
    (1, 8, 11, 16),      # N < chunk
    (7, 8, 50, 1),       # one token per chunk
    (7, 32, 257, 16),
    (64, 32, 257, 16),   # chunk divides N
    (300, 8, 50, 100),   # chunk divides N, several chunks
    (300, 32, 257, 16),  # chunk does not divide N
    (300, 32, 11, 1024),
])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_matches_naive_float32(N, H, V, chunk, temperature):
    inputs = make_inputs(N, H, V, scale=3.0)
    fused = run(fused_token_logprobs, *inputs, temperature=temperature, chunk_size=chunk)
    naive = run(naive_token_logprobs, *inputs, temperature=temperature)
    for name, f, n in zip(["logp", "entropy", "loss", "grad_hidden", "grad_weight"], fused, naive):
        assert f.dtype == n.dtype == torch.float32, name
        torch.testing.assert_close(f, n, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")
    assert fused[0].max() < 0 and fused[1].min() > 0
    assert fused[4].abs().max() > 1e-3  # the comparison above is not between zeros


def test_temperature_changes_result():
    inputs = make_inputs(20, 8, 50, scale=3.0)
    hot = run(fused_token_logprobs, *inputs, temperature=2.0, chunk_size=7)
    cold = run(fused_token_logprobs, *inputs, temperature=0.5, chunk_size=7)
    assert hot[1].mean() > cold[1].mean() + 0.1  # higher temperature, higher entropy
    assert not torch.allclose(hot[3], cold[3])


def test_bfloat16_close_to_float32_reference():
    hidden, weight, targets, token_w = make_inputs(300, 32, 257, dtype=torch.bfloat16)
    fused = run(fused_token_logprobs, hidden, weight, targets, token_w, temperature=0.8,
                chunk_size=64)
    ref_hidden, ref_weight = (t.detach().float().requires_grad_() for t in (hidden, weight))
    naive = run(naive_token_logprobs, ref_hidden, ref_weight, targets, token_w, temperature=0.8)
    assert fused[0].dtype == fused[1].dtype == torch.float32
    assert fused[3].dtype == fused[4].dtype == torch.bfloat16
    for name, f, n in zip(["logp", "entropy", "loss", "grad_hidden", "grad_weight"], fused, naive):
        torch.testing.assert_close(f.float(), n, rtol=2e-2, atol=2e-2, msg=lambda m: f"{name}: {m}")


def test_gradcheck_float64():
    hidden, weight, targets, _ = make_inputs(7, 4, 9, dtype=torch.float64, scale=2.0)
    def logp(h, w):
        return fused_token_logprobs(h, w, targets, temperature=0.7, chunk_size=3)[0]
    assert torch.autograd.gradcheck(logp, (hidden, weight))


@pytest.mark.parametrize("chunk", [1, 16, 1024])
def test_entropy_gradient_matches_naive(chunk):
    """The entropy bonus's gradient through the fused head (dH/dz = -p (log p + H) / T), with
    and next to the log-probs' own, against autograd through the full logits."""
    hidden, weight, targets, token_w = make_inputs(40, 16, 97, scale=3.0)
    entropy_w = torch.randn(40, generator=torch.Generator().manual_seed(1))
    grads = []
    for fn, kw in ((fused_token_logprobs, {"chunk_size": chunk}), (naive_token_logprobs, {})):
        hidden.grad = weight.grad = None
        logp, entropy = fn(hidden, weight, targets, temperature=0.7, with_entropy=True, **kw)
        ((logp * token_w).sum() + (entropy * entropy_w).sum()).backward()
        grads.append((hidden.grad.clone(), weight.grad.clone()))
    for f, n in zip(*grads):
        torch.testing.assert_close(f, n, rtol=1e-5, atol=1e-5)
    hidden.grad = weight.grad = None
    logp, _ = fused_token_logprobs(hidden, weight, targets, temperature=0.7, chunk_size=chunk, with_entropy=True)
    (logp * token_w).sum().backward()
    assert (hidden.grad - grads[0][0]).abs().max() > 1e-3  # the entropy term made a difference


def test_entropy_gradcheck_float64():
    hidden, weight, targets, _ = make_inputs(7, 4, 9, dtype=torch.float64, scale=2.0)

    def entropy(h, w):
        return fused_token_logprobs(h, w, targets, temperature=0.7, chunk_size=3, with_entropy=True)[1]
    assert torch.autograd.gradcheck(entropy, (hidden, weight))


def test_keeps_no_logits_for_backward():
    N, H, V = 64, 8, 257
    hidden, weight, targets, _ = make_inputs(N, H, V)
    logp, _ = fused_token_logprobs(hidden, weight, targets, chunk_size=16)
    node = logp.grad_fn.next_functions[0][0]  # under the view to the targets' shape
    saved = sum(t.numel() for t in node.saved_tensors)
    assert saved == N * H + V * H + N + N  # hidden, weight, targets, logsumexp (no entropy asked)
    logp, entropy = fused_token_logprobs(hidden, weight, targets, chunk_size=16, with_entropy=True)
    node = logp.grad_fn.next_functions[0][0]
    assert sum(t.numel() for t in node.saved_tensors) == N * H + V * H + 3 * N  # and the entropy


def test_leading_dims_frozen_weight_and_no_grad():
    hidden, weight, targets, _ = make_inputs(12, 8, 50)
    weight.requires_grad_(False)
    logp, entropy = fused_token_logprobs(hidden.view(3, 4, 8), weight, targets.view(3, 4),
                                         chunk_size=5, with_entropy=True)
    assert logp.shape == entropy.shape == (3, 4)
    logp.sum().backward()
    ref, _ = naive_token_logprobs(hidden.detach().requires_grad_(), weight, targets)
    torch.testing.assert_close(logp.detach().view(-1), ref.detach(), rtol=1e-5, atol=1e-5)
    assert hidden.grad.shape == (12, 8) and weight.grad is None
    with torch.no_grad():  # reference / old policy log-probs
        again, none = fused_token_logprobs(hidden, weight, targets, chunk_size=5)
    assert none is None and not again.requires_grad
    torch.testing.assert_close(again, logp.detach().view(-1))
