"""`generate` and `stream`: prompts in, lossless speculative generations out."""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, fields

from tqdm.auto import tqdm

from exactspec.drafters.base import Drafter
from exactspec.engine.arguments import (
    check_bool,
    check_drafter,
    check_int,
    check_layers,
    check_logit_bias,
    check_logprobs_mode,
    check_num_draft_tokens,
    check_stop,
    check_verify,
    encode_prompts,
    row_grammars,
    row_params,
)
from exactspec.engine.decoder import DecodeConfig, Decoder, RowOutput, VerifyFn
from exactspec.engine.results import Generation
from exactspec.errors import InvalidType, InvalidValue
from exactspec.invariant import is_batch_invariant, warn_if_uncovered
from exactspec.models.loading import Model, as_target
from exactspec.sampling import RowStreams, SamplingParams
from exactspec.sampling.grammar import Grammar

log = logging.getLogger(__name__)



@dataclass(frozen=True)
class Defaults:
    """`generate`'s keyword defaults, written once: `generate`'s signature, `stream` and
    `Engine` read them here."""

    drafter: None = None  # plain autoregressive decoding
    params: None = None  # SamplingParams(): temperature 1, a fresh seed
    max_new_tokens: int = 128  # tokens per row at most
    num_draft_tokens: int | str = 4  # K
    verify: str = "token"  # the verify method
    stop: None = None  # no stop string
    return_logprobs: bool = False
    batch_size: int = 64  # rows decoded together; larger batches are split into chunks
    logprobs_mode: str = "processed"  # the law of logprobs: the standardized p
    top_logprobs: int = 0  # no top alternatives
    grammar: None = None  # unconstrained


DEFAULTS = Defaults()
DEFAULT_BATCH_SIZE = DEFAULTS.batch_size
_PROGRESS_MIN_TOKENS = 2048  # show a progress bar when the token budget is at least this


def generate(
    target,
    prompts: str | Sequence[str] | Sequence[Sequence[int]],
    *,
    drafter: Drafter | None = DEFAULTS.drafter,
    params: SamplingParams | Sequence[SamplingParams] | None = DEFAULTS.params,
    max_new_tokens: int = DEFAULTS.max_new_tokens,
    num_draft_tokens: int | str = DEFAULTS.num_draft_tokens,
    verify: str | VerifyFn = DEFAULTS.verify,
    stop: str | Sequence[str] | None = DEFAULTS.stop,
    return_logprobs: bool = DEFAULTS.return_logprobs,
    batch_size: int = DEFAULTS.batch_size,
    logprobs_mode: str = DEFAULTS.logprobs_mode,
    top_logprobs: int = DEFAULTS.top_logprobs,
    grammar: Grammar | Sequence[Grammar | None] | None = DEFAULTS.grammar,
) -> list[Generation]:
    """Generate a continuation of every prompt, distributed exactly as the target alone would.

    target: an exactspec Model or a transformers causal LM. prompts: one string, a list of
    strings (encoded with the target's tokenizer, no chat template), or a list of token-id
    lists; identical prompts are fine (they are prefilled once). drafter: DraftModel(...),
    PromptLookup(...), any `Drafter`, or None for plain autoregressive decoding.
    params: one SamplingParams for every row (default: temperature 1), row i drawing from the
    stream seeded by (params.seed, i); or a list, one per prompt, each row standardized with
    its own and drawing from the stream of its own seed alone (the same prompt and seed give
    the same row at any index of any batch). seed None draws a fresh seed. num_draft_tokens: K, or "auto" (per row, from the
    observed acceptance and the measured draft / target costs; the output is still exactly
    distributed, but which sample a seed gives then depends on timings: use a fixed K for
    bit-reproducible text). verify: "token", "block",
    "greedy", "coupled" (the same seed gives plain decoding's text at any K, "auto" included,
    and without a drafter; exactspec.sampling.coupled) or a callable with `exactspec.verify`'s signature, called as
    fn(target_probs, draft_tokens, draft_probs, generator=streams). stop: strings that end a
    row (the text is cut before them). return_logprobs: log p of each generated token under
    the target's standardized distribution (so 0.0 for every token when greedy).
    batch_size: rows per forward pass. logprobs_mode: "processed" (default: the standardized
    law above, what RL needs) or "raw" (the model's own log_softmax of its raw logits, before
    temperature, top-k/p and penalties; real values at temperature 0). top_logprobs: N > 0
    fills Generation.top_logprobs with each position's N most likely (token, log p) under the
    same law (raw: always N entries; processed: those with p > 0). grammar: an
    `es.Grammar` (json_schema, json_object, regex, lark, choice) for every row, or a list with
    one per prompt (None: unconstrained); each row's output is then exactly the target's law
    restricted to its grammar (its mask is one more standardizing transform, for p and q), and
    ends with EOS where the grammar is complete (docs/generate.md).
    """
    job = _Job(target, prompts, drafter, params, max_new_tokens, num_draft_tokens, verify,
               stop, return_logprobs, batch_size, logprobs_mode, top_logprobs, grammar)
    for _ in job.events():
        pass
    return job.results


def stream(
    target,
    prompt: str | Sequence[int],
    **kwargs,
) -> TextStream:
    """Like `generate` for one prompt, iterated as text pieces as tokens are accepted.

    `for piece in stream(model, "Hi"): print(piece, end="")`; afterwards `.generation` holds
    the full `Generation`. Takes the same keyword arguments as `generate`.
    """
    if not isinstance(prompt, str):
        if not isinstance(prompt, Sequence):
            raise InvalidType(f"prompt must be a string or a list of token ids, got "
                              f"{type(prompt).__name__}")
        if prompt and all(isinstance(t, int) for t in prompt):
            prompt = [list(prompt)]
        elif len(prompt) != 1:
            raise InvalidValue("stream() takes one prompt (a string or a list of token ids); "
                               "use generate() for a batch")
    return TextStream(_Job(target, prompt, **_job_kwargs(kwargs)))


def _job_kwargs(kwargs: dict) -> dict:
    """`stream`'s keyword arguments over `generate`'s defaults."""
    defaults = {f.name: getattr(DEFAULTS, f.name) for f in fields(DEFAULTS)}
    unknown = sorted(set(kwargs) - set(defaults))
    if unknown:
        raise InvalidType(f"stream() got unexpected keyword arguments {unknown}")
    return {**defaults, **kwargs}


class TextStream:
    """Iterates text pieces of one generation; `.generation` is set once iteration ends."""

    def __init__(self, job: _Job) -> None:
        self._job = job
        self.generation: Generation | None = None  # the finished result
        self._started = False

    def __iter__(self) -> Iterator[str]:
        if self._started:
            raise RuntimeError("a TextStream can be iterated only once; call stream() again")
        self._started = True
        job = self._job
        tok = job.model.tokenizer
        if tok is None:
            raise InvalidValue("stream() needs a tokenizer to produce text; use generate() with "
                               "token ids instead")
        hold = max(map(len, job.cfg.stop), default=1) - 1
        tokens: list[int] = []
        sent = ""
        for _, new, out in job.events():
            tokens += new
            text = tok.decode(tokens, skip_special_tokens=True)
            if out.finish_reason is None:
                text = text.rstrip("\ufffd")
                text = text[: len(text) - hold] if hold else text
            elif out.cut is not None:
                text = text[: out.cut]
            if len(text) > len(sent) and text.startswith(sent):
                yield text[len(sent):]
                sent = text
        self.generation = job.results[0]
        final = self.generation.text or ""
        if len(final) > len(sent) and final.startswith(sent):
            yield final[len(sent):]


class _Job:
    """One validated generate() call: its rows, chunks, randomness and results."""

    def __init__(self, target, prompts, drafter, params, max_new_tokens, num_draft_tokens,
                 verify, stop, return_logprobs, batch_size, logprobs_mode, top_logprobs,
                 grammar) -> None:
        try:
            self.model: Model = as_target(target)
        except TypeError as e:
            raise InvalidType(f"target: {e}") from None
        if is_batch_invariant():  # inside es.batch_invariant(): say if it cannot promise
            warn_if_uncovered(self.model.model)
        drafter = check_drafter(drafter)
        check_layers(drafter)
        check_int("max_new_tokens", max_new_tokens, 1)
        check_int("batch_size", batch_size, 1)
        num_draft_tokens = check_num_draft_tokens(num_draft_tokens)
        stops = check_stop(stop, self.model.tokenizer)
        check_bool("return_logprobs", return_logprobs)
        logprobs_mode = check_logprobs_mode(logprobs_mode)
        self.top_logprobs = check_int("top_logprobs", top_logprobs, 0)
        self.prompts = encode_prompts(self.model, prompts)  # [N] token lists
        self.params, per_row = row_params(params, len(self.prompts))  # [N]
        self.grammars = row_grammars(grammar, len(self.prompts))  # [N] Grammar | None
        verify = check_verify(verify, self.params)
        check_logit_bias(self.params, self.model.vocab_size)
        self.drafter = drafter
        self.batch_size = batch_size
        self.cfg = DecodeConfig(
            params=self.params, max_new_tokens=max_new_tokens, num_draft_tokens=num_draft_tokens,
            verify=verify, return_logprobs=return_logprobs, logprobs_mode=logprobs_mode,
            eos_token_ids=self.model.eos_token_ids, stop=stops, tokenizer=self.model.tokenizer,
        )
        self.stream_seeds = _stream_seeds(self.params, per_row)  # [N]
        self.results: list[Generation] = []

    def events(self) -> Iterator[tuple[int, list[int], RowOutput]]:
        """(row, new tokens, the row's output so far) as the chunks decode; fills `results`."""
        n = len(self.prompts)
        budget = n * self.cfg.max_new_tokens
        bar = tqdm(total=budget, unit="tok", desc="generate", leave=False,
                   disable=True if budget < _PROGRESS_MIN_TOKENS else None)
        t0 = time.perf_counter()
        try:
            for lo in range(0, n, self.batch_size):
                dec = Decoder(self.model, self.drafter, self.cfg)
                rows = [dec.make_row(i, self.prompts[i], self.params[i], self.stream_seeds[i],
                                     top_logprobs=self.top_logprobs, grammar=self.grammars[i])
                        for i in range(lo, min(n, lo + self.batch_size))]
                dec.admit(rows)
                while dec.rows:
                    for row, new in dec.step():
                        out = row.output
                        bar.update(len(new))
                        if out.finish_reason is not None:
                            bar.update(self.cfg.max_new_tokens - len(out.tokens))
                        if new:
                            yield row.id, new, out
                self.results += [self._result(r.output) for r in rows]
        finally:
            bar.close()
        log.info("generated %d rows, %d tokens in %.2f s", n,
                 sum(len(g.token_ids) for g in self.results), time.perf_counter() - t0)

    def _result(self, out: RowOutput) -> Generation:
        tok = self.model.tokenizer
        text = None
        if tok is not None:
            text = tok.decode(out.tokens, skip_special_tokens=True)
            if out.cut is not None:
                text = text[: out.cut]
        return Generation(
            token_ids=out.tokens,
            text=text,
            logprobs=out.logprobs if self.cfg.return_logprobs else None,
            stats=out.stats,
            finish_reason=out.finish_reason or "length",
            lossless=self.drafter is None or self.cfg.verify.lossless,
            top_logprobs=out.top if self.top_logprobs else None,
        )


def _stream_seeds(params: list[SamplingParams], per_row: bool) -> list[int]:
    """Each row's 64-bit stream seed. One shared SamplingParams: row i's comes from (seed, i),
    as always. Params per row: from the row's own seed alone (as if it were row 0 of a call
    with that seed), so the same prompt and seed give the same row at any index of any batch.
    A seed None draws a fresh one (per call when shared, per row when per row)."""
    if not per_row:
        seed = params[0].seed if params[0].seed is not None else secrets.randbits(63)
        return RowStreams.from_seed(seed, len(params)).seeds.tolist()
    return [int(RowStreams.from_seed(p.seed if p.seed is not None else secrets.randbits(63), 1)
                .seeds[0]) for p in params]
