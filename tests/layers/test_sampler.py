"""Sampler paths: the fused Triton path and the torch path agree on what they promise."""

import pytest
import torch

from tandem.layers.sampler import Sampler, SamplingMetadata, token_logprobs

V = 300
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # Triton runs interpreted on the CPU


@pytest.fixture
def device() -> str:
    return DEVICE


def metadata(S, device, greedy=(), seeded=None, temperature=1.0, **kw) -> SamplingMetadata:
    greedy_mask = torch.tensor([i in greedy for i in range(S)], device=device)
    temps = torch.tensor([1.0 if i in greedy else temperature for i in range(S)], device=device)
    seeded = seeded or {}
    gens = {row: torch.Generator(device=device).manual_seed(s) for row, s in seeded.items()}
    defaults = {"top_k": None, "top_p": None, "min_p": None, "max_num_logprobs": -1,
                "processed_logprobs": False}
    if seeded:  # the fused path's keys: (seed, tokens so far)
        defaults.update(seeded_rows=torch.tensor(list(seeded), device=device),
                        seeded_rows_cpu=list(seeded),
                        row_seeds=torch.tensor(list(seeded.values()), device=device),
                        seed_offsets=torch.zeros(len(seeded), dtype=torch.int64, device=device))
    return SamplingMetadata(temperature=temps, greedy=greedy_mask, all_greedy=len(greedy) == S,
                            generators=gens, **{**defaults, **kw})


def logits_for(S, device, seed=0):
    return (2 * torch.randn(S, V, generator=torch.Generator().manual_seed(seed))).to(device)


def test_token_logprobs_equal_log_softmax():
    x = logits_for(6, "cpu")
    x[2, 5:] = float("-inf")
    tokens = torch.tensor([0, 7, 3, 299, 150, 42])
    lp, ranks = token_logprobs(x, tokens, want_ranks=True)
    full = torch.log_softmax(x, dim=-1)
    ref = full.gather(1, tokens[:, None])[:, 0]
    torch.testing.assert_close(lp, ref, atol=1e-6, rtol=0)
    assert ranks.tolist() == ((full > ref[:, None]).sum(-1) + 1).tolist()


def test_torch_gumbel_draws_follow_softmax():
    n = 20000
    row = torch.tensor([1.0, 0.0, -1.0, 2.0, float("-inf")])
    m = metadata(n, "cpu", temperature=0.8)
    out = Sampler(0, torch.device("cpu"))._torch(row.repeat(n, 1), m)
    counts = torch.bincount(out.token_ids, minlength=5).double()
    expected = torch.softmax(row / 0.8, -1).double() * n
    assert counts[4] == 0
    chi2 = ((counts[:4] - expected[:4]) ** 2 / expected[:4]).sum().item()
    assert chi2 < 20  # 3 degrees of freedom: P(chi2 > 20) is about 2e-4


@pytest.mark.parametrize("path", ["_torch", "_fused"])
def test_greedy_seeded_and_banned_rows(path, device):
    """Greedy rows take the argmax, a seeded row repeats itself whatever its batch mates, a banned
    token is never drawn, and logprobs are log_softmax of the raw logits at the drawn token."""
    S = 4
    logits = logits_for(S, device)
    logits[3, 10] = 100.0  # would always win, but is banned below
    ban = (torch.tensor([3], device=device), torch.tensor([10], device=device))
    sampler = Sampler(0, torch.device(device))
    m = metadata(S, device, greedy=(0,), seeded={1: 5}, min_tokens_mask=ban,
                 max_num_logprobs=0)
    assert Sampler.fused_supports(m)
    out = getattr(sampler, path)(logits.clone(), m)
    assert out.token_ids[0].item() == logits[0].argmax().item()
    assert out.token_ids[3].item() != 10
    masked = logits.clone()
    masked[3, 10] = float("-inf")
    ref_lp, ref_ranks = token_logprobs(masked, out.token_ids, want_ranks=True)
    torch.testing.assert_close(out.logprobs, ref_lp, atol=1e-5, rtol=0)
    assert out.ranks.tolist() == ref_ranks.tolist()
    alone = getattr(Sampler(1, torch.device(device)), path)(
        logits[1:2].clone(), metadata(1, device, seeded={0: 5})
    )
    assert alone.token_ids[0].item() == out.token_ids[1].item()


def test_seeded_rows_keys_depend_on_seed_and_offset_alone():
    """A seeded row's Philox key is a function of (seed, tokens so far): the sampler's own
    generator and the row's place in the batch do not enter, and each new token gets a new key."""
    m = metadata(5, "cpu", seeded={1: 7, 4: 8})
    m.seed_offsets = torch.tensor([130, 131])
    a = Sampler(0, torch.device("cpu"))._seeds(5, m, "cpu")
    b = Sampler(99, torch.device("cpu"))._seeds(5, m, "cpu")
    assert a[[1, 4]].tolist() == b[[1, 4]].tolist()
    assert a[0] != b[0]  # unseeded rows follow the sampler's generator
    alone = metadata(1, "cpu", seeded={0: 7})
    alone.seed_offsets = torch.tensor([130])
    assert Sampler(5, torch.device("cpu"))._seeds(1, alone, "cpu")[0] == a[1]
    alone.seed_offsets = torch.tensor([131])
    assert Sampler(5, torch.device("cpu"))._seeds(1, alone, "cpu")[0] != a[1]


def test_engine_gives_seeded_rows_their_seed_and_token_count():
    from model_fixtures import make_tiny_model

    from tandem import LLM, SamplingParams

    llm = LLM(make_tiny_model("llama"), block_size=4)
    eng = llm.llm_engine
    eng.add_request("a", [5, 6, 7], SamplingParams(temperature=1.0, max_tokens=4, seed=11, n=2))
    eng.add_request("b", [8, 9], SamplingParams(temperature=1.0, max_tokens=4))
    sched = eng.scheduler.schedule()
    seqs = [s for s, smp in zip(sched.seqs, sched.sampling) if smp]
    m = eng.worker.model_runner.prepare_sampling(seqs)
    rows = m.seeded_rows_cpu
    assert sorted(seqs[r].request_id for r in rows) == ["a", "a"]
    assert sorted(m.row_seeds.tolist()) == [11, 12]  # seed + sample index, as the torch path
    assert m.seed_offsets.tolist() == [seqs[r].num_tokens for r in rows]
    eng.abort_request(["a", "b"])


def test_fused_path_is_only_for_the_common_case():
    m = metadata(2, "cpu")
    assert Sampler.fused_supports(m)
    assert not Sampler.fused_supports(metadata(2, "cpu", top_k=torch.tensor([5, 5])))
    assert not Sampler.fused_supports(metadata(2, "cpu", max_num_logprobs=3))


@pytest.mark.gpu
def test_gpu_forward_takes_the_fused_path_and_keeps_seeds():
    logits = logits_for(8, "cuda")
    m = metadata(8, "cuda", seeded={2: 9})
    a = Sampler(0, torch.device("cuda"))(logits.clone(), m)
    b = Sampler(1, torch.device("cuda"))(logits.clone(), metadata(8, "cuda", seeded={2: 9}))
    assert a.token_ids[2].item() == b.token_ids[2].item()
    assert a.ranks is None and a.topk_ids is None


def test_engine_with_the_fused_path(monkeypatch):
    """The engine's sampling contract holds on the fused path (run interpreted here): seeds
    reproduce, batch mates do not matter, logprobs are the model's log_softmax."""
    from model_fixtures import make_tiny_model

    from tandem import LLM, SamplingParams

    def forward(self, logits, m):
        return self._fused(logits, m) if self.fused_supports(m) else self._torch(logits, m)

    monkeypatch.setattr(Sampler, "forward", forward)
    device = "cuda" if torch.cuda.is_available() else "cpu"  # Triton natively, or interpreted
    model = make_tiny_model("llama").to(device)
    llm = LLM(model, block_size=4, gpu_memory_utilization=0.1)
    prompts = [[5, 17, 33, 8], [12, 3, 9, 9, 100], list(range(40, 60))]
    p = SamplingParams(temperature=1.0, max_tokens=6, seed=7, n=2, ignore_eos=True, logprobs=0)
    a = llm.generate(prompts, p, use_tqdm=False)
    b = llm.generate(prompts, p, use_tqdm=False)
    tokens = [[c.token_ids for c in o.outputs] for o in a]
    assert tokens == [[c.token_ids for c in o.outputs] for o in b]
    assert tokens[0][0] != tokens[0][1]
    alone = llm.generate([prompts[0]], p, use_tqdm=False)[0]
    assert [c.token_ids for c in alone.outputs] == tokens[0]
    c = a[2].outputs[0]
    full = torch.tensor([prompts[2] + c.token_ids], device=device)
    with torch.no_grad():
        logits = model(full).logits[0].float().cpu()
    ref = torch.log_softmax(logits, -1)[len(prompts[2]) - 1 : -1]
    ref = ref.gather(1, torch.tensor(c.token_ids)[:, None])[:, 0]
    got = torch.tensor([lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)])
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=0)
