"""The command line as a person meets it: a mistake is one line naming the flag (exit 2), found
before any model loads, never a traceback; every flag has help and shows its default once."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

import tandem
from tandem import cli

BAD = [  # (argv, the flag the error line must name)
    (["generate", "--temperature", "-1", "hi"], "--temperature"),
    (["generate", "--top-p", "2"], "--top-p"),
    (["generate", "--n", "0"], "--n"),
    (["generate", "--max-tokens", "0"], "--max-tokens"),
    (["generate", "--dtype", "float8"], "--dtype"),
    (["generate", "--max-num-seqs", "0"], "--max-num-seqs"),
    (["generate", "--model", "/nonexistent"], "--model"),
    (["generate", "--model", "qwen2.5-1.5b"], "--load-format dummy"),
    (["serve", "/nonexistent"], "MODEL"),
    (["serve", "--port", "-1"], "--port"),
    (["serve", "--port", "70000"], "--port"),
    (["train", "grpo", "--model", "/nonexistent"], "--model"),
    (["train", "grpo", "--dataset", "missing.jsonl"], "--dataset"),
    (["train", "grpo", "--rewards", "bogus"], "--rewards"),
    (["train", "grpo", "--num-generations", "1"], "--num-generations"),
    (["bench", "throughput", "--model", "/nonexistent"], "--model"),
    (["bench", "rl", "--compare", "bogus", "--device", "cpu"], "--compare"),
]


@pytest.fixture(autouse=True)
def _no_model_loads(monkeypatch):
    """Every case must fail before a model loads: loading one fails the test."""
    def refuse(*a, **k):
        raise AssertionError("a model was loaded before the mistake was found")

    monkeypatch.setattr(tandem, "LLM", refuse)
    monkeypatch.setattr("tandem.engine.llm.LLM.__init__", refuse)


@pytest.mark.parametrize("argv,flag", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_a_mistake_is_one_line_naming_the_flag(argv, flag, capsys):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err
    assert len(err.splitlines()) == 1 and err.startswith("error: "), err
    assert flag in err, err


def test_argparse_mistakes_exit_2_without_traceback(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["generate", "--temperature", "abc"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "--temperature" in err.splitlines()[-1]


def test_debug_log_level_shows_the_traceback():
    with pytest.raises(ValueError, match="temperature"):
        cli.main(["generate", "--temperature", "-1", "--log-level", "debug"])


def test_an_unexpected_failure_is_one_line_with_a_hint(monkeypatch, capsys):
    def boom(args):
        raise RuntimeError("CUDA error: out of memory\nmore lines")

    parser = cli.build_parser()
    args = parser.parse_args(["generate"])
    assert "--log-level debug" in cli.error_line(RuntimeError("x"), args)
    monkeypatch.setattr(cli, "_generate", boom)
    monkeypatch.setattr(cli, "build_parser", lambda: _with_func(parser, boom))
    assert cli.main(["generate"]) == 1
    err = capsys.readouterr().err.strip()
    assert err == ("error: RuntimeError: CUDA error: out of memory "
                   "(--log-level debug prints the traceback)")


def _with_func(parser, func):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            action.choices["generate"].set_defaults(func=func)
    return parser


def _leaf_parsers(parser, path=("tandem",)):
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        yield " ".join(path), parser
    for action in subs:
        for name, child in action.choices.items():
            yield from _leaf_parsers(child, path + (name,))


def test_every_flag_has_help_and_its_default_once():
    for path, parser in _leaf_parsers(cli.build_parser()):
        text = parser.format_help()
        for action in parser._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            assert action.help, f"{path} {action.option_strings or action.dest} has no help"
            shown = parser._get_formatter()._expand_help(action) if action.help else ""
            assert shown.count("(default") <= 1, f"{path} {action.option_strings}: {shown}"
        assert "--log-level" in text, path


def test_train_grpo_help_shows_the_demo_defaults():
    help_ = dict(_leaf_parsers(cli.build_parser()))["tandem train grpo"].format_help()
    flat = " ".join(help_.split())
    assert "(default: -1; the demo without --model: 10 on a CPU, 60 on a GPU)" in flat
    assert "GRPOConfig default" not in flat


def test_generate_sizes_the_batch_and_so_the_cpu_kv_cache_to_the_request(monkeypatch):
    seen = {}

    class FakeLLM:
        def __init__(self, **kwargs):
            seen.update(kwargs)

        def get_tokenizer(self):
            return None

        def generate(self, prompts, params, use_tqdm):
            return []

    monkeypatch.setattr(tandem, "LLM", FakeLLM)
    assert cli.main(["generate", "a", "b", "--n", "2"]) == 0
    assert seen["max_num_seqs"] == 4
    assert cli.main(["generate", "a", "--max-num-seqs", "7"]) == 0
    assert seen["max_num_seqs"] == 7


def test_version_from_a_fresh_process():
    proc = subprocess.run([sys.executable, "-m", "tandem.cli", "--version"], capture_output=True,
                          text=True, timeout=120, check=False)
    assert proc.returncode == 0 and proc.stdout.strip() == f"tandem {tandem.__version__}"
