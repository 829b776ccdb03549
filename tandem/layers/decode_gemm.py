"""Which linear layers run the Triton decode GEMM (`tandem.kernels.decode_gemm`), and with what.

A table measured on one GPU (`python -m tandem.bench.gemm --table-out FILE`) lists, per weight
shape (N, K) and M bucket, whether cuBLAS or the Triton GEMM won there and the winning config.
`apply_decode_gemm` hands each plain linear layer its shape's entries, once, from outside the
model; a layer runs Triton only for the M its table says Triton wins at, cuBLAS for the rest.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch

from tandem.kernels.decode_gemm import GemmConfig

CONFIG_DIR = os.path.join(os.path.dirname(__file__), os.pardir, "kernels", "configs")


@dataclass(frozen=True)
class GemmChoice:
    """Rows up to `max_m` (and above the previous entry's) run `config`; None: cuBLAS."""

    max_m: int
    config: GemmConfig | None


def parse_table(table: dict) -> dict[tuple[int, int], tuple[GemmChoice, ...]]:
    """{"shapes": {"N,K": [{"max_m", "backend", "config"}, ...]}} -> (N, K) -> sorted choices."""
    out = {}
    for key, entries in table["shapes"].items():
        n, k = (int(v) for v in key.split(","))
        choices = [GemmChoice(int(e["max_m"]),
                              GemmConfig(**e["config"]) if e["backend"] == "triton" else None)
                   for e in entries]
        out[(n, k)] = tuple(sorted(choices, key=lambda c: c.max_m))
    return out


def table_path(spec: str, device: torch.device) -> str | None:
    """`spec` is a JSON file, or "triton"/"auto": the file for this GPU under tandem/kernels/configs
    (a GPU without one: an error for "triton", None for "auto")."""
    if spec.endswith(".json"):
        return spec
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    path = os.path.join(CONFIG_DIR, f"decode_gemm_{name.replace(' ', '_')}.json")
    if not os.path.isfile(path):
        if spec == "auto":
            return None
        raise ValueError(
            f"decode_gemm='triton': no table for this device ({name!r}) at {os.path.normpath(path)}; "
            "measure one with `python -m tandem.bench.gemm --table-out FILE` and pass "
            "decode_gemm=FILE (or save it there)")
    return path


def load_table(spec: str, device: torch.device) -> dict[tuple[int, int], tuple[GemmChoice, ...]]:
    """The table `spec` names ({} for "auto" on a GPU without one: cuBLAS everywhere)."""
    path = table_path(spec, device)
    if path is None:
        return {}
    with open(path) as f:
        return parse_table(json.load(f))


def apply_decode_gemm(model: torch.nn.Module, table: dict) -> int:
    """Give every plain linear layer (not the LM head) whose (N, K) is in `table` its choices;
    returns how many layers got some."""
    from tandem.layers.linear import Linear, LMHead, MergedLinear

    count = 0
    for m in model.modules():
        if isinstance(m, (Linear, MergedLinear)) and not isinstance(m, LMHead):
            choices = table.get(tuple(m.weight.shape))
            if choices and any(c.config is not None for c in choices):
                m.decode_gemm = choices
                count += 1
    return count


def pick(choices: tuple[GemmChoice, ...], m: int) -> GemmConfig | None:
    """The config for `m` rows: the first bucket holding m; past the last bucket, cuBLAS."""
    for c in choices:
        if m <= c.max_m:
            return c.config
    return None
