"""The trainer's log-probabilities: the fused fp32 head against plain torch, the right-padded
layout against unpadded rows, and the sampling filter against the engine's sampler."""

from __future__ import annotations

import pytest
import torch

from tandem.layers.sampler import Sampler, SamplingMetadata
from tandem.rl.logprobs import SamplingFilter, completion_logps, head_logprobs
from tandem.rl.rollout import Rollout, pack


def naive_logps(h, w, t, temperature=1.0, filt=None):
    x = (h.float() @ w.float().t()) / temperature
    if filt is not None:
        kept = naive_kept(x, filt)
        kept[torch.arange(len(t)), t] = True
        x = x.masked_fill(~kept, float("-inf"))
    return torch.log_softmax(x, -1).gather(1, t[:, None]).squeeze(1)


def naive_kept(x, filt):
    """top-k, then top-p over what is left, then min-p, written out row by row (vLLM semantics)."""
    kept = torch.ones_like(x, dtype=torch.bool)
    for r in range(x.shape[0]):
        order = torch.argsort(x[r], descending=True)
        if filt.top_k:
            kept[r, order[filt.top_k:]] = False
        if filt.top_p < 1.0:
            probs = torch.softmax(x[r].masked_fill(~kept[r], float("-inf")), -1)[order]
            before = torch.cumsum(probs, 0) - probs  # mass of the tokens ranked above
            kept[r, order[before >= filt.top_p]] = False
        if filt.min_p:
            probs = torch.softmax(x[r].masked_fill(~kept[r], float("-inf")), -1)
            kept[r] &= probs >= filt.min_p * probs.max()
    return kept


@pytest.mark.parametrize("chunk_size", [1, 3, None])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_head_logprobs_forward_and_backward_match_torch(chunk_size, temperature):
    torch.manual_seed(0)
    h = torch.randn(10, 16, requires_grad=True)
    w = torch.randn(37, 16, requires_grad=True)
    t = torch.randint(0, 37, (10,))
    g = torch.randn(10)
    got = head_logprobs(h, w, t, temperature, chunk_size=chunk_size)
    assert got.dtype == torch.float32
    (got * g).sum().backward()
    gh, gw = h.grad.clone(), w.grad.clone()
    h.grad = w.grad = None
    want = naive_logps(h, w, t, temperature)
    (want * g).sum().backward()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gh, h.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gw, w.grad, rtol=1e-5, atol=1e-5)


def test_head_logprobs_bf16_scores_the_rounded_inputs_in_fp32():
    """What the engine's bf16 copy computes: bf16 hidden and weight, fp32 logits (not rounded)."""
    torch.manual_seed(0)
    h, w = torch.randn(6, 32) * 3, torch.randn(50, 32)
    t = torch.randint(0, 50, (6,))
    got = head_logprobs(h, w, t, dtype=torch.bfloat16)
    want = naive_logps(h.bfloat16(), w.bfloat16(), t)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    rounded = naive_logps((h.bfloat16().float() @ w.bfloat16().float().t()).bfloat16(), torch.eye(50), t)
    assert (got - rounded).abs().max() > 1e-3  # bf16 logits would have been a different number


@pytest.mark.parametrize("filt", [SamplingFilter(top_k=5), SamplingFilter(top_p=0.8),
                                  SamplingFilter(top_k=20, top_p=0.8), SamplingFilter(min_p=0.1),
                                  SamplingFilter(top_k=8, top_p=0.9, min_p=0.05)])
def test_sampling_filter_renormalises_over_the_kept_set(filt):
    torch.manual_seed(0)
    h = torch.randn(12, 16, requires_grad=True)
    w = torch.randn(40, 16)
    t = torch.randint(0, 40, (12,))
    got = head_logprobs(h, w, t, 0.9, sampling=filt, chunk_size=5)
    want = naive_logps(h, w, t, 0.9, filt)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    got.sum().backward()
    gh = h.grad.clone()
    h.grad = None
    want.sum().backward()
    torch.testing.assert_close(gh, h.grad, rtol=1e-5, atol=1e-5)


def test_sampling_filter_equals_the_engine_samplers_processed_logprobs():
    """The trainer's filtered logprob of a token is the engine sampler's processed_logprobs."""
    torch.manual_seed(0)
    S, V = 64, 50
    logits = torch.randn(S, V) * 2
    filt = SamplingFilter(top_k=20, top_p=0.8)
    meta = SamplingMetadata(
        temperature=torch.full((S,), 0.9), greedy=torch.zeros(S, dtype=torch.bool), all_greedy=False,
        top_k=torch.full((S,), 20), top_p=torch.full((S,), 0.8), min_p=None, generators={},
        max_num_logprobs=0, processed_logprobs=True,
    )
    out = Sampler(seed=0, device=torch.device("cpu"))(logits, meta)
    got = head_logprobs(logits, torch.eye(V), out.token_ids, 0.9, sampling=filt)
    torch.testing.assert_close(got, out.logprobs, rtol=0, atol=1e-5)


def test_pack_right_pads_and_completion_logps_match_unpadded_rows(tiny_model):
    torch.manual_seed(1)
    prompts = [torch.randint(0, 128, (5,)).tolist(), torch.randint(0, 128, (3,)).tolist()]
    comps = [torch.randint(0, 128, (4,)).tolist(), torch.randint(0, 128, (2,)).tolist()]
    r = Rollout(prompts, comps, [[0.0] * 4, [0.0] * 2], [False, False], ["", ""])
    data = pack(r, pad_id=0, device=torch.device("cpu"))
    assert data["attention_mask"][:, 0].all(), "no row may start with padding"
    assert data["prompt_lengths"].tolist() == [5, 3]
    with torch.no_grad():
        got = completion_logps(tiny_model, data["input_ids"], data["attention_mask"],
                               data["prompt_lengths"], 4, temperature=0.9, micro_batch_size=1)
        for row, (p, c) in enumerate(zip(prompts, comps)):
            full = torch.tensor(p + c)[None]
            logits = tiny_model(input_ids=full).logits[0, len(p) - 1 : -1]
            want = torch.log_softmax(logits / 0.9, -1).gather(-1, torch.tensor(c)[:, None]).squeeze(-1)
            torch.testing.assert_close(got[row, : len(c)], want, rtol=1e-4, atol=1e-5)
            assert (got[row, len(c):] == 0).all()


def test_completion_logps_gradients_match_the_full_logits_path(tiny_model):
    """The fused head changes no gradient: same parameter gradients as HF's logits (fp32)."""
    torch.manual_seed(2)
    ids = torch.randint(0, 128, (3, 9))
    am = torch.ones_like(ids)
    am[2, 7:] = 0
    plen = torch.tensor([4, 5, 3])
    weights = torch.randn(3, 5)
    completion_logps(tiny_model, ids, am, plen, 5).mul(weights).sum().backward()
    fused = {n: p.grad.clone() for n, p in tiny_model.named_parameters()}
    tiny_model.zero_grad()
    logp = torch.log_softmax(tiny_model(input_ids=ids, attention_mask=am).logits, -1)
    total = 0.0
    for i in range(3):
        for t in range(5):
            pos = int(plen[i]) + t
            if pos < 9 and am[i, pos]:
                total = total + weights[i, t] * logp[i, pos - 1, ids[i, pos]]
    total.backward()
    for n, p in tiny_model.named_parameters():
        torch.testing.assert_close(fused[n], p.grad, rtol=1e-5, atol=1e-6, msg=n)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_padding_free_logprobs_and_gradients_equal_the_padded_ones(arch):
    """Packing changes no number: per-token logprobs and every parameter's gradient (fp32)."""
    from model_fixtures import make_tiny_model

    model = make_tiny_model(arch, seed=4).train()
    torch.manual_seed(5)
    lengths, plen = [9, 5, 12, 7], torch.tensor([3, 2, 6, 4])
    L, T = max(lengths), 8
    ids = torch.randint(3, 300, (4, L))
    am = torch.zeros(4, L, dtype=torch.long)
    for i, n in enumerate(lengths):
        am[i, :n] = 1
    weights = torch.randn(4, T)
    grads = []
    for padding_free in (False, True):
        model.zero_grad()
        lp = completion_logps(model, ids, am, plen, T, 0.9, micro_batch_size=3, padding_free=padding_free)
        lp.mul(weights).sum().backward()
        grads.append((lp.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (a, ga), (b, gb) = grads
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    for n in ga:
        torch.testing.assert_close(ga[n], gb[n], rtol=1e-5, atol=1e-5, msg=lambda m, n=n: f"{n}: {m}")
    assert model.config._attn_implementation != "tandem_varlen"  # switched back after the pass


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo", "bnpo"])
@pytest.mark.parametrize("share_prompts", [False, None])
def test_a_padding_free_step_is_the_padded_step(tmp_path, loss_type, share_prompts):
    """Through the trainer (8 completions a prompt): packed rows, with each prompt packed once
    (share_prompts None: on) or not, make the padded step."""
    from tests.rl.test_trainer import make_trainer

    # SGD: the weights move by lr x gradient, so equal weights after the step are equal gradients
    steps = [make_trainer(tmp_path / str(p), max_steps=1, gradient_accumulation_steps=1, optim="sgd",
                          loss_type=loss_type, padding_free=p, share_prompts=share_prompts and p)
             for p in (False, True)]
    before = {n: p.detach().clone() for n, p in steps[0].model.named_parameters()}
    padded, packed = (t.step() for t in steps)
    assert (packed["train/computed_tokens"] < packed["train/tokens"]) == (share_prompts is None)
    assert any(not torch.equal(before[n], p) for n, p in steps[0].model.named_parameters())
    assert packed["loss"] == pytest.approx(padded["loss"], abs=1e-5)
    assert packed["sampling/sampling_logp_difference/max"] < 1e-4  # the engine agrees with both
    for (n, a), b in zip(steps[0].model.named_parameters(), steps[1].model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7, msg=lambda m, n=n: f"{n}: {m}")


def test_a_padding_free_step_with_recompute_is_the_padded_step(tmp_path):
    """Activation checkpointing recomputes each layer inside backward: packed, as it ran."""
    from tests.rl.test_trainer import make_trainer

    steps = [make_trainer(tmp_path / str(p), max_steps=1, gradient_accumulation_steps=1, optim="sgd",
                          padding_free=p, gradient_checkpointing=True) for p in (False, True)]
    assert all(t.update.recompute for t in steps)
    padded, packed = (t.step() for t in steps)
    assert packed["loss"] == pytest.approx(padded["loss"], abs=1e-5)
    for (n, a), b in zip(steps[0].model.named_parameters(), steps[1].model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7, msg=lambda m, n=n: f"{n}: {m}")


def _grouped_rows(device="cpu", scale=1):
    """Rows in prompt groups (ids 0 0 0 1 1 2 2, rows of one group with one prompt) with completions
    of varied lengths, an empty one among them, and their weights."""
    torch.manual_seed(6)
    groups = torch.tensor([0, 0, 0, 1, 1, 2, 2])
    prompt_of = [torch.randint(3, 300, (n * scale,)) for n in (3, 5, 2)]
    completions = [n * scale for n in (4, 1, 6, 3, 0, 7, 2)]
    rows = [torch.cat([prompt_of[g], torch.randint(3, 300, (c,))]) for g, c in zip(groups.tolist(), completions)]
    L = max(map(len, rows))
    ids = torch.zeros(len(rows), L, dtype=torch.long)
    am = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, : len(r)], am[i, : len(r)] = r, 1
    plen = torch.tensor([len(prompt_of[g]) for g in groups.tolist()])
    return ids.to(device), am.to(device), plen, am.sum(-1), groups, max(completions)


@pytest.mark.parametrize("micro_batch_size", [7, 4])
def test_shared_prompts_change_no_logprob_and_no_gradient(micro_batch_size):
    """Each group's prompt packed once (a group cut by a micro-batch's edge shares within each
    part): the padded rows' per-token logprobs and every parameter's gradient (fp32)."""
    from model_fixtures import make_tiny_model

    model = make_tiny_model("qwen2", seed=4).train()
    ids, am, plen, seq_lens, groups, T = _grouped_rows()
    weights = torch.randn(len(ids), T)
    runs = []
    for kw in ({}, {"padding_free": True, "lengths_cpu": (plen, seq_lens), "prompt_groups": groups}):
        model.zero_grad()
        lp = completion_logps(model, ids, am, plen, T, 0.9, micro_batch_size=micro_batch_size, **kw)
        lp.mul(weights).sum().backward()
        runs.append((lp.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (a, ga), (b, gb) = runs
    assert a.abs().sum() > 0
    torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    for n in ga:
        torch.testing.assert_close(gb[n], ga[n], rtol=1e-5, atol=1e-5, msg=lambda m, n=n: f"{n}: {m}")


def test_shared_prompt_packing_lays_each_prompt_out_once():
    from tandem.rl.packing import pack_rows, packed_positions

    ids, am, plen, seq_lens, groups, _ = _grouped_rows()
    packed = pack_rows(ids, am, seq_lens, (plen, groups))
    kw = packed["model_kwargs"]
    computed = sum(plen[[0, 3, 5]]) + sum(seq_lens - plen)
    assert packed["tokens"] == kw["input_ids"].shape[1] == computed
    # every row's every token is found where packed_positions says, at its own position id
    for b in range(len(ids)):
        pos = torch.arange(int(seq_lens[b]))
        at = packed_positions(packed, torch.full_like(pos, b), pos)
        assert torch.equal(kw["input_ids"][0, at], ids[b, pos]) and torch.equal(kw["position_ids"][0, at], pos)
    # the segments: each prompt alone; each non-empty completion after its prompt's keys
    assert kw["cu_seq_lens_q"].diff().tolist() == [3, 4, 1, 6, 5, 3, 2, 7, 2]
    assert kw["cu_seq_lens_k"].diff().tolist() == [3, 7, 4, 9, 5, 8, 2, 9, 4]
    assert kw["max_length_q"] == 7 and kw["max_length_k"] == 9


def test_rows_of_one_group_with_different_prompt_lengths_are_refused():
    from tandem.rl.packing import pack_rows

    ids, am, plen, seq_lens, groups, _ = _grouped_rows()
    with pytest.raises(ValueError, match="share a prompt group but not a prompt length"):
        pack_rows(ids, am, seq_lens, (plen + torch.arange(len(plen)), groups))


@pytest.mark.gpu
def test_padding_free_on_the_gpu_in_bf16_agrees_with_padded_rows():
    """On CUDA in bf16 the packed rows run torch's varlen flash attention (where this torch has
    it): the same logprobs as SDPA on padded rows up to bf16 rounding, and finite gradients."""
    from model_fixtures import make_tiny_model

    from tandem.rl.packing import _flash_varlen

    model = make_tiny_model("qwen2", seed=4).cuda().train()
    torch.manual_seed(5)
    lengths, plen = [90, 50, 120, 70], torch.tensor([30, 20, 60, 40], device="cuda")
    ids = torch.randint(3, 300, (4, 120), device="cuda")
    am = torch.zeros(4, 120, dtype=torch.long, device="cuda")
    for i, n in enumerate(lengths):
        am[i, :n] = 1
    out = []
    for padding_free in (False, True):
        model.zero_grad()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            lp = completion_logps(model, ids, am, plen, 64, head_dtype=torch.bfloat16, padding_free=padding_free)
        lp.sum().backward()
        assert all(torch.isfinite(p.grad).all() for p in model.parameters())
        out.append(lp.detach())
    print("varlen flash attention:", _flash_varlen() is not None)
    assert (out[0] - out[1]).abs().mean() < 0.02


@pytest.mark.gpu
def test_shared_prompts_on_the_gpu_in_bf16_agree_with_padded_rows():
    """Shared prompts on CUDA in bf16: each completion's segment has more keys than queries, and
    torch's varlen flash attention aligns its causal mask at the bottom right (a top-left mask
    would hide most of the prompt from the completion): the padded rows' logprobs up to bf16
    rounding, and their gradients' direction."""
    from model_fixtures import make_tiny_model

    model = make_tiny_model("qwen2", seed=4).cuda().train()
    ids, am, plen, seq_lens, groups, T = _grouped_rows("cuda", scale=10)
    weights = torch.randn(len(ids), T, device="cuda")
    runs = []
    for kw in ({}, {"padding_free": True, "lengths_cpu": (plen, seq_lens), "prompt_groups": groups}):
        model.zero_grad()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            lp = completion_logps(model, ids, am, plen.cuda(), T, head_dtype=torch.bfloat16, **kw)
        lp.mul(weights).sum().backward()
        runs.append((lp.detach(), torch.cat([p.grad.flatten() for p in model.parameters()])))
    (a, ga), (b, gb) = runs
    assert torch.isfinite(gb).all()
    assert (a - b).abs().mean() < 0.02, (a - b).abs().mean()
    assert torch.nn.functional.cosine_similarity(ga, gb, dim=0) > 0.99


def test_rows_packed_from_host_lengths_equal_rows_packed_on_the_device():
    """pack_rows planned from the rollout's host lengths (no read-back) packs what the device-side
    path packs, tensor for tensor."""
    from tandem.rl.packing import pack_rows

    lengths = torch.tensor([9, 1, 12, 7])
    ids = torch.randint(3, 300, (4, 12))
    am = (torch.arange(12)[None] < lengths[:, None]).long()
    device_side, host_side = pack_rows(ids, am), pack_rows(ids, am, lengths)
    dk, hk = device_side["model_kwargs"], host_side["model_kwargs"]
    assert dk.keys() == hk.keys() and dk["max_length_q"] == hk["max_length_q"] == 12
    for a, b in [(dk[k], hk[k]) for k in ("input_ids", "position_ids", "cu_seq_lens_q", "cu_seq_lens_k")] + [
            (device_side["row_starts"], host_side["row_starts"])]:
        assert torch.equal(a, b) and a.dtype == b.dtype
