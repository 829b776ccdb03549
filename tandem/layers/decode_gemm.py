"""Which linear layers run a decode GEMM other than `F.linear`'s, and with what.

A table measured on one GPU (`python -m tandem.bench.gemm --table-out FILE`) lists, per weight
shape (N, K) and M bucket, which won there: cuBLAS (`F.linear`), the Triton decode GEMM
(`tandem.kernels.decode_gemm`, with its config), another of cuBLASLt's own algorithms
(`tandem.kernels.cublaslt`, with its config attributes; bias-free layers only) or Hopper's
cluster GEMM (`tandem.kernels.sm90_gemm`, with its config; sm_90 only; for an MLP's gate/up
layer, maybe with the activation in its epilogue).
`apply_decode_gemm` hands each plain linear layer its shape's entries, once, from outside the
model; a layer runs the table's choice only for the M it was measured to win at, cuBLAS for the
rest.
"""

from __future__ import annotations

import json
import os
import warnings
from dataclasses import dataclass

import torch

from tandem.kernels.cublaslt import LtAlgo
from tandem.kernels.decode_gemm import GemmConfig
from tandem.kernels.sm90_gemm import Sm90GemmConfig, Sm90GluConfig

CONFIG_DIR = os.path.join(os.path.dirname(__file__), os.pardir, "kernels", "configs")


@dataclass(frozen=True)
class GemmChoice:
    """Rows up to `max_m` (and above the previous entry's) run `config`: a Triton `GemmConfig`, a
    cuBLASLt `LtAlgo`, an `Sm90GemmConfig`, or None: cuBLAS."""

    max_m: int
    config: GemmConfig | LtAlgo | Sm90GemmConfig | None
    measured_with: int | None = None  # a cuBLASLt choice: the cuBLASLt version it was timed under


# "sm90-glu": an MLP's gate/up layer runs the cluster GEMM with SiLU-and-mul in its epilogue
# (`linear.apply_mlp`); called on its own (not from an MLP), the plain cluster GEMM
BACKENDS = {"triton": GemmConfig, "cublaslt": LtAlgo, "sm90": Sm90GemmConfig, "sm90-glu": Sm90GluConfig,
            "cublas": None}


def parse_table(table: dict) -> dict[tuple[int, int], tuple[GemmChoice, ...]]:
    """{"shapes": {"N,K": [{"max_m", "backend", "config"}, ...]}} -> (N, K) -> sorted choices."""
    out = {}
    for key, entries in table["shapes"].items():
        n, k = (int(v) for v in key.split(","))
        choices = []
        for e in entries:
            if e["backend"] not in BACKENDS:
                raise ValueError(f"decode GEMM table, shape {key}: backend {e['backend']!r} is none of "
                                 f"{sorted(BACKENDS)}")
            kind = BACKENDS[e["backend"]]
            choices.append(GemmChoice(int(e["max_m"]), kind(**e["config"]) if kind else None,
                                      table.get("cublaslt_version") if kind is LtAlgo else None))
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


def _can_run_cublaslt(layer: torch.nn.Module) -> bool:
    from tandem.kernels import cublaslt

    return layer.bias is None and layer.weight.is_cuda and cublaslt.available()


def _can_run_sm90(layer: torch.nn.Module, glu: bool = False) -> bool:
    """Whether the cluster GEMM can multiply by the layer's weight here (with `glu`: as an MLP's
    gate/up weight, its output half as wide)."""
    from tandem.kernels import sm90_gemm

    w = layer.weight
    n = w.shape[0] // 2 if glu else w.shape[0]
    return (w.is_cuda and sm90_gemm.device_supported(w.device) and not (glu and w.shape[0] % 2)
            and sm90_gemm.unsupported(n, w.shape[1], w.dtype) is None)


def apply_decode_gemm(model: torch.nn.Module, table: dict) -> int:
    """Give every plain linear layer (not the LM head) whose (N, K) is in `table` its choices
    (a layer with a bias runs cuBLAS where its shape's entry is cuBLASLt's: that path has no
    bias; a layer on a GPU other than Hopper, or without NVRTC, where it is the sm90 kernel's);
    returns how many layers got some."""
    from tandem.kernels import cublaslt
    from tandem.layers.linear import Linear, LMHead, MergedLinear

    count, measured_with = 0, set()  # the cuBLASLt versions of the entries layers took
    for m in model.modules():
        if isinstance(m, (Linear, MergedLinear)) and not isinstance(m, LMHead):
            choices = table.get(tuple(m.weight.shape)) or ()
            lt = [c for c in choices if isinstance(c.config, LtAlgo)]
            if lt and _can_run_cublaslt(m):
                cublaslt.prepare(m.weight.device)
                measured_with |= {c.measured_with for c in lt}
            elif lt:
                choices = tuple(GemmChoice(c.max_m, None) if c in lt else c for c in choices)
            sm90 = [c for c in choices if isinstance(c.config, Sm90GemmConfig)
                    and not _can_run_sm90(m, isinstance(c.config, Sm90GluConfig))]
            if sm90:
                choices = tuple(GemmChoice(c.max_m, None) if c in sm90 else c for c in choices)
            if any(c.config is not None for c in choices):
                m.decode_gemm = choices
                count += 1
    stale = measured_with - {cublaslt.version()}
    if stale:  # still right (each config is checked before use), maybe slower
        warnings.warn(f"decode GEMM table: its cuBLASLt algorithms were measured with cuBLASLt "
                      f"{sorted(stale, key=str)}, this is {cublaslt.version()}; remeasure with "
                      "`python -m tandem.bench.gemm --table-out FILE`", stacklevel=2)
    return count


def pick(choices: tuple[GemmChoice, ...], m: int) -> GemmConfig | LtAlgo | Sm90GemmConfig | None:
    """The config for `m` rows: the first bucket holding m; past the last bucket, cuBLAS."""
    for c in choices:
        if m <= c.max_m:
            return c.config
    return None
