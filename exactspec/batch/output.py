"""The output file of a batch job: append-only JSONL, resumable after any crash.

Each finished sample is one line, written with a single `write` and flushed at once, so a
killed job leaves at most one partly written line: the last one, without its newline. On a
rerun `open_output` cuts that line off (its sample is redone), reads the (id, index) pairs
already present, and the job skips them, so no sample is lost and none is written twice. A
sidecar `OUT.job.json` records the settings that decide the samples (model, drafter, sampling,
seed, ...); resuming with different ones is refused, since the file would mix two jobs.
An exclusive lock on the file stops two jobs from appending to it at once.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
from pathlib import Path

from exactspec.batch.rows import id_key
from exactspec.errors import InvalidValue

log = logging.getLogger(__name__)


def job_file(out: Path) -> Path:
    """Where the settings of the job writing `out` are recorded."""
    return out.with_name(out.name + ".job.json")


class OutputFile:
    """An output JSONL opened for appending, with the (id, index) pairs it already holds."""

    def __init__(self, path: str | Path, settings: dict) -> None:
        self.path = Path(path)  # the output JSONL
        self.done: set[tuple[str, int]] = set()  # (id key, index) pairs already written
        self.repaired = 0  # bytes of a partly written last line that were cut off
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(self.path, "a+b")  # noqa: SIM115 (closed by close())
        try:
            fcntl.flock(self._f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._f.close()
            raise InvalidValue(f"{self.path} is being written by another exactspec batch job; "
                               "wait for it or choose another output file") from None
        try:
            self._check_settings(settings)
            self._scan()
        except BaseException:
            self._f.close()
            raise

    def _check_settings(self, settings: dict) -> None:
        meta = job_file(self.path)
        if meta.exists() and self.path.stat().st_size > 0:
            old = json.loads(meta.read_text())
            diff = sorted(k for k in set(old) | set(settings) if old.get(k) != settings.get(k))
            if diff:
                shown = ", ".join(f"{k}: {old.get(k)!r} before, {settings.get(k)!r} now"
                                  for k in diff)
                raise InvalidValue(f"{self.path} was written with other settings ({shown}); "
                                   "rerun with the same settings to resume, or write to a new "
                                   "output file")
        meta.write_text(json.dumps(settings, indent=1, sort_keys=True) + "\n")

    def _scan(self) -> None:
        """Read the finished lines; cut a partly written last line off."""
        f = self._f
        f.seek(0)
        data = f.read()
        end = data.rfind(b"\n") + 1  # bytes up to the last complete line
        if end < len(data):
            self.repaired = len(data) - end
            log.warning("%s: the last line was partly written (%d bytes, a crash); it is cut "
                        "off and its sample redone", self.path, self.repaired)
            f.truncate(end)
            f.flush()
            os.fsync(f.fileno())
        for number, line in enumerate(data[:end].splitlines(), start=1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                key = (id_key(rec["id"]), int(rec["index"]))
            except (ValueError, KeyError, TypeError) as exc:
                raise InvalidValue(f"{self.path} line {number} is not an output row ({exc}); "
                                   "the file was changed by something else: remove that line "
                                   "or write to a new output file") from None
            if key in self.done:
                raise InvalidValue(f"{self.path} line {number} repeats id {key[0]} index "
                                   f"{key[1]}; remove the duplicate line")
            self.done.add(key)
        f.seek(0, os.SEEK_END)

    def write(self, records: list[dict]) -> None:
        """Append finished samples, one line each, and flush them to the OS at once."""
        for rec in records:
            key = (id_key(rec["id"]), int(rec["index"]))
            assert key not in self.done, key
            self._f.write((json.dumps(rec, ensure_ascii=False) + "\n").encode("utf-8"))
            self.done.add(key)
        self._f.flush()

    def close(self) -> None:
        if not self._f.closed:
            self._f.flush()
            os.fsync(self._f.fileno())
            self._f.close()

    def __enter__(self) -> OutputFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
