"""The `tandem` command line: generate, serve, bench, train."""

from __future__ import annotations

import argparse
import logging
import sys

from tandem.config import EngineConfig
from tandem.engine.arg_utils import add_engine_args, check_model_arg, engine_kwargs
from tandem.sampling_params import SamplingParams

DEFAULT_PROMPT = "What is the capital of France?"
LOG_LEVELS = ("debug", "info", "warning", "error")
MAX_NUM_SEQS = EngineConfig.max_num_seqs


def _generate(args: argparse.Namespace) -> int:
    # everything a user can get wrong is checked before the model loads (seconds on a CPU)
    params = SamplingParams(
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        max_tokens=args.max_tokens, seed=args.sampling_seed, n=args.n,
    )
    check_model_arg(args.model, args.load_format)
    prompts = args.prompt or [DEFAULT_PROMPT]
    kwargs = engine_kwargs(args)
    if kwargs["max_num_seqs"] is None:  # a KV cache for the sequences asked for, not for 256
        kwargs["max_num_seqs"] = min(MAX_NUM_SEQS, len(prompts) * args.n)
    from tandem import LLM

    EngineConfig.from_kwargs(**kwargs)  # the engine flags' own checks, still before loading
    tty = sys.stderr.isatty()
    if tty:  # loading takes seconds on a CPU (the first run also converts the embedded GGUF)
        print(f"loading {args.model or 'the embedded SmolLM2-135M-Instruct'} ...", file=sys.stderr,
              flush=True)
    llm = LLM(**kwargs)
    tok = llm.get_tokenizer()
    use_chat = args.chat if args.chat is not None else bool(tok is not None and tok.chat_template)
    bar = tty and len(prompts) * args.n > 1
    if use_chat:
        outs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params, use_tqdm=bar)
    else:
        outs = llm.generate(prompts, params, use_tqdm=bar)
    for prompt, out in zip(prompts, outs):
        for c in out.outputs:
            if len(prompts) > 1 or args.n > 1:
                print(f"[{prompt!r} #{c.index}] ", end="")
            print(c.text.strip())
    return 0


def _version() -> str:
    from tandem import __version__

    return f"tandem {__version__}"


class HelpFormatter(argparse.HelpFormatter):
    """Every flag's default, shown once: appended unless the help already states it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        auto = " (default: %(default)s)"  # BooleanOptionalAction appends this on its own
        text = text.removesuffix(auto)
        if "default" in text or not action.option_strings:
            return text
        flags = (argparse._StoreTrueAction, argparse._StoreFalseAction)
        if action.default is None or action.default is False or isinstance(action, flags):
            return text
        if action.default in ("", argparse.SUPPRESS):
            return text
        return text + auto


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tandem", description=__doc__)
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text offline (default: the embedded model)")
    gen.add_argument("prompt", nargs="*", help=f"prompt(s) (default: {DEFAULT_PROMPT!r})")
    gen.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                     help="apply the chat template (default: when the tokenizer has one)")
    defaults = SamplingParams()
    g = gen.add_argument_group("sampling")
    g.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    g.add_argument("--top-p", type=float, default=defaults.top_p,
                   help="sample from the smallest set of tokens whose probability reaches this")
    g.add_argument("--top-k", type=int, default=defaults.top_k,
                   help="sample from the k most likely tokens (0 or -1: all) (default: 0)")
    g.add_argument("--max-tokens", type=int, default=64, help="most tokens to generate per sample")
    g.add_argument("--n", type=int, default=defaults.n, help="samples per prompt")
    g.add_argument("--sampling-seed", type=int, default=None,
                   help="seed of these requests' sampling (default: the engine's --seed)")
    add_engine_args(gen)
    _set_default(gen, "max_num_seqs", None,
                 f"most sequences in one batch (default: the prompts x --n, at most {MAX_NUM_SEQS}; "
                 "it bounds the CPU KV cache)")
    gen.set_defaults(func=_generate)

    _add_optional_commands(sub)
    _finish(parser)
    return parser


def _set_default(parser: argparse.ArgumentParser, dest: str, default, help_: str) -> None:
    for action in parser._actions:
        if action.dest == dest:
            action.default, action.help = default, help_


def _leaves(parser: argparse.ArgumentParser):
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        yield parser
    for action in subs:
        for child in dict.fromkeys(action.choices.values()):  # aliases map to the same parser
            yield from _leaves(child)


def _finish(parser: argparse.ArgumentParser) -> None:
    """One help format everywhere, and --log-level on every command (debug: tracebacks)."""
    stack = [parser]
    while stack:
        p = stack.pop()
        p.formatter_class = HelpFormatter
        for a in p._actions:
            if isinstance(a, argparse._SubParsersAction):
                stack += list(a.choices.values())
    for leaf in _leaves(parser):
        if not any(a.dest == "log_level" for a in leaf._actions):
            leaf.add_argument("--log-level", default="warning", choices=LOG_LEVELS,
                              help="debug also prints the traceback of an error")


def _add_optional_commands(sub) -> None:
    """Commands whose modules pull in extra dependencies register themselves here."""
    from importlib import import_module

    bench = sub.add_parser("bench", help="benchmarks: throughput, serve, sweep, rl, interconnect, ...")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    registrations = [
        ("tandem.bench.throughput", "add_parser", bench_sub),
        ("tandem.bench.colocation", "add_parser", bench_sub),
        ("tandem.bench.rl", "add_parser", bench_sub),
        ("tandem.bench.cli", "add_bench_subcommands", bench_sub),
        ("tandem.serve.cli", "add_subcommands", sub),
        ("tandem.rl.cli", "add_subcommands", sub),
    ]
    for module, fn, target in registrations:
        try:
            mod = import_module(module)
        except ModuleNotFoundError as e:
            if e.name and e.name.startswith("tandem"):
                continue  # that part is not built
            raise
        getattr(mod, fn)(target)


def _name_flag(message: str, args: argparse.Namespace) -> str:
    """A config check's message names a field: 'max_num_seqs must be ...' -> '--max-num-seqs: ...'."""
    word = message.split(" ", 1)[0]
    name = word.rstrip(":")
    if word.startswith("--") or not name.isidentifier() or not hasattr(args, name):
        return message
    if word.endswith(":"):  # 'model: ...' -> '--model: ...'
        message = message[len(word):].lstrip()
    return f"--{name.replace('_', '-')}: {message}"


def error_line(e: BaseException, args: argparse.Namespace) -> str:
    """One line for a failed command: the flag and the fix for a user's mistake."""
    msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    if isinstance(e, ValueError):
        return f"error: {_name_flag(msg, args)}"
    if isinstance(e, (FileNotFoundError, PermissionError, IsADirectoryError)):
        return f"error: {msg}"
    return f"error: {type(e).__name__}: {msg} (--log-level debug prints the traceback)"


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    level = getattr(args, "log_level", "warning")
    logging.basicConfig(level=level.upper(), format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args) or 0
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # a user's mistake, or a failure worth one line: no traceback
        if level == "debug":
            raise
        print(error_line(e, args), file=sys.stderr)
        user_mistake = isinstance(e, (ValueError, FileNotFoundError, IsADirectoryError))
        return 2 if user_mistake else 1


if __name__ == "__main__":
    sys.exit(main())
