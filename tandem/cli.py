"""The `tandem` command line: generate, serve, bench, train."""

from __future__ import annotations

import argparse
import sys

from tandem.engine.arg_utils import add_engine_args, engine_kwargs
from tandem.sampling_params import SamplingParams


def _generate(args: argparse.Namespace) -> int:
    from tandem import LLM

    llm = LLM(**engine_kwargs(args))
    params = SamplingParams(
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        max_tokens=args.max_tokens, seed=args.sampling_seed, n=args.n,
    )
    prompts = args.prompt or ["What is the capital of France?"]
    tok = llm.get_tokenizer()
    use_chat = args.chat if args.chat is not None else bool(tok is not None and tok.chat_template)
    if use_chat:
        outs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params, use_tqdm=False)
    else:
        outs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        for c in out.outputs:
            if len(prompts) > 1 or args.n > 1:
                print(f"[{prompt!r} #{c.index}] ", end="")
            print(c.text.strip())
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tandem", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text offline (default: the embedded model)")
    gen.add_argument("prompt", nargs="*", help="prompt(s); default: 'What is the capital of France?'")
    gen.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                     help="apply the chat template (default: when the tokenizer has one)")
    defaults = SamplingParams()
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default: 0)")
    gen.add_argument("--top-p", type=float, default=defaults.top_p)
    gen.add_argument("--top-k", type=int, default=defaults.top_k)
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--n", type=int, default=defaults.n)
    gen.add_argument("--sampling-seed", type=int, default=None)
    add_engine_args(gen)
    gen.set_defaults(func=_generate)

    _add_optional_commands(sub)
    return parser


def _add_optional_commands(sub) -> None:
    """Commands whose modules pull in extra dependencies register themselves here."""
    from importlib import import_module

    bench = sub.add_parser("bench", help="benchmarks: throughput, serve, sweep, interconnect, ...")
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


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args) or 0
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
