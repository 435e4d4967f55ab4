"""Grammar: a constraint on the text a row may generate (JSON, a JSON schema, a regex, Lark).

The grammar's mask is one more standardizing transform (sampling/standardize.py, step 3b):
tokens the grammar forbids get logit -inf, for p and q alike, before greedy, temperature and
the filters. The output is then exactly the target's law restricted to the grammar, drafted or
not. The engine keeps one matcher per row (exactspec/engine/grammar.py); this module only
describes the constraint, validated once, frozen and hashable like SamplingParams.

The grammar engine is llguidance (a Rust library, no Python dependencies, fast on CPU; vLLM,
SGLang and llama.cpp use it). xgrammar is not used: it pulls triton and a CUDA stack.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from exactspec.errors import InvalidType, InvalidValue

__all__ = ["Grammar"]


@dataclass(frozen=True)
class Grammar:
    """A constraint on a row's output. Build it with a constructor:
    `Grammar.json_object()`, `Grammar.json_schema(schema)`, `Grammar.regex(pattern)`,
    `Grammar.lark(text)` or `Grammar.choice(options)`."""

    kind: str  # "json_object" | "json_schema" | "regex" | "lark" | "choice"
    source: str  # what the caller gave (the schema as canonical JSON, the pattern, the text)
    spec: str  # the llguidance grammar built from it (LLMatcher takes it)

    @classmethod
    def json_schema(cls, schema: dict | str) -> Grammar:
        """Text that is one JSON value valid under `schema` (a dict or its JSON text); objects
        take properties the schema does not name unless it says `additionalProperties: false`
        (JSON Schema's default; OpenAI's strict schemas say it)."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise InvalidValue(f"json_schema: the schema is not valid JSON ({e}); pass a "
                                   "dict or its JSON text") from None
        if not isinstance(schema, dict):
            raise InvalidType(f"json_schema: the schema must be a JSON object (a dict), got "
                              f"{type(schema).__name__}")
        source = json.dumps(schema, separators=(",", ":"))  # key order kept: it is the output's
        llg = _llguidance()
        try:
            spec = llg.LLMatcher.grammar_from_json_schema(source)
        except ValueError as e:
            raise InvalidValue(f"json_schema: {e}") from None
        return cls._checked("json_schema", source, spec)

    @classmethod
    def json_object(cls) -> Grammar:
        """Text that is one JSON object, any keys and values (OpenAI's `json_object` mode)."""
        llg = _llguidance()
        spec = llg.LLMatcher.grammar_from_json_schema('{"type": "object"}')
        return cls._checked("json_object", "{}", spec)

    @classmethod
    def regex(cls, pattern: str) -> Grammar:
        """Text matching the whole of `pattern` (Rust regex syntax: docs.rs/regex)."""
        if not isinstance(pattern, str) or not pattern:
            raise InvalidValue(f"regex={pattern!r} must be a non-empty string")
        return cls._checked("regex", pattern, _llguidance().LLMatcher.grammar_from_regex(pattern))

    @classmethod
    def lark(cls, text: str) -> Grammar:
        """Text derived from the `start` rule of a Lark grammar (llguidance's syntax,
        github.com/guidance-ai/llguidance/blob/main/docs/syntax.md)."""
        if not isinstance(text, str) or not text.strip():
            raise InvalidValue("lark: the grammar text must be a non-empty string")
        return cls._checked("lark", text, _llguidance().LLMatcher.grammar_from_lark(text))

    @classmethod
    def choice(cls, options: list[str]) -> Grammar:
        """Text that is exactly one of `options`."""
        if (not isinstance(options, list | tuple) or not options
                or not all(isinstance(o, str) and o for o in options)):
            raise InvalidValue(f"choice={options!r} must be a non-empty list of non-empty "
                               "strings")
        lark = "start: " + " | ".join(json.dumps(o) for o in options)
        return cls._checked("choice", json.dumps(list(options)),
                            _llguidance().LLMatcher.grammar_from_lark(lark))

    @classmethod
    def _checked(cls, kind: str, source: str, spec: str) -> Grammar:
        """The grammar, once llguidance has compiled it without a tokenizer (syntax errors,
        unsupported schema keywords are refused here, before any model runs)."""
        error = _llguidance().LLMatcher.validate_grammar(spec)
        if error:
            raise InvalidValue(f"{kind} grammar {_short(source)} is refused by llguidance: "
                               f"{' '.join(error.split())}")
        return cls(kind, source, spec)

    def __repr__(self) -> str:
        return f"Grammar.{self.kind}({_short(self.source)})"


def _short(text: str, limit: int = 60) -> str:
    return repr(text if len(text) <= limit else text[: limit - 3] + "...")


def _llguidance():
    import llguidance

    return llguidance
