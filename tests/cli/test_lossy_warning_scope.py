"""The CLI drops the library's lossy-rule warning (it prints its own line) only while a command
runs: an in-process caller running the CLI and then the library still sees the library's."""

from __future__ import annotations

import logging

from exactspec.cli.common import end_lossy_warning, warn_lossy

LOGGER = "exactspec.engine.arguments"
RECORD = "verify='lenient:2' is a LOSSY rule: the output is not distributed as the target's"


def _passes(record_text: str) -> bool:
    logger = logging.getLogger(LOGGER)
    record = logger.makeRecord(LOGGER, logging.WARNING, __file__, 1, record_text, None, None)
    return logger.filter(record)


def test_the_library_warning_is_dropped_during_a_command_and_back_after(capsys):
    warn_lossy("lenient:2")
    assert "is a lossy rule" in capsys.readouterr().err
    assert not _passes(RECORD)  # the CLI's line stands for it while the command runs
    end_lossy_warning()
    assert _passes(RECORD)


def test_main_ends_the_scope_even_when_the_command_fails(monkeypatch):
    from exactspec import cli

    def failing(args):
        warn_lossy("lenient:2")
        raise RuntimeError("boom")

    parser = cli.build_parser()
    args = parser.parse_args(["audit"])
    monkeypatch.setattr(cli, "build_parser", lambda: type(
        "P", (), {"parse_args": lambda self, argv: args})())
    monkeypatch.setattr(args, "run", failing, raising=False)
    assert cli.main([]) == 1
    assert _passes(RECORD)
