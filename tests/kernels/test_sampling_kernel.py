"""Triton one-pass sampling against torch: greedy ids, logprobs, ranks, seeds, distribution."""

import pytest
import torch

from tandem.kernels.sampling import BLOCK, sample

NEG_INF = float("-inf")


def make_logits(S, V, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    logits = 3 * torch.randn(S, V, generator=gen)
    logits[0, 17] = logits[0, V - 3] = 40.0  # a tie: the first index wins, as in torch.argmax
    logits[1, : V // 2] = NEG_INF  # banned tokens
    return logits.to(device, dtype)


def torch_logprobs(x, tokens):
    lp = torch.log_softmax(x, dim=-1).gather(1, tokens[:, None])[:, 0]
    ranks = (x > x.gather(1, tokens[:, None])).sum(dim=-1) + 1
    return lp, ranks


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_all_greedy_matches_torch(dtype, device):
    V = BLOCK + 1000  # two blocks, the second partial
    logits = make_logits(4, V, dtype, device)
    temperature = torch.ones(4, device=device)
    tokens, logprobs, ranks = sample(logits, temperature, None, None, want_ranks=True)
    x = logits.float()
    assert torch.equal(tokens, x.argmax(dim=-1))
    assert tokens[0].item() == 17
    ref_lp, ref_ranks = torch_logprobs(x, tokens)
    torch.testing.assert_close(logprobs, ref_lp, atol=1e-5, rtol=1e-5)
    assert ranks.tolist() == ref_ranks.tolist() == [1] * 4


@pytest.mark.parametrize("processed", [False, True])
def test_mixed_rows_logprobs_and_ranks(processed, device):
    S, V = 5, 3000
    logits = make_logits(S, V, torch.float32, device, seed=1)
    temperature = torch.tensor([1.0, 0.7, 1.0, 2.0, 1.0], device=device)
    greedy = torch.tensor([True, False, False, False, True], device=device)
    seeds = torch.arange(S, device=device) * 1000 + 3
    tokens, logprobs, ranks = sample(logits, temperature, greedy, seeds, processed, True)
    assert tokens[0].item() == 17 and tokens[4].item() == logits[4].argmax().item()
    assert tokens[1].item() >= V // 2  # never a banned token
    x = logits / temperature[:, None] if processed else logits
    ref_lp, ref_ranks = torch_logprobs(x, tokens)
    torch.testing.assert_close(logprobs, ref_lp, atol=1e-5, rtol=1e-5)
    assert ranks.tolist() == ref_ranks.tolist()


def test_noise_depends_on_the_rows_seed_alone(device):
    """Same seed, same logits -> same token, whatever the batch size or position (the number of
    chunks a row is cut into changes with the batch size)."""
    V = 2 * BLOCK + 5
    row = 0.3 * torch.randn(V, generator=torch.Generator().manual_seed(2)).to(device)  # flat:
    # the noise decides
    alone, _, _ = sample(row[None], torch.ones(1, device=device),
                         torch.zeros(1, dtype=torch.bool, device=device),
                         torch.tensor([12345], device=device))
    batch = make_logits(6, V, torch.float32, device, seed=3)
    batch[4] = row
    seeds = torch.tensor([1, 2, 3, 4, 12345, 6], device=device)
    mixed, _, _ = sample(batch, torch.ones(6, device=device),
                         torch.zeros(6, dtype=torch.bool, device=device), seeds)
    assert mixed[4].item() == alone[0].item()
    other, _, _ = sample(row[None], torch.ones(1, device=device),
                         torch.zeros(1, dtype=torch.bool, device=device),
                         torch.tensor([54321], device=device))
    assert other[0].item() != alone[0].item()  # a flat row: another seed, another token


def chi_square(tokens, probs, n):
    counts = torch.bincount(tokens.cpu(), minlength=probs.numel()).double()
    expected = probs.double().cpu() * n
    keep = expected > 0
    assert counts[~keep].sum() == 0  # nothing drawn where the probability is zero
    return (((counts - expected) ** 2)[keep] / expected[keep]).sum().item()


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_draws_follow_softmax(temperature, device):
    n = 2000 if device == "cuda" else 150  # the interpreter runs one program at a time
    row = torch.tensor([2.0, 1.0, 0.0, -1.0, 0.5, NEG_INF, 1.5, -0.5])
    logits = row.repeat(n, 1).to(device)
    tokens, _, _ = sample(
        logits, torch.full((n,), temperature, device=device),
        torch.zeros(n, dtype=torch.bool, device=device),
        torch.arange(n, device=device) * 7919 + 1,
    )
    # 6 degrees of freedom: P(chi2 > 25) is about 3e-4
    assert chi_square(tokens, torch.softmax(row / temperature, -1), n) < 25


@pytest.mark.gpu
def test_full_vocab_batch_on_gpu():
    """The gen-1.5b shape: 256 rows of a 151936-token vocabulary in bf16."""
    logits = (4 * torch.randn(256, 151936, device="cuda")).bfloat16()
    ones = torch.ones(256, device="cuda")
    tokens, logprobs, ranks = sample(logits, ones, None, None, want_ranks=True)
    x = logits.float()
    assert torch.equal(tokens, x.argmax(dim=-1))
    ref_lp, _ = torch_logprobs(x, tokens)
    torch.testing.assert_close(logprobs, ref_lp, atol=1e-4, rtol=1e-5)
    greedy = torch.zeros(256, dtype=torch.bool, device="cuda")
    seeds = torch.randint(0, 2**62, (256,), device="cuda")
    tokens, logprobs, ranks = sample(logits, ones, greedy, seeds, want_ranks=True)
    ref_lp, ref_ranks = torch_logprobs(x, tokens)
    torch.testing.assert_close(logprobs, ref_lp, atol=1e-4, rtol=1e-5)
    assert torch.equal(ranks.long(), ref_ranks)
    # sampled tokens are likely ones: the mean rank is far below a uniform draw's
    assert ranks.float().mean().item() < 151936 / 10


def test_draws_across_chunks_follow_softmax(device):
    """Likely tokens in different chunks of the vocabulary (the last one partial), the rest
    banned: the chunk is drawn by its mass, then the token inside it; together, softmax."""
    n = 2000 if device == "cuda" else 150
    V = 3 * BLOCK + 7
    where = [5, 100, BLOCK + 3, BLOCK + 4000, 2 * BLOCK + 1, 2 * BLOCK + 4095, 3 * BLOCK + 2, 3 * BLOCK + 6]
    values = torch.tensor([2.0, 1.0, 0.0, -1.0, 0.5, 0.3, 1.5, -0.5])
    row = torch.full((V,), NEG_INF)
    row[where] = values
    logits = row.repeat(n, 1).to(device)
    temperature = torch.full((n,), 0.8, device=device)
    tokens, logprobs, _ = sample(logits, temperature, torch.zeros(n, dtype=torch.bool, device=device),
                                 torch.arange(n, device=device) * 104729 + 11)
    probs = torch.softmax(values / 0.8, -1)
    drawn = torch.tensor([where.index(t) for t in tokens.tolist()])  # never a banned token
    # 7 degrees of freedom: P(chi2 > 27) is about 3e-4
    assert chi_square(drawn, probs, n) < 27
    ref = torch.log_softmax(values, -1)[drawn]  # logprobs of the raw logits (not processed)
    torch.testing.assert_close(logprobs.cpu(), ref, atol=1e-5, rtol=1e-5)


def test_chunk_masses_decide_the_draw(device):
    """Every column likely, chunks of unequal total mass: the chunk a token falls in follows
    the chunks' shares of the softmax (the first level of the draw, which uses one uniform)."""
    n = 2000 if device == "cuda" else 150
    V = 4 * BLOCK
    gen = torch.Generator().manual_seed(5)
    row = torch.randn(V, generator=gen) + torch.tensor([1.0, 0.0, -0.7, 0.4]).repeat_interleave(BLOCK)
    tokens, _, _ = sample(row.repeat(n, 1).to(device), torch.ones(n, device=device),
                          torch.zeros(n, dtype=torch.bool, device=device),
                          torch.arange(n, device=device) * 7 + 3)
    shares = torch.softmax(row.double(), -1).view(4, BLOCK).sum(-1)
    # 3 degrees of freedom: P(chi2 > 21) is about 1e-4
    assert chi_square(tokens.cpu() // BLOCK, shares, n) < 21
