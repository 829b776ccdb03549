"""HostOffloadAdamW: torch's AdamW arithmetic with the state in host memory, chunk by chunk."""

import copy

import torch

from tandem.rl.offload import HostOffloadAdamW, staging_bytes


def _pair(chunk: int):
    torch.manual_seed(0)
    a = torch.nn.Sequential(torch.nn.Linear(30, 20), torch.nn.Linear(20, 5))
    b = torch.nn.Sequential(torch.nn.Linear(30, 20), torch.nn.Linear(20, 5))
    b.load_state_dict(a.state_dict())
    return (
        a,
        HostOffloadAdamW(a.parameters(), lr=1e-2, weight_decay=0.1, chunk_elements=chunk),
        b,
        torch.optim.AdamW(b.parameters(), lr=1e-2, weight_decay=0.1, fused=True),
    )


def _steps(a, oa, b, ob, n=4):
    for _ in range(n):
        x = torch.randn(4, 30)
        for model, opt in ((a, oa), (b, ob)):
            opt.zero_grad()
            model(x).square().sum().backward()
            opt.step()


def test_it_is_adamws_fused_update():
    a, oa, b, ob = _pair(
        chunk=1 << 20
    )  # one chunk a tensor: the very kernel AdamW(fused=True) runs
    _steps(a, oa, b, ob)
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
    a, oa, b, ob = _pair(chunk=7)  # chunks that split every tensor
    _steps(a, oa, b, ob)
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-6)
    assert staging_bytes([600, 100], chunk=7) == 2 * 2 * 4 * 7


def test_its_state_dict_is_adamws_and_stays_on_the_host():
    a, oa, b, ob = _pair(chunk=1 << 20)
    _steps(a, oa, b, ob, n=2)
    saved = ob.state_dict()
    oa.load_state_dict(saved)  # resume an AdamW checkpoint with offload, and back
    for i, p in enumerate(a.parameters()):
        assert oa.state[p]["exp_avg"].device.type == "cpu"
        torch.testing.assert_close(oa.state[p]["exp_avg_sq"], saved["state"][i]["exp_avg_sq"])
    ob.load_state_dict(
        copy.deepcopy(oa.state_dict())
    )  # as from a file: AdamW takes tensors as they are
    _steps(a, oa, b, ob, n=2)
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
