"""`--verify` on the server: a lossy rule is announced at start-up (stderr, as `exactspec
generate` does) and on every answer (`exactspec.lossless`, header X-Exactspec-Lossless), and
greedy verification refuses sampled requests; answers equal `es.generate` with the same rule."""

from __future__ import annotations

import pytest

import exactspec as es
import exactspec.serve
from exactspec.cli import main
from exactspec.sampling import parse_method
from tests.batch.tiny_dir import save_tiny
from tests.serve.conftest import NAME, client, openai, start

PROMPT = "abcabcab"


def test_a_lossy_server_says_so_on_every_answer_and_equals_generate(tiny):
    with start(tiny, es.PromptLookup(), engine={"verify": "lenient:0.5"}) as srv:
        c = client(srv)
        raw = c.completions.with_raw_response.create(model=NAME, prompt=PROMPT, max_tokens=16,
                                                     n=2, seed=3, temperature=1.0)
        r = raw.parse()
        stream = list(c.completions.create(model=NAME, prompt=PROMPT, max_tokens=8, seed=3,
                                           stream=True, stream_options={"include_usage": True}))
        (model,) = c.models.list().data
    gens = es.generate(tiny, [tiny.encode(PROMPT)] * 2, drafter=es.PromptLookup(),
                       params=es.SamplingParams(seed=3), max_new_tokens=16, verify="lenient:0.5")
    assert [ch.text for ch in r.choices] == [g.text for g in gens]
    assert [g.lossless for g in gens] == [False, False]
    assert raw.headers["x-exactspec-lossless"] == "false"
    ext = r.model_extra["exactspec"]
    assert ext["lossless"] is False and ext["verify"] == "lenient:0.5"
    assert stream[-1].model_extra["exactspec"]["lossless"] is False
    assert model.model_extra["lossless"] is False


def test_a_lossless_server_says_lossless(server):
    raw = client(server).completions.with_raw_response.create(model=NAME, prompt=PROMPT,
                                                              max_tokens=4, seed=1)
    assert raw.headers["x-exactspec-lossless"] == "true"
    ext = raw.parse().model_extra["exactspec"]
    assert ext["lossless"] is True and ext["verify"] == "token"


def test_greedy_verify_refuses_sampled_requests(tiny):
    with start(tiny, es.PromptLookup(), engine={"verify": "greedy"}) as srv:
        c = client(srv)
        with pytest.raises(openai.BadRequestError) as err:
            c.completions.create(model=NAME, prompt=PROMPT, max_tokens=4, temperature=0.8)
        r = c.completions.create(model=NAME, prompt=PROMPT, max_tokens=12, temperature=0)
    assert err.value.body["param"] == "temperature"
    assert "temperature=0.8" in err.value.body["message"]
    (g,) = es.generate(tiny, [PROMPT], params=es.SamplingParams(temperature=0), max_new_tokens=12)
    assert r.choices[0].text == g.text
    assert r.model_extra["exactspec"]["lossless"] is True


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("lossy") / "model")


@pytest.fixture
def served(monkeypatch):
    """Replaces the blocking `serve` call: records (drafter, config) instead."""
    calls = []
    monkeypatch.setattr(exactspec.serve, "serve", lambda model, drafter, config, **kw:
                        calls.append((drafter, config)))
    return calls


def test_cli_verify_lossy_warns_on_stderr(tiny_dir, served, capsys):
    assert main(["serve", "--model", str(tiny_dir), "--prompt-lookup", "--verify",
                 "typical:0.09"]) == 0
    ((_, config),) = served
    assert config.engine.verify == parse_method("typical:0.09")  # parsed once
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("warning: --verify typical:0.09 is a lossy rule")


@pytest.mark.parametrize("name, method", [("block", "Block"), ("traversal", "Traversal"),
                                          ("greedy", "Greedy")])
def test_cli_lossless_verify_is_quiet_and_parsed_once(tiny_dir, served, capsys, name, method):
    """--verify reaches the server as its method object (traversal: block on chains, as in
    generate), never as the string."""
    assert main(["serve", "--model", str(tiny_dir), "--prompt-lookup", "--verify", name]) == 0
    verify = served[0][1].engine.verify
    assert type(verify).__name__ == method and verify.name == name
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("argv, message", [
    (["--prompt-lookup", "--verify", "lenient:2"], "L must be a number in (0, 1]"),
    (["--prompt-lookup", "--verify", "tokn"], "unknown verify method"),
    (["--quantized-draft", "--draft-backend", "torch", "--tree", "2,1", "--verify", "block"],
     "cannot verify token trees (block verification's tree form is 'traversal')"),
    (["--verify", "lenient:0.5"], "--verify only applies with a drafter"),
])
def test_cli_bad_verify_is_refused_in_one_line(tiny_dir, served, capsys, argv, message):
    assert main(["serve", "--model", str(tiny_dir), *argv]) == 2
    assert message in capsys.readouterr().err and not served
