"""Issue 26's user-facing cases, each as the user meets it: the exit code, the one line on
stderr, and (where a file is named) the files left as they were."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

import exactspec.audit
from exactspec.audit import lossy
from exactspec.cli import main
from exactspec.errors import InvalidValue
from tests.cli.conftest import ROOT, exactspec_process
from tests.engine.tiny import VOCAB, char_tokenizer, tiny_llama

GEN = ["--no-chat", "--max-new-tokens", "6"]


def _err_lines(capsys) -> list[str]:
    return [line for line in capsys.readouterr().err.splitlines() if line.strip()]


def _one_error(capsys, command: str) -> str:
    lines = _err_lines(capsys)
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"exactspec {command}: error: "), lines[0]
    return lines[0]


@pytest.fixture(scope="module")
def other_vocab_dir(tmp_path_factory) -> str:
    """A tiny Llama with 3 more logits than the CLI's tiny model: another vocabulary."""
    path = tmp_path_factory.mktemp("other-vocab")
    tiny_llama(1, vocab=VOCAB + 3, eos=0).save_pretrained(path)
    char_tokenizer().save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def gemma_dir(tmp_path_factory) -> str:
    """A tiny Gemma 3 (not a Llama architecture) with the character tokenizer."""
    from tests.models.architectures import tiny

    path = tmp_path_factory.mktemp("tiny-gemma")
    tiny("gemma3_text", 0, vocab=VOCAB).save_pretrained(path)
    char_tokenizer().save_pretrained(path)
    return str(path)


# --- a user's mistake is one line and exit 2, never "internal error" -----------------------

def test_eagle_head_for_another_target_is_a_user_error(model_dir, capsys):
    """`--model gemma3-270m --eagle`: the shipped smollm2 head on a target with other sizes."""
    assert main(["generate", "hi", "--model", model_dir, "--eagle", *GEN]) == 2
    line = _one_error(capsys, "generate")
    assert "this head was trained for hidden size 576" in line and "train-draft" in line


@pytest.mark.parametrize("command", [["generate", "hi", "--prompt-lookup"],
                                     ["serve", "--prompt-lookup"],
                                     ["batch", "in.jsonl", "out.jsonl", "--prompt-lookup"]])
def test_zero_draft_tokens_with_a_drafter_is_refused(command, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main([*command, "--num-draft-tokens", "0", "--model", "./no/such/model"]) == 2
    line = _one_error(capsys, command[0])
    assert "--num-draft-tokens: 0 drafts nothing" in line and "'auto'" in line
    assert "drop the drafter" in line
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("port", ["99999", "-1", "http"])
def test_a_bad_port_is_one_line_before_loading(port, capsys):
    assert main(["serve", "--port", port, "--model", "./no/such/model"]) == 2
    line = _one_error(capsys, "serve")
    assert "argument --port" in line and port in line


def test_a_busy_port_is_one_line_before_loading(capsys):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        # the model does not exist: had the model loaded first, that would be the error
        assert main(["serve", "--port", str(port), "--model", "./no/such/model"]) == 2
    line = _one_error(capsys, "serve")
    assert f"port {port} on 127.0.0.1 is already in use" in line and "--port" in line


def test_an_unknown_host_is_one_line(capsys):
    assert main(["serve", "--host", "no-such-host.invalid", "--model", "./no/such/model"]) == 2
    assert "--host 'no-such-host.invalid'" in _one_error(capsys, "serve")


def test_engine_eval_without_the_head_is_one_line_exit_2(tmp_path):
    done = subprocess.run([sys.executable, "-m", "exactspec.training.engine_eval",
                           str(tmp_path / "runs" / "head")], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2 and len(lines) == 1, done.stderr
    assert lines[0].startswith("python -m exactspec.training.engine_eval: error: no draft head")
    assert "Traceback" not in done.stderr


# --- the cross-vocabulary draft on the command line ----------------------------------------

def test_draft_with_another_vocabulary_names_the_cross_vocab_draft(model_dir, other_vocab_dir,
                                                                    capsys):
    assert main(["generate", "hi", "--model", model_dir, "--draft", other_vocab_dir, *GEN]) == 2
    line = _one_error(capsys, "generate")
    assert "vocabulary mismatch" in line
    assert "es.CrossVocabDraft" in line and "--cross-vocab-draft" in line


def test_cross_vocab_draft_flag_generates_the_plain_greedy_text(model_dir, capsys):
    """The target as its own cross-vocabulary draft (README: it accepts everything)."""
    greedy = [*GEN, "--temperature", "0", "--json"]
    assert main(["generate", "hi", "--model", model_dir, *greedy]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert main(["generate", "hi", "--model", model_dir, "--cross-vocab-draft", model_dir,
                 *greedy]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["drafter"] == f"cross-vocabulary draft {model_dir}"
    assert out["token_ids"] == plain["token_ids"] and out["stats"]["drafted"] > 0


def test_cross_vocab_draft_reaches_serve_and_batch(model_dir, monkeypatch):
    import exactspec.batch as batch
    from exactspec.batch import BatchResult
    from exactspec.cli.serve import drafter_choice
    from exactspec.drafters import CrossVocabDraft
    from exactspec.models import load
    from exactspec.serve import build_drafter

    seen = []
    monkeypatch.setattr(batch, "run_batch",
                        lambda cfg: seen.append(cfg) or BatchResult(0, 0, [], 0, 1.0, 0, 0, 1))
    assert main(["batch", "in.jsonl", "out.jsonl", "--cross-vocab-draft", model_dir]) == 0
    assert seen[0].engine.drafter == ("cross-vocab", model_dir)
    drafter = batch.DRAFTERS["cross-vocab"](None, model_dir)
    assert isinstance(drafter, CrossVocabDraft)

    from exactspec.cli import build_parser

    args = build_parser().parse_args(["serve", "--cross-vocab-draft", model_dir])
    drafter, name = build_drafter(drafter_choice(args), load(model_dir))
    assert isinstance(drafter, CrossVocabDraft) and name == f"cross-vocab-draft:{model_dir}"


# --- labels and warnings say what happened, once -------------------------------------------

def test_quantized_draft_label_names_the_backend_that_ran(gemma_dir, capsys, monkeypatch):
    """Where auto's measurement picks torch for a target llama.cpp could also run, the label
    says torch: it is read after decoding (before `begin` the auto backend reads llama.cpp; the
    label once said llama.cpp for gemma3 while torch ran)."""
    from exactspec.drafters import quantized, quantized_auto

    monkeypatch.setattr(quantized, "llama_cpp_available", lambda: True)  # as where it is built
    monkeypatch.setattr(quantized_auto, "pick", lambda *a, **k: "torch")  # torch measured faster
    monkeypatch.delenv("EXACTSPEC_QUANTIZED_BACKEND", raising=False)
    assert quantized.QuantizedDraft(8).backend == "llama.cpp"  # what a label read early says
    argv = ["generate", "hi", "--model", gemma_dir, "--quantized-draft", "8",
            "--temperature", "0", *GEN]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "quantized draft 8-bit (torch)" in out and "llama.cpp" not in out
    assert main([*argv, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["drafter"] == "quantized draft 8-bit (torch)"


def test_the_lossy_warning_is_printed_once(model_dir):
    proc = exactspec_process("generate", "hi", "--model", model_dir, "--prompt-lookup",
                             "--verify", "lenient:0.5", "--compare-plain", *GEN)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    lines = [line for line in err.decode().splitlines() if "lossy" in line.lower()]
    assert len(lines) == 1 and lines[0].startswith("warning: --verify lenient:0.5 is a lossy"), \
        lines


@pytest.mark.parametrize(("env", "shown"), [({}, False), ({"EXACTSPEC_PROGRESS": "1"}, True)])
def test_audit_bars_only_on_a_terminal_or_with_progress(env, shown, monkeypatch, capsys):
    """Under pytest stderr is not a terminal: no bar unless --progress asked for it."""
    seen = {}

    def fake(cfg, progress):
        seen["audit"] = progress
        return []

    def fake_lossy(cfg, progress):
        seen["lossy"] = progress
        raise InvalidValue("stop here")

    monkeypatch.delenv("EXACTSPEC_PROGRESS", raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(exactspec.audit, "run_audit", fake)
    monkeypatch.setattr(lossy, "run_lossy", fake_lossy)
    assert main(["audit"]) == 0
    assert main(["audit", "--lossy", "--png", ""]) == 2
    assert seen == {"audit": shown, "lossy": shown}


# --- clean interpreter exit, lazy names ------------------------------------------------------

def test_no_del_noise_at_exit_after_a_llama_cpp_draft(tmp_path, model_dir):
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not built here")
    script = tmp_path / "rl.py"
    script.write_text(
        "import exactspec as es\n"
        f"engine = es.Engine(es.load({model_dir!r}), drafter=es.QuantizedDraft(8, "
        "backend='llama.cpp'), params=es.SamplingParams(temperature=1.0), max_new_tokens=8)\n"
        "groups = engine.generate([[1, 2, 3]], n=2)\n"
        "print(len(groups[0]))\n")
    done = subprocess.run([sys.executable, str(script)], cwd=ROOT, capture_output=True,
                          text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0 and done.stdout.split() == ["2"], done.stderr
    assert "Exception ignored" not in done.stderr and "Traceback" not in done.stderr, done.stderr


@pytest.mark.parametrize("expr", [
    "es.sampling.RowStreams.__name__", "es.drafters.DynamicTree.__name__",
    "es.audit.chi_square.__name__", "es.GgufDraft.__name__", "es.errors.UserError.__name__"])
def test_subpackages_are_lazy_attributes_in_a_fresh_interpreter(expr):
    done = subprocess.run([sys.executable, "-c", f"import exactspec as es; print({expr})"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == expr.split(".")[-2]


def test_paths_are_compared_for_batch_before_the_model_loads(tmp_path, capsys, monkeypatch):
    """Covered fully in tests/batch/test_paths.py; here the one line through `main`."""
    monkeypatch.chdir(tmp_path)
    Path("in.jsonl").write_text('{"id": 1, "prompt": "a"}\n')
    assert main(["batch", "in.jsonl", "out.jsonl", "--errors", "in.jsonl"]) == 2
    assert "are the same file" in _one_error(capsys, "batch")
    assert Path("in.jsonl").read_text() == '{"id": 1, "prompt": "a"}\n'
