"""Structured outputs (`SamplingParams(structured_outputs=...)`): every sampled completion, over
many seeds, matches its JSON schema, regex or choice; greedy or sampled, batched with free rows."""

import json
import re

import pytest
from model_fixtures import assert_no_leak, make_tiny_model, make_tokenizer

from tandem import LLM, SamplingParams, StructuredOutputsParams

jsonschema = pytest.importorskip("jsonschema")  # a dev dependency; GPU hosts may lack it

pytest.importorskip("llguidance")

SCHEMA = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "city": {"enum": ["Paris", "Rome", "Oslo"]},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["ok", "city", "n"],
    "additionalProperties": False,
}
PROMPTS = ["The capital of France is", "Hello, my name is"]


@pytest.fixture(scope="module")
def llm():
    """llguidance for every constraint (regexes and choices too: the tests of its host path)."""
    tok = make_tokenizer()
    return LLM(make_tiny_model("llama", eos_token_id=tok.eos_token_id), tokenizer=tok, block_size=4,
               structured_outputs_backend="guidance")


@pytest.fixture(scope="module")
def fsm_llm():
    """The default backend (regexes and choices as token automata), decoding in windows of 4
    with async scheduling, as on a GPU."""
    tok = make_tokenizer()
    return LLM(make_tiny_model("llama", eos_token_id=tok.eos_token_id), tokenizer=tok, block_size=4,
               async_scheduling=True, num_scheduler_steps=4)


def sample(llm, so, n=6, seeds=(0, 1), **kw):
    outs = []
    for seed in seeds:
        params = SamplingParams(n=n, temperature=1.0, seed=seed, max_tokens=48,
                                structured_outputs=so, **kw)
        outs += [c for o in llm.generate(PROMPTS, params, use_tqdm=False) for c in o.outputs]
    return outs


def test_json_schema_every_sample_validates(llm):
    outs = sample(llm, StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True))
    assert len(outs) == 24
    for c in outs:
        assert c.finish_reason == "stop", c.text
        jsonschema.validate(json.loads(c.text), SCHEMA)
    assert len({c.text for c in outs}) > 1  # sampled, not one forced string
    assert_no_leak(llm)


@pytest.mark.parametrize("backend", ["guidance", "auto"])
def test_regex_and_choice(llm, fsm_llm, backend):
    llm = llm if backend == "guidance" else fsm_llm
    pattern = r"[0-9]{3}-[a-z]{2}"
    for c in sample(llm, StructuredOutputsParams(regex=pattern)):
        assert re.fullmatch(pattern, c.text), c.text
    choices = ["yes", "no", "maybe so"]
    texts = {c.text for c in sample(llm, StructuredOutputsParams(choice=choices))}
    assert texts <= set(choices) and len(texts) > 1


def test_constrained_rows_beside_free_ones(llm):
    """One batch: a constrained request, a free one and a greedy constrained one; the free
    request's tokens are those it gets alone."""
    free = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    alone = llm.generate(PROMPTS[:1], free, use_tqdm=False)[0].outputs[0].token_ids
    so = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
    params = [SamplingParams(temperature=1.0, seed=3, max_tokens=48, structured_outputs=so), free,
              SamplingParams(temperature=0, max_tokens=48, structured_outputs=so)]
    outs = llm.generate([PROMPTS[1], PROMPTS[0], PROMPTS[1]], params, use_tqdm=False)
    jsonschema.validate(json.loads(outs[0].outputs[0].text), SCHEMA)
    jsonschema.validate(json.loads(outs[2].outputs[0].text), SCHEMA)
    assert outs[1].outputs[0].token_ids == alone


@pytest.mark.parametrize("tokens_back", [True, False], ids=["advanced-before-scheduling", "advanced-after-launch"])
def test_async_scheduling_gives_the_same_outputs(llm, monkeypatch, tokens_back):
    """Under async scheduling the grammars take the in-flight step's tokens on the worker thread:
    before the next step is scheduled when those tokens are back already (a host-bound step),
    else once its forward is launched; the engine reads that step back meanwhile. The outputs,
    finish reasons included (a choice's grammar completes mid-run, a JSON object's at its
    closing brace or the length cap), are the synchronous engine's."""
    from tandem.engine.async_output import AsyncSamplerOutput

    json_so = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
    choice_so = StructuredOutputsParams(choice=["yes", "no", "maybe so"])
    params = [SamplingParams(n=2, temperature=1.0, seed=5, max_tokens=48, structured_outputs=json_so),
              SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=16, ignore_eos=True,
                             structured_outputs=choice_so)]

    def run(engine):
        outs = engine.generate([p for p in PROMPTS for _ in params], params * len(PROMPTS), use_tqdm=False)
        return [(c.text, c.finish_reason, c.token_ids) for o in outs for c in o.outputs]

    sync = run(llm)
    tok = llm.get_tokenizer()
    other = LLM(make_tiny_model("llama", eos_token_id=tok.eos_token_id), tokenizer=tok, block_size=4,
                async_scheduling=True, structured_outputs_backend="guidance")
    monkeypatch.setattr(AsyncSamplerOutput, "ready", lambda self: tokens_back)
    filler = other.llm_engine.worker.model_runner.fill_bitmask
    fills, early = [], []
    fill_async, advance_async = filler.fill_async, filler.advance_async
    filler.fill_async = lambda matchers, advance=(): fills.append((len(matchers), len(advance))) or \
        fill_async(matchers, advance)
    filler.advance_async = lambda pairs: early.append(len(pairs)) or advance_async(pairs)
    got = run(other)
    assert got == sync
    per_prompt = [got[i : i + 5] for i in range(0, len(got), 5)]
    for outs in per_prompt:
        for text, reason, _ in outs[:2]:
            assert reason == "length" or jsonschema.validate(json.loads(text), SCHEMA) is None
        assert all(text in ("yes", "no", "maybe so") and reason == "stop" for text, reason, _ in outs[2:])
    # every constrained row's grammar took its token on the worker thread in one go, on the path
    # this case takes, and the masks were filled there while the engine read the step back
    advanced = early if tokens_back else [a for _, a in fills]
    assert fills and advanced and max(advanced) == 5 * len(PROMPTS)
    if tokens_back:
        assert all(a == 0 for _, a in fills)  # the fills came after the early advances
    else:
        assert early == []
    assert other.llm_engine._grammar_held == [] and other.llm_engine._grammar_rows == []
    assert_no_leak(other)


def test_token_automata_give_llguidances_outputs(llm, fsm_llm, monkeypatch):
    """Regexes as token automata stepping on the device, in windows of 4 under async scheduling,
    sample exactly what llguidance's host masks give step by step (same seeds): the same tokens,
    logprobs, texts and finish reasons (a grammar complete mid-window, a regex's EOS, ignore_eos,
    the length cap). Their rows ran in windows, and every device slot came back. (A pattern that
    forces bytes, as a choice does once unambiguous, may differ: llguidance then allows only
    their canonical tokenization, an automaton any; tests/engine/test_token_fsm.py.)"""
    runner = fsm_llm.llm_engine.worker.model_runner
    windows = []
    run_window = runner._run_window
    monkeypatch.setattr(runner, "_run_window", lambda sched, *a: windows.append(
        sum(s.fsm is not None for s in sched.seqs)) or run_window(sched, *a))
    regex = StructuredOutputsParams(regex=r"[a-z]{2,6}( [a-z]{1,5}){0,3}")
    short = StructuredOutputsParams(regex=r"[a-z]{1,3}")
    params = [SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=24, structured_outputs=regex),
              SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=16, ignore_eos=True,
                             structured_outputs=short),
              SamplingParams(temperature=0, max_tokens=6, structured_outputs=regex),
              SamplingParams(n=2, temperature=1.0, seed=9, max_tokens=12, ignore_eos=True)]

    def run(engine):
        outs = engine.generate([p for p in PROMPTS for _ in params], params * len(PROMPTS), use_tqdm=False)
        return [(c.text, c.finish_reason, c.token_ids, c.cumulative_logprob) for o in outs for c in o.outputs]

    want, got = run(llm), run(fsm_llm)
    assert got == want
    reasons = {r for _, r, _, _ in got}
    assert {"stop", "length"} <= reasons
    assert windows and max(windows) > 0  # constrained rows decoded in windows
    assert runner.fsm_states.num_bound == 0
    assert_no_leak(fsm_llm)


def test_closed_json_schemas_run_as_token_automata(fsm_llm):
    """A closed schema (additionalProperties false, no numeric bounds) compiles to a token
    automaton; its samples, in windows, all validate. An open one goes to llguidance."""
    closed = {"type": "object", "properties": {
        "ok": {"type": "boolean"}, "city": {"enum": ["Paris", "Rome", "Oslo"]},
        "n": {"type": "integer"}, "note": {"type": "string", "maxLength": 6}},
        "required": ["ok", "city", "n"], "additionalProperties": False}
    manager = fsm_llm.llm_engine.structured_outputs
    outs = sample(fsm_llm, StructuredOutputsParams(json=closed, disable_any_whitespace=True), n=4, seeds=(0, 1, 2))
    assert [v for k, v in manager._fsms.items() if k.startswith(r"\{")]  # compiled, not refused
    assert not isinstance(next(v for k, v in manager._fsms.items() if k.startswith(r"\{")), str)
    done = [c for c in outs if c.finish_reason == "stop"]
    assert len(done) >= len(outs) // 2, [c.text for c in outs]
    for c in done:
        jsonschema.validate(json.loads(c.text), closed)
    open_schema = dict(closed, additionalProperties=True)
    assert not isinstance(manager.sample_grammars(StructuredOutputsParams(json=open_schema), 1)[0],
                          type(manager.sample_grammars(StructuredOutputsParams(json=closed), 1)[0]))
    assert_no_leak(fsm_llm)


def test_aborted_constrained_samples_give_their_device_slots_back(fsm_llm):
    engine = fsm_llm.llm_engine
    so = StructuredOutputsParams(regex=r"[a-z ]*")
    rid = engine.add_request(None, PROMPTS[0], SamplingParams(n=4, seed=1, max_tokens=40,
                                                              structured_outputs=so))
    for _ in range(3):
        engine.step()
    assert engine.worker.model_runner.fsm_states.num_bound == 4
    engine.abort_request(rid)
    while engine.has_unfinished_requests():
        engine.step()
    engine.step()  # (the in-flight step, if any)
    assert engine.worker.model_runner.fsm_states.num_bound == 0
    assert_no_leak(fsm_llm)


def test_fsm_backend_refuses_what_is_not_regular():
    tok = make_tokenizer()
    strict = LLM(make_tiny_model("llama", eos_token_id=tok.eos_token_id), tokenizer=tok,
                 structured_outputs_backend="fsm")
    so = StructuredOutputsParams(json=SCHEMA)
    with pytest.raises(ValueError, match="structured_outputs_backend='fsm'"):
        strict.generate(PROMPTS[:1], SamplingParams(structured_outputs=so), use_tqdm=False)
    with pytest.raises(ValueError, match="structured_outputs_backend"):
        LLM(make_tiny_model("llama"), tokenizer=tok, structured_outputs_backend="xgrammar")
    out = strict.generate(PROMPTS[:1], SamplingParams(max_tokens=8, structured_outputs=StructuredOutputsParams(
        choice=["yes", "no"])), use_tqdm=False)  # still usable
    assert out[0].outputs[0].text in ("yes", "no")
    assert_no_leak(strict)


def test_bad_constraints_are_refused(llm):
    with pytest.raises(ValueError, match="exactly one of"):
        StructuredOutputsParams(json=SCHEMA, regex="a")
    with pytest.raises(ValueError, match="invalid grammar"):
        llm.generate(PROMPTS[:1], SamplingParams(structured_outputs=StructuredOutputsParams(regex="[0-9")),
                     use_tqdm=False)
    assert_no_leak(llm)


def _mask_bits(mask) -> list[int]:
    """The token ids a [1, words] int32 bitmask allows."""
    words = mask.view(-1).tolist()
    return [32 * w + b for w, word in enumerate(words) for b in range(32) if (word >> b) & 1]


def test_compiled_grammars_start_with_their_first_mask_and_give_the_same_masks(llm):
    """The manager computes a grammar's first mask on its template at compile time (copies inherit
    llguidance's cached mask); along the same tokens a copy's masks are a fresh matcher's."""
    import llguidance

    from tandem.engine.structured_output import BitmaskFiller, grammar_source

    engine = llm.llm_engine
    manager = engine.structured_outputs
    V = engine.hf_config.vocab_size
    filler = BitmaskFiller(V, pin=False)
    for so in (StructuredOutputsParams(regex=r"[a-z ]{0,12}"), StructuredOutputsParams(json=SCHEMA)):
        copy = manager.matcher(so)
        fresh = llguidance.LLMatcher(manager.tokenizer, grammar_source(so), log_level=0)
        for step in range(6):
            allowed = _mask_bits(filler([copy]))
            assert allowed == _mask_bits(filler([fresh])) and allowed
            token = allowed[(7 * step + 3) % len(allowed)]
            assert copy.consume_token(token) and fresh.consume_token(token)
            if copy.is_stopped():
                break


def test_bitmask_filler_advance_reports_refused_tokens(llm):
    """`advance` (the worker's consume before a fill) says which matcher refused its token, once;
    a refused token leaves that matcher in error and the others as they were."""
    from tandem.engine.structured_output import BitmaskFiller

    engine = llm.llm_engine
    manager = engine.structured_outputs
    filler = BitmaskFiller(engine.hf_config.vocab_size, pin=False)
    so = StructuredOutputsParams(choice=["yes", "no"])
    matchers = [manager.matcher(so) for _ in range(3)]
    good = _mask_bits(filler([matchers[0]]))
    bad = next(t for t in range(engine.hf_config.vocab_size) if t not in set(good))
    assert filler.take_accepted() is None
    assert filler.advance([(matchers[0], good[0]), (matchers[1], bad), (matchers[2], good[-1])]) == [True, False, True]
    assert filler.take_accepted() == [True, False, True] and filler.take_accepted() is None
    assert matchers[1].is_error() and not matchers[0].is_error() and not matchers[2].is_error()
    assert filler.advance([(matchers[0], bad)]) == [False]  # one row: consumed on this thread


def test_streamed_constrained_outputs_match_under_async_scheduling(llm):
    """Streamed (delta, every 3 tokens) outputs of constrained requests, one of whose samples stops
    at a stop string while another's grammar is still taking its token: the async engine emits
    the same deltas and finish reasons per request as the synchronous one (the requests of held
    rows emit with the grammars' verdicts, what the read-back had due for them included)."""
    choice_so = StructuredOutputsParams(choice=["no, never", "maybe so, perhaps", "well then, yes"])
    json_so = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
    requests = [("a", SamplingParams(n=4, temperature=1.0, seed=11, max_tokens=24, stop=[","],
                                     structured_outputs=choice_so)),
                ("b", SamplingParams(n=2, temperature=1.0, seed=12, max_tokens=40, structured_outputs=json_so)),
                ("c", SamplingParams(n=2, temperature=1.0, seed=13, max_tokens=6, ignore_eos=True))]

    def stream(async_scheduling):
        tok = llm.get_tokenizer()
        engine_llm = LLM(make_tiny_model("llama", eos_token_id=tok.eos_token_id), tokenizer=tok, block_size=4,
                         async_scheduling=async_scheduling, stream_interval=3)
        engine = engine_llm.llm_engine
        for (rid, params), prompt in zip(requests, PROMPTS * 2):
            engine.add_request(rid, prompt, params, output_kind="delta")
        got = {rid: [] for rid, _ in requests}
        while engine.has_unfinished_requests():
            for out in engine.step():
                got[out.request_id].append([(c.index, tuple(c.token_ids), c.text, c.finish_reason)
                                            for c in out.outputs])
        return got, engine_llm

    sync, _ = stream(False)
    got, other = stream(True)
    assert got == sync
    finished = {c[0]: c[3] for out in got["a"] for c in out if c[3]}
    assert finished == {0: "stop", 1: "stop", 2: "stop", 3: "stop"}
    engine = other.llm_engine
    assert engine._grammar_held == [] and engine._grammar_touched == {}
    assert_no_leak(other)


@pytest.mark.parametrize("failing", ["_advance", "_fill"])
def test_a_grammar_failing_on_the_worker_fails_the_step_and_holds_nothing(monkeypatch, failing):
    """llguidance raising on the worker thread (taking the tokens or filling the masks, while the
    engine reads the previous step back) surfaces from `step()`; the engine keeps no held rows or
    pending verdicts, its requests can be aborted without a leak, and it serves the next ones."""
    from tandem.engine.structured_output import BitmaskFiller

    tok = make_tokenizer()
    other = LLM(make_tiny_model("llama", eos_token_id=tok.eos_token_id), tokenizer=tok, block_size=4,
                async_scheduling=True, structured_outputs_backend="guidance")
    engine = other.llm_engine
    so = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
    params = SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=24, structured_outputs=so)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", prompt, params)
    method = getattr(BitmaskFiller, failing)
    calls = []

    def fail_third_call(self, *args):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("grammar engine failure")
        return method(self, *args)

    monkeypatch.setattr(BitmaskFiller, failing, fail_third_call)
    with pytest.raises(RuntimeError, match="grammar engine failure"):
        while engine.has_unfinished_requests():
            engine.step()
    assert engine._grammar_held == [] and engine._grammar_rows == [] and engine._grammar_touched == {}
    engine.abort_request(list(engine.requests))
    while engine.has_unfinished_requests() or engine._in_flight is not None:
        engine.step()
    monkeypatch.setattr(BitmaskFiller, failing, method)
    outs = other.generate(PROMPTS, params, use_tqdm=False)
    for c in (c for o in outs for c in o.outputs):
        assert c.finish_reason == "length" or jsonschema.validate(json.loads(c.text), SCHEMA) is None
    assert_no_leak(other)


def test_token_automata_keep_their_state_through_preemption(llm):
    """A KV cache too small for the batch: constrained samples are preempted and recomputed while
    decoding in windows under async scheduling; each keeps its device slot and state, so the
    outputs are llguidance's (which keeps its matcher) under the same pressure."""
    tok = llm.get_tokenizer()
    regex = StructuredOutputsParams(regex=r"[a-z]{2,6}( [a-z]{1,5}){0,4}")
    params = SamplingParams(n=4, temperature=1.0, seed=11, max_tokens=24, structured_outputs=regex)
    kw = {"tokenizer": tok, "block_size": 4, "num_gpu_blocks_override": 14, "max_model_len": 48}
    model = make_tiny_model("llama", eos_token_id=tok.eos_token_id)
    outs = {}
    for backend in ("guidance", "auto"):
        engine = LLM(model, structured_outputs_backend=backend, async_scheduling=True,
                     num_scheduler_steps=4, **kw)
        got = engine.generate(PROMPTS, params, use_tqdm=False)
        outs[backend] = [(c.text, c.finish_reason, c.token_ids) for o in got for c in o.outputs]
        assert engine.llm_engine.scheduler.num_preemptions > 0
        assert engine.llm_engine.worker.model_runner.fsm_states.num_bound == 0
        assert_no_leak(engine)
    assert outs["auto"] == outs["guidance"]
    assert all(re.fullmatch(r"[a-z]{2,6}( [a-z]{1,5}){0,4}", t) for t, _, _ in outs["auto"])
