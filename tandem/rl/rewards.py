"""Reward functions with TRL's signature, and the RewardComputer that applies them.

A reward function is called as `f(prompts=..., completions=..., completion_ids=..., trainer_state=...,
**columns)` and returns one `float | None` per completion; None means "does not apply" (it is left
out of the group statistics, as in TRL). `async def` reward functions run concurrently, as in TRL. Completions are strings, or for conversational prompts a list with
one assistant message dict.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import math
import re
import threading
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from tandem.rl.answers import answer_region, answers_match, extract_answer, parse_number

RewardFunc = Callable[..., list[float | None]]
_NOT_RUN = object()  # a function's output not computed yet

__all__ = [
    "RewardComputer",
    "RewardError",
    "RewardResult",
    "accuracy_reward",
    "completion_text",
    "format_reward",
    "get_soft_overlong_punishment",
    "make_format_reward",
    "math_verify_available",
    "wrap_completions",
]


def completion_text(completion: str | list[dict[str, Any]]) -> str:
    """The text of a completion: the string itself, or the content of its last message."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, list) and completion and isinstance(completion[-1], dict):
        content = completion[-1].get("content")
        if isinstance(content, str):
            return content
    raise TypeError(
        "a completion must be a string or a list of message dicts with a string 'content', "
        f"got {type(completion).__name__}: {completion!r:.80}"
    )


def wrap_completions(prompts: Sequence[Any], texts: Sequence[str]) -> list[Any]:
    """Completions as reward functions expect them: a message list where the prompt was one."""
    if len(prompts) != len(texts):
        raise ValueError(f"{len(prompts)} prompts but {len(texts)} completions")
    return [
        [{"role": "assistant", "content": t}] if isinstance(p, list) else t
        for p, t in zip(prompts, texts)
    ]


# ---- accuracy ---------------------------------------------------------------------------------


def math_verify_available() -> bool:
    try:
        import math_verify  # noqa: F401
    except ImportError:
        return False
    return True


def _math_verify_equal(text: str, gold: str) -> bool | None:
    """math-verify's judgement of the extracted final answer; None if the gold is unparseable."""
    from math_verify import parse, verify

    # math-verify times out through signal.alarm, which only the main thread may use.
    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    gold_parsed = parse(gold, parsing_timeout=timeout)
    if not gold_parsed:
        return None
    # Judge only the marked answer or the last number: math-verify alone would evaluate a restated
    # question ("2 + 4 makes ...") and reward it.
    region = answer_region(text)
    pred = f"\\boxed{{{region}}}" if region is not None else extract_answer(text)
    if pred is None:
        return False
    return bool(verify(gold_parsed, parse(pred, parsing_timeout=timeout), timeout_seconds=timeout))


def _builtin_equal(text: str, gold: str) -> bool | None:
    gold_value = parse_number(gold)
    if gold_value is None:
        gold_value = parse_number(extract_answer(gold) or "")
    if gold_value is None:
        return None
    pred = extract_answer(text)
    return pred is not None and answers_match(pred, gold_value)


def accuracy_reward(
    completions: Sequence[Any],
    answer: Sequence[Any] | None = None,
    solution: Sequence[Any] | None = None,
    backend: str = "auto",
    **kwargs: Any,
) -> list[float | None]:
    r"""1.0 if the final answer equals the gold one, else 0.0; None if the gold is unparseable.

    The gold answer comes from the `answer` column (or TRL's `solution`). The completion's answer is
    its last \boxed{...}, else the number after "answer is"/"Answer:", else its last number.
    backend: "auto" (math-verify when installed, else the built-in parser), "math_verify" or
    "builtin".
    """
    gold = answer if answer is not None else solution
    if gold is None:
        raise ValueError("accuracy_reward needs an 'answer' (or 'solution') column in the dataset")
    if len(gold) != len(completions):
        raise ValueError(f"{len(completions)} completions but {len(gold)} answers")
    if backend == "auto":
        backend = "math_verify" if math_verify_available() else "builtin"
    if backend not in ("math_verify", "builtin"):
        raise ValueError(f"backend must be 'auto', 'math_verify' or 'builtin', got {backend!r}")
    equal = _math_verify_equal if backend == "math_verify" else _builtin_equal
    rewards: list[float | None] = []
    for completion, g in zip(completions, gold):
        ok = equal(completion_text(completion), str(g))
        rewards.append(None if ok is None else float(ok))
    return rewards


# ---- format -----------------------------------------------------------------------------------

THINK_ANSWER_PATTERN = r"<think>.*?</think>\s*<answer>.*?</answer>"


class _FormatReward:
    __name__ = "format_reward"

    def __init__(self, pattern: str, flags: int) -> None:
        self.regex = re.compile(pattern, flags)

    def __call__(self, completions: Sequence[Any], **kwargs: Any) -> list[float]:
        return [
            1.0 if self.regex.fullmatch(completion_text(c).strip()) else 0.0 for c in completions
        ]


def make_format_reward(pattern: str = THINK_ANSWER_PATTERN, flags: int = re.DOTALL) -> RewardFunc:
    """1.0 when the whole completion (stripped) matches `pattern`, else 0.0."""
    return _FormatReward(pattern, flags)


format_reward = make_format_reward()


def short_answer_reward(completions: Sequence[Any], **kwargs: Any) -> list[float]:
    """1.0 for a one-line reply of at most 32 characters that ends in a number ("29 - 4 = 25")."""
    out = []
    for c in completions:
        text = completion_text(c).strip()
        ok = "\n" not in text and len(text) <= 32 and re.search(r"-?\d+\.?$", text) is not None
        out.append(1.0 if ok else 0.0)
    return out


# ---- length -----------------------------------------------------------------------------------


class _SoftOverlongPunishment:
    __name__ = "soft_overlong_punishment"

    def __init__(self, max_completion_len: int, soft_punish_cache: int) -> None:
        if not 0 <= soft_punish_cache <= max_completion_len:
            raise ValueError(
                f"soft_punish_cache ({soft_punish_cache}) must be in [0, max_completion_len "
                f"({max_completion_len})]"
            )
        self.max_len, self.cache = max_completion_len, soft_punish_cache

    def __call__(self, completion_ids: Sequence[Sequence[int]], **kwargs: Any) -> list[float]:
        start = self.max_len - self.cache
        out = []
        for ids in completion_ids:
            n = len(ids)
            if n <= start:
                out.append(0.0)
            elif n <= self.max_len:
                out.append((start - n) / self.cache)
            else:
                out.append(-1.0)
        return out


def get_soft_overlong_punishment(max_completion_len: int, soft_punish_cache: int) -> RewardFunc:
    """DAPO's soft overlong punishment (eq. 13): 0 up to L_max - L_cache, then a linear ramp to -1
    at L_max, -1 beyond. Reads token counts from `completion_ids`."""
    return _SoftOverlongPunishment(max_completion_len, soft_punish_cache)


# ---- applying several functions ---------------------------------------------------------------


class RewardError(RuntimeError):
    """A reward function misbehaved; the message names it and, where known, the sample."""


@dataclass
class RewardResult:
    """Rewards of one batch. NaN marks "no reward": returned None, or dropped after an error."""

    rewards_per_func: torch.Tensor  # [N, F] unweighted
    rewards: torch.Tensor  # [N] weighted sum over functions; NaN if none applied
    names: list[str]
    num_dropped: dict[str, int] = field(default_factory=dict)
    logged: dict[str, list[float]] = field(default_factory=dict)  # from log_metric(name, value)
    extra_columns: dict[str, list[Any]] = field(default_factory=dict)  # from log_extra(column, values)

    def metrics(self) -> dict[str, float]:
        out = {}
        for i, name in enumerate(self.names):
            col = self.rewards_per_func[:, i]
            out[f"rewards/{name}/mean"] = torch.nanmean(col).item()
            if self.num_dropped.get(name):
                out[f"rewards/{name}/num_dropped"] = float(self.num_dropped[name])
        for name, values in self.logged.items():  # as TRL: averaged, under the name given
            out[name] = sum(values) / len(values)
        return out


def _func_name(f: Callable) -> str:
    return getattr(f, "__name__", None) or type(f).__name__


class RewardComputer:
    """Applies weighted reward functions to a batch.

    on_error="raise" (default) turns a function that raises, returns the wrong number of values,
    or returns NaN/inf or a non-number into a RewardError naming the function and sample index.
    on_error="drop" gives those samples NaN instead (no reward from that function) and counts them.
    """

    def __init__(
        self,
        reward_funcs: Sequence[RewardFunc] | RewardFunc,
        reward_weights: Sequence[float] | None = None,
        on_error: str = "raise",
    ) -> None:
        funcs = [reward_funcs] if callable(reward_funcs) else list(reward_funcs)
        if not funcs:
            raise ValueError("give at least one reward function")
        for f in funcs:
            if not callable(f):
                raise TypeError(f"reward functions must be callable, got {f!r}")
        if reward_weights is None:
            reward_weights = [1.0] * len(funcs)
        if len(reward_weights) != len(funcs):
            raise ValueError(
                f"reward_weights has {len(reward_weights)} entries but there are {len(funcs)} "
                f"reward functions ({', '.join(map(_func_name, funcs))})"
            )
        if on_error not in ("raise", "drop"):
            raise ValueError(f"on_error must be 'raise' or 'drop', got {on_error!r}")
        self.funcs = funcs
        self.names = _unique([_func_name(f) for f in funcs])
        self.weights = torch.tensor([float(w) for w in reward_weights], dtype=torch.float32)
        self.on_error = on_error

    @property
    def runs_models(self) -> bool:
        """Whether a reward function is a reward model (a forward pass on the device)."""
        from tandem.rl.reward_models import RewardModel

        return any(isinstance(f, RewardModel) for f in self.funcs)

    def __call__(
        self,
        prompts: Sequence[Any],
        completions: Sequence[Any],
        completion_ids: Sequence[Sequence[int]] | None = None,
        **columns: Any,
    ) -> RewardResult:
        n = len(completions)
        if len(prompts) != n:
            raise ValueError(f"{len(prompts)} prompts but {n} completions")
        batch: dict[str, Any] = {"prompts": list(prompts), "completions": list(completions)}
        if completion_ids is not None:
            batch["completion_ids"] = list(completion_ids)
        for key, values in columns.items():
            if isinstance(values, (list, tuple)) and len(values) != n:
                raise ValueError(f"column {key!r} has {len(values)} values for {n} completions")
            batch[key] = list(values) if isinstance(values, (list, tuple)) else values
        # As TRL: a reward function may log a scalar or extra completion-table columns.
        logged: dict[str, list[float]] = {}
        extra: dict[str, list[Any]] = {}
        batch.setdefault("log_metric", lambda name, value: logged.setdefault(name, []).append(float(value)))
        batch.setdefault("log_extra", lambda column, values: extra.setdefault(column, []).extend(values))
        per_func = torch.full((n, len(self.funcs)), float("nan"))
        dropped: dict[str, int] = {}
        # async functions first, all at once (a remote judge waits on the network, not the CPU)
        is_async = [_is_async(f) for f in self.funcs]
        early = iter(_run_async([f for f, a in zip(self.funcs, is_async) if a], batch))
        for j, (f, name) in enumerate(zip(self.funcs, self.names)):
            ran = next(early) if is_async[j] else _NOT_RUN
            values, num_dropped = self._run_one(_sync(f) if is_async[j] else f, name, batch, n, ran)
            per_func[:, j] = torch.tensor(values, dtype=torch.float32)
            dropped[name] = num_dropped
        weighted = (per_func * self.weights[None, :]).nansum(dim=1)
        unscored = torch.isnan(per_func).all(dim=1)
        weighted[unscored] = float("nan")
        if unscored.any():
            i = int(unscored.nonzero()[0, 0])
            warnings.warn(f"every reward function returned None for {int(unscored.sum())} of {n} completions "
                          f"(the first: sample {i}, completion {str(batch['completions'][i])[:80]!r}); they get "
                          "advantage 0", UserWarning, stacklevel=2)
        return RewardResult(per_func, weighted, list(self.names), dropped, logged, extra)

    def _run_one(
        self, f: RewardFunc, name: str, batch: dict[str, Any], n: int, out: Any = _NOT_RUN
    ) -> tuple[list[float], int]:
        try:
            if out is _NOT_RUN:
                out = f(**batch)
            elif isinstance(out, BaseException):  # an async function that raised
                raise out
        except Exception as exc:  # noqa: BLE001 - any user error gets located and reported
            return self._locate_failures(f, name, batch, n, exc)
        if out is None or not hasattr(out, "__len__") or len(out) != n:
            got = (
                "None"
                if out is None
                else (f"{len(out)} values" if hasattr(out, "__len__") else repr(out))
            )
            msg = (
                f"reward function {name!r} returned {got} for {n} completions; "
                "it must return one per completion"
            )
            if self.on_error == "raise":
                raise RewardError(msg)
            return [math.nan] * n, n
        values, dropped = [], 0
        for i, v in enumerate(out):
            value, problem = _as_reward(v)
            if problem:
                if self.on_error == "raise":
                    raise RewardError(f"reward function {name!r} returned {problem} for sample {i}")
                dropped += 1
            values.append(value)
        return values, dropped

    def _locate_failures(self, f, name, batch, n, exc) -> tuple[list[float], int]:
        # The batch call raised: call sample by sample to find which ones fail.
        values, dropped, first_bad = [], 0, None
        for i in range(n):
            one = {k: ([v[i]] if isinstance(v, list) else v) for k, v in batch.items()}
            try:
                out = f(**one)
                value, problem = (
                    _as_reward(out[0]) if out is not None and len(out) == 1 else (math.nan, "bad")
                )
            except Exception:  # noqa: BLE001
                value, problem = math.nan, "raised"
            if problem:
                first_bad = i if first_bad is None else first_bad
                dropped += 1
                if self.on_error == "raise":
                    break
            values.append(value)
        if self.on_error == "raise":
            where = (
                f"sample {first_bad}"
                if first_bad is not None
                else "the batch (each sample alone passed)"
            )
            raise RewardError(
                f"reward function {name!r} raised {type(exc).__name__}: {exc} (at {where})"
            ) from exc
        if first_bad is None:  # fails only as a batch: nothing usable
            return [math.nan] * n, n
        return values, dropped


def _is_async(f: Callable) -> bool:
    call = type(f).__dict__.get("__call__")  # a callable object with `async def __call__`
    return inspect.iscoroutinefunction(f) or inspect.iscoroutinefunction(call)


def _run_coro(coro):
    """Run a coroutine to completion from sync code, also when this thread has a running loop
    (a notebook): then in a thread of its own."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()


def _run_async(funcs: list[Callable], batch: dict[str, Any]) -> list[Any]:
    """Every async function's output (or the exception it raised), run concurrently."""
    if not funcs:
        return []

    async def run_all():
        return await asyncio.gather(*(f(**batch) for f in funcs), return_exceptions=True)

    return list(_run_coro(run_all()))


def _sync(f: Callable) -> Callable:
    """An async reward function called as a sync one (to locate failing samples one by one)."""
    def call(**kwargs: Any) -> Any:
        return _run_coro(f(**kwargs))

    call.__name__ = _func_name(f)
    return call


def _as_reward(v: Any) -> tuple[float, str | None]:
    """(value, problem): None is a legitimate "no reward"; NaN, inf and non-numbers are problems."""
    if v is None:
        return math.nan, None
    if isinstance(v, torch.Tensor) and v.numel() == 1:
        v = v.item()
    if isinstance(v, (str, bytes)):
        return math.nan, f"a non-number ({type(v).__name__}: {v!r:.40})"
    try:
        value = float(v)  # int, float, bool, numpy scalars
    except (TypeError, ValueError):
        return math.nan, f"a non-number ({type(v).__name__}: {v!r:.40})"
    if not math.isfinite(value):
        return math.nan, f"{value} (rewards must be finite; return None for 'no reward')"
    return value, None


def _unique(names: list[str]) -> list[str]:
    seen: dict[str, int] = {}
    out = []
    for n in names:
        seen[n] = seen.get(n, 0) + 1
        out.append(n if seen[n] == 1 else f"{n}_{seen[n]}")
    return out
