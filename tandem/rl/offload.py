"""AdamW with its state, and its step, in host memory (`GRPOConfig.optim_offload`): the device keeps
the fp32 master weights and their gradients, 8 B a parameter instead of AdamW's 16.

Why this way, and not another:
- The master weights stay on the device: the forward pass and the engine's weight sync read them
  there, and a host copy of them would cost 4 B a parameter more and could go stale. Each step
  streams every parameter and its gradient to the host in chunks, updates them with torch's fused
  CPU AdamW kernel (`torch._fused_adamw_`, what `AdamW(fused=True)` runs on a CPU: the same
  arithmetic as on the GPU), and streams the parameter back.
- The step reads the gradients inside `optimizer.step()`, after clipping and the non-finite guard.
  torchao's CPUOffloadOptimizer copies them in backward hooks, before clipping (its host step
  would see unclipped gradients), and runs on CUDA only.
- It cannot overlap the next micro-batch: that micro-batch, and the engine's weight sync, read the
  updated weights. Within the step, two pinned staging slots let the copies of one chunk overlap
  the host's arithmetic on the other.
- Master weights on the host too would leave the device 4 B a parameter (bf16 copies and
  gradients) but need 12 B a parameter of host memory: more than a one-GPU host has for 14B.

The state dict is torch.optim.AdamW's (step, exp_avg, exp_avg_sq per parameter), so a checkpoint
resumes with or without offload.
"""

from __future__ import annotations

from collections import defaultdict

import torch

CHUNK_ELEMENTS = 1 << 26  # 256 MiB of fp32 a staging buffer; two slots of parameter + gradient


def staging_bytes(numels: list[int], chunk: int = CHUNK_ELEMENTS) -> int:
    """Host bytes of the staging slots for tensors of these sizes."""
    return 2 * 2 * 4 * min(chunk, max(numels, default=0))


class HostOffloadAdamW(torch.optim.Optimizer):
    """torch.optim.AdamW's update with exp_avg / exp_avg_sq in host memory (fp32)."""

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        chunk_elements: int = CHUNK_ELEMENTS,
    ):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.chunk = chunk_elements
        self._slots: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self._streams = None

    def _state(self, p: torch.Tensor) -> dict:
        state = self.state[p]
        if not state:
            state["step"] = torch.tensor(0.0)
            state["exp_avg"] = torch.zeros(p.shape, dtype=torch.float32)
            state["exp_avg_sq"] = torch.zeros(p.shape, dtype=torch.float32)
        return state

    def _staging(self, device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
        if self._slots is None:
            n = min(self.chunk, max(p.numel() for g in self.param_groups for p in g["params"]))
            pin = device.type == "cuda"
            self._slots = [
                (torch.empty(n, pin_memory=pin), torch.empty(n, pin_memory=pin)) for _ in range(2)
            ]
            if pin:
                self._streams = (torch.cuda.Stream(device), torch.cuda.Stream(device))
        return self._slots

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        chunks = []
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self._state(p)
                state["step"] += 1
                chunks += [
                    (group, p, state, s, min(s + self.chunk, p.numel()))
                    for s in range(0, p.numel(), self.chunk)
                ]
        if chunks:
            self._run(chunks, chunks[0][1].device)
        return loss

    def _run(self, chunks: list, device: torch.device) -> None:
        """Chunk i+1 travels to the host while chunk i is updated there; each goes back as soon as
        it is done. A slot is refilled only after its last chunk has gone back."""
        slots = self._staging(device)
        cuda = device.type == "cuda"
        if cuda:
            d2h, h2d = self._streams
            d2h.wait_stream(torch.cuda.current_stream(device))  # gradients clipped, guard passed
        arrived: list = [None, None]
        returned: list = [None, None]

        def fetch(i: int) -> None:
            _, p, _, s, e = chunks[i]
            p_buf, g_buf = slots[i % 2]
            if not cuda:
                p_buf[: e - s].copy_(p.detach().view(-1)[s:e])
                g_buf[: e - s].copy_(p.grad.view(-1)[s:e])
                return
            if returned[i % 2] is not None:
                d2h.wait_event(returned[i % 2])
            with torch.cuda.stream(d2h):
                p_buf[: e - s].copy_(p.detach().view(-1)[s:e], non_blocking=True)
                g_buf[: e - s].copy_(p.grad.view(-1)[s:e], non_blocking=True)
                arrived[i % 2] = d2h.record_event()

        fetch(0)
        for i, (group, p, state, s, e) in enumerate(chunks):
            if i + 1 < len(chunks):
                fetch(i + 1)
            p_buf, g_buf = slots[i % 2]
            if cuda:
                arrived[i % 2].synchronize()
            beta1, beta2 = group["betas"]
            torch._fused_adamw_(
                [p_buf[: e - s]],
                [g_buf[: e - s]],
                [state["exp_avg"].view(-1)[s:e]],
                [state["exp_avg_sq"].view(-1)[s:e]],
                [],
                [state["step"]],
                lr=float(group["lr"]),
                beta1=beta1,
                beta2=beta2,
                weight_decay=group["weight_decay"],
                eps=group["eps"],
                amsgrad=False,
                maximize=False,
            )
            if not cuda:
                p.detach().view(-1)[s:e].copy_(p_buf[: e - s])
                continue
            h2d.wait_event(arrived[i % 2])
            with torch.cuda.stream(h2d):
                p.detach().view(-1)[s:e].copy_(p_buf[: e - s], non_blocking=True)
                returned[i % 2] = h2d.record_event()
        if cuda:
            torch.cuda.current_stream(device).wait_stream(h2d)  # the next forward reads new weights
            for ev in returned:  # the host may refill a slot only once its copy has left
                if ev is not None:
                    ev.synchronize()

    def load_state_dict(self, state_dict: dict) -> None:
        """As torch.optim.Optimizer's, but the moments stay in host memory (Optimizer's own would
        first move them to the parameters' device: 8 B a parameter there, the memory offload
        saves)."""
        groups, saved = self.param_groups, state_dict["param_groups"]
        if len(groups) != len(saved) or any(
            len(g["params"]) != len(s["params"]) for g, s in zip(groups, saved)
        ):
            raise ValueError(
                "the optimizer state dict has other parameter groups than this optimizer"
            )
        by_id = {old: p for g, s in zip(groups, saved) for old, p in zip(s["params"], g["params"])}
        self.state = defaultdict(dict)
        for key, values in state_dict["state"].items():
            p = by_id[key]
            self.state[p] = {
                "step": torch.as_tensor(values["step"], dtype=torch.float32).clone(),
                "exp_avg": values["exp_avg"]
                .detach()
                .to("cpu", torch.float32)
                .reshape(p.shape)
                .clone(),
                "exp_avg_sq": values["exp_avg_sq"]
                .detach()
                .to("cpu", torch.float32)
                .reshape(p.shape)
                .clone(),
            }
        for g, s in zip(groups, saved):
            g.update({k: v for k, v in s.items() if k != "params"})
