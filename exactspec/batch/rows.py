"""Input rows of a batch job: parsing, validation with line numbers, per-row seeds.

An input line is a JSON object `{"id": ..., "prompt": "..."}` or `{"id": ..., "messages":
[{"role": ..., "content": ...}, ...]}`, with optional per-row overrides of the job's settings
(OVERRIDES: the SamplingParams fields, `max_new_tokens`, `n`). Other keys are the user's own
metadata and are ignored. A bad line (not JSON, no prompt, a bad id, a duplicate id, a bad
override) is reported with its line number, never dropped silently.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

from exactspec.sampling import SamplingParams

# Per-row keys that override the job's settings.
SAMPLING_KEYS = tuple(f.name for f in fields(SamplingParams))
OVERRIDES = (*SAMPLING_KEYS, "max_new_tokens", "n")


@dataclass(frozen=True)
class InputRow:
    """One valid input line."""

    line: int  # 1-based line number in the input file
    id: str | int  # the user's id, unique in the file
    prompt: str | None  # the prompt text, or None when `messages` is given
    messages: list[dict] | None  # a chat, encoded with the model's chat template
    overrides: dict = field(default_factory=dict)  # per-row settings (keys from OVERRIDES)
    text: str = ""  # the line itself (cut to 200 characters), for error reports

    @property
    def key(self) -> str:
        """The id as canonical JSON (1 and "1" are different ids)."""
        return id_key(self.id)


@dataclass(frozen=True)
class BadRow:
    """One input line that cannot be run, and why."""

    line: int  # 1-based line number
    id: str | int | None  # the id, when it could be read
    error: str  # what is wrong, and what would fix it
    text: str  # the line itself (cut to 200 characters)

    def as_dict(self) -> dict:
        return {"line": self.line, "id": self.id, "error": self.error, "text": self.text}

    def describe(self) -> str:
        return f"line {self.line}: {self.error}"


def id_key(row_id) -> str:
    return json.dumps(row_id)


def row_seed(seed: int, row_id: str | int, index: int) -> int:
    """A 63-bit seed for sample `index` of row `row_id`: a stable hash (SHA-256), not Python's.

    It depends only on (seed, id, index), so a resumed or re-sharded job draws the same sample
    for the same pair wherever and whenever it runs.
    """
    data = json.dumps([int(seed), row_id, int(index)], separators=(",", ":")).encode()
    return int.from_bytes(hashlib.sha256(data).digest()[:8], "big") >> 1


def read_rows(path: str | Path) -> tuple[list[InputRow], list[BadRow]]:
    """Every line of a JSONL file, as valid rows and bad rows (blank lines are skipped)."""
    rows: list[InputRow] = []
    bad: list[BadRow] = []
    first_line: dict[str, int] = {}  # id key -> line where it first appeared
    with open(path, encoding="utf-8") as f:
        for number, raw in enumerate(f, start=1):
            text = raw.strip()
            if not text:
                continue
            row = parse_row(number, text)
            if isinstance(row, BadRow):
                bad.append(row)
                continue
            if row.key in first_line:
                bad.append(BadRow(number, row.id, f"duplicate id {row.key} (first on line "
                                  f"{first_line[row.key]}); ids must be unique", text[:200]))
                continue
            first_line[row.key] = number
            rows.append(row)
    return rows, bad


def parse_row(number: int, text: str) -> InputRow | BadRow:
    """One line as an InputRow, or a BadRow saying what is wrong with it."""
    def bad(error: str, row_id=None) -> BadRow:
        return BadRow(number, row_id, error, text[:200])

    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        return bad(f"not JSON ({exc.msg} at column {exc.colno})")
    if not isinstance(obj, dict):
        return bad(f"a JSON {type(obj).__name__}, expected an object {{\"id\": ..., "
                   "\"prompt\": ...}")
    if "id" not in obj:
        return bad('no "id"; every row needs a unique string or integer id')
    row_id = obj["id"]
    if isinstance(row_id, bool) or not isinstance(row_id, str | int):
        return bad(f'"id" is {json.dumps(row_id)}; use a string or an integer')
    prompt, messages = obj.get("prompt"), obj.get("messages")
    if (prompt is None) == (messages is None):
        return bad('give exactly one of "prompt" (a string) and "messages" (a chat)', row_id)
    if prompt is not None and (not isinstance(prompt, str) or not prompt):
        return bad('"prompt" must be a non-empty string', row_id)
    if messages is not None and not _is_chat(messages):
        return bad('"messages" must be a non-empty list of {"role": str, "content": str}', row_id)
    overrides = {k: obj[k] for k in OVERRIDES if k in obj}
    problem = check_overrides(overrides)
    if problem:
        return bad(problem, row_id)
    return InputRow(number, row_id, prompt, messages, overrides, text[:200])


def _is_chat(messages) -> bool:
    return (isinstance(messages, list) and len(messages) > 0
            and all(isinstance(m, dict) and isinstance(m.get("role"), str)
                    and isinstance(m.get("content"), str) for m in messages))


def check_overrides(overrides: dict) -> str | None:
    """What is wrong with a row's overrides, or None."""
    for key in ("max_new_tokens", "n"):
        v = overrides.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            return f'"{key}" is {json.dumps(v)}; it must be an integer >= 1'
    sampling = {k: v for k, v in overrides.items() if k in SAMPLING_KEYS}
    if "logit_bias" in sampling and isinstance(sampling["logit_bias"], dict):
        try:
            sampling["logit_bias"] = {int(k): v for k, v in sampling["logit_bias"].items()}
        except ValueError:
            return '"logit_bias" keys must be token ids'
    try:
        SamplingParams(**sampling)
    except (ValueError, TypeError) as exc:
        return str(exc)
    return None


def row_params(base: SamplingParams, overrides: dict) -> SamplingParams:
    """The job's SamplingParams with a row's overrides applied (seed is set per sample later)."""
    sampling = {k: v for k, v in overrides.items() if k in SAMPLING_KEYS}
    if isinstance(sampling.get("logit_bias"), dict):
        sampling["logit_bias"] = {int(k): v for k, v in sampling["logit_bias"].items()}
    return replace(base, **sampling)
