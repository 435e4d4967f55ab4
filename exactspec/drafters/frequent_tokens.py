"""The tokens a reduced draft head keeps (FR-Spec, VocabTrim): the ones the target itself uses.

The target generates text from a fixed set of varied prompts (SURVEY: chat, code, maths,
lists, stories, a few languages; sampled at temperature 1, seeded), and the probability mass it
puts on each token along that text is summed: the expected token counts of its own text (the
sampled counts' expectation, with less noise, and a rank for the tokens the sample missed). The
`n` tokens of most mass, the special tokens (EOS, BOS, ...) always among them, are the rows a
draft's LM head keeps (`QuantizedDraft(vocab=n)`). Ties (tokens of no mass) go to the lower id,
which byte-pair tokenizers give their more frequent merges.

The mass is cached on disk per model, tokenizer and survey (`cache_root()/frequent-tokens/`,
keyed by a digest of the weights, the tokenizer's vocabulary and template, and the survey) and
in memory per model object, so the target generates once per model; any `n` is read from it.
Which tokens are kept decides only how often drafts are accepted, never the output's law: the
draft's q is 0 outside them and the verifier's residual norm(max(p - q, 0)) runs over the whole
vocabulary (docs/quantized.md).

    frequent_tokens(model, tokenizer, 16384)   [16384] long, sorted token ids
    kept_tokens(vocab, model, tokenizer)       QuantizedDraft's `vocab=`: a count, ids, a file
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import weakref
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from tqdm.auto import tqdm

from exactspec.drafters.quantized_llama_cpp import fingerprint
from exactspec.errors import InvalidValue
from exactspec.models.adapter import TargetAdapter
from exactspec.models.lean import head_rows_of
from exactspec.models.loading import Model
from exactspec.models.registry import cache_root
from exactspec.sampling import SamplingParams, probs_from_logits

log = logging.getLogger(__name__)

FORMAT = 2  # of the cached files and how the text is drawn; part of their key

# varied requests, so the text covers what users ask for (the bench's workloads are not here:
# the kept set is not fitted to what is measured)
PROMPTS: tuple[str, ...] = (
    "Tell me about the history of the Roman Empire in a few paragraphs.",
    "Write a Python function that checks whether a string is a palindrome, with tests.",
    "What causes the seasons on Earth?",
    "Write a short poem about the sea at night.",
    "Give me a recipe for a simple vegetable soup.",
    "Explain how a hash map works to a beginner programmer.",
    "Translate into French: 'The weather is lovely today, let us go for a walk.'",
    "Write a polite email asking my manager for a day off next Friday.",
    "List ten animals that live in the Arctic and one fact about each.",
    "Solve step by step: a train travels 180 km in 2.5 hours. What is its average speed?",
    "Write a SQL query that returns the five customers with the highest total orders.",
    "Summarise the plot of Romeo and Juliet.",
    "What are the pros and cons of remote work?",
    "Write a JavaScript function that debounces another function.",
    "Explain the difference between a virus and a bacterium.",
    "Write a short story about a robot who learns to paint.",
    "How do I make a good first impression at a job interview?",
    "Describe the water cycle.",
    "¿Cuáles son los beneficios de aprender un segundo idioma?",
    "Erkläre kurz, wie ein Elektroauto funktioniert.",
    "Write a haiku about autumn leaves.",
    "What is the derivative of x^3 * sin(x)? Show your work.",
    "Give me a packing list for a week-long camping trip.",
    "Explain what an API is, with an example.",
    "Write a bash script that counts the lines of every .txt file in a folder.",
    "Compare the economies of Japan and Germany.",
    "What should I consider when buying a used car?",
    "Write a dialogue between a customer and a barista.",
    "Explain recursion and give an example in C.",
    "What are the main causes of climate change?",
    "Write a limerick about a cat who loves cheese.",
    "Return a JSON object describing a book with title, author, year and genres.",
    "How does the immune system fight an infection?",
    "Give three arguments for and against school uniforms.",
    "Write a cover letter for a junior data analyst position.",
    "Explain the rules of chess briefly.",
    "用简单的话解释什么是人工智能。",
    "What is the Pythagorean theorem and how is it used?",
    "Plan a three-day trip to Rome.",
    "Write a Rust function that reverses a linked list.",
)


@dataclass(frozen=True)
class Survey:
    """How the target's text is generated and weighed (every field but `rows` is part of the
    cache key)."""

    prompts: tuple[str | tuple[int, ...], ...] = PROMPTS  # texts (chat-templated where the
    # tokenizer has a template) or token ids (a target without a tokenizer)
    samples: int = 2  # continuations per prompt, each from its own draws
    max_new_tokens: int = 192  # tokens generated per continuation (fewer when EOS comes)
    temperature: float = 1.0  # the target's own distribution
    seed: int = 0  # of the draws
    rows: int = 40  # continuations decoded at once (not part of the result: each continuation
    # draws from its own random stream)

    def key(self) -> str:
        fields = {k: v for k, v in asdict(self).items() if k != "rows"}
        return json.dumps({"format": FORMAT, **fields}, sort_keys=True, ensure_ascii=False)


SURVEY = Survey()

# model -> {(survey key, id(tokenizer)): (tokenizer, mass [V] float64)}; the tokenizer is held
# so its id is not reused while the entry lives
_MASS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def frequent_tokens(model, tokenizer, n: int, *, survey: Survey = SURVEY,
                    progress: bool = True) -> torch.Tensor:  # [n] long, sorted
    """The `n` token ids of most mass in the target's own text (module docstring), the special
    tokens always among them. `model`: the target's transformers model; `tokenizer`: its
    tokenizer (None: the survey's prompts must be token ids)."""
    vocab = int(model.get_output_embeddings().weight.shape[0])
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise InvalidValue(f"vocab={n!r} must be a number of tokens >= 1 (or the token ids)")
    if n >= vocab:
        raise InvalidValue(f"vocab={n} keeps the whole vocabulary of {vocab} tokens; give fewer, "
                           "or drop vocab= for the full head")
    must = special_tokens(model, tokenizer, vocab)
    if len(must) > n:
        raise InvalidValue(f"vocab={n} is fewer than the model's {len(must)} special tokens, "
                           "which a reduced head always keeps; give more")
    score = token_mass(model, tokenizer, survey=survey, progress=progress).clone()  # [V]
    score[torch.tensor(must, dtype=torch.long)] = float("inf")
    order = torch.sort(score, descending=True, stable=True).indices  # ties: lower id first
    return order[:n].sort().values


def special_tokens(model, tokenizer, vocab: int) -> list[int]:
    """EOS (as the engine stops on it), BOS, padding and the tokenizer's special tokens."""
    ids = set(Model(model=model, tokenizer=tokenizer, name="target").eos_token_ids)
    for source in (model.config, model.generation_config, tokenizer):
        for attr in ("bos_token_id", "pad_token_id", "eos_token_id"):
            value = getattr(source, attr, None) if source is not None else None
            ids.update([value] if isinstance(value, int) else list(value or ()))
    ids.update(getattr(tokenizer, "all_special_ids", None) or ())
    return sorted(i for i in ids if isinstance(i, int) and 0 <= i < vocab)


def token_mass(model, tokenizer, *, survey: Survey = SURVEY,
               progress: bool = True) -> torch.Tensor:  # [V] float64
    """The probability mass the target puts on each token along the text it generates from
    `survey`'s prompts: from memory, else from the disk cache, else generated (and cached)."""
    per_model = _MASS.setdefault(model, {})
    held = per_model.get((survey.key(), id(tokenizer)))
    if held is not None:
        return held[1]
    path = cache_root() / "frequent-tokens" / f"{_digest(model, tokenizer, survey)}.safetensors"
    mass = _read(path)
    if mass is None:
        mass, generated = _survey(model, _encoded(survey, model, tokenizer), survey, progress)
        _write(path, mass, {"tokens": str(generated), "survey": survey.key()})
    per_model[(survey.key(), id(tokenizer))] = (tokenizer, mass)
    return mass


def kept_tokens(vocab, model, tokenizer) -> torch.Tensor:  # [N] long, sorted, distinct
    """QuantizedDraft's `vocab=`, resolved for the target `model`: a number of tokens
    (`frequent_tokens`), token ids (a tensor or a sequence of ints), or the path of a JSON
    file holding a list of token ids."""
    size = int(model.get_output_embeddings().weight.shape[0])
    if isinstance(vocab, int) and not isinstance(vocab, bool):
        return frequent_tokens(model, tokenizer, vocab)
    if isinstance(vocab, str | os.PathLike):
        path = Path(vocab).expanduser()
        try:
            ids = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise InvalidValue(f"vocab={str(vocab)!r}: cannot read a JSON list of token ids "
                               f"from it ({exc})") from None
        if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
            raise InvalidValue(f"vocab={str(vocab)!r} must hold a JSON list of token ids")
        vocab = ids
    try:
        return head_rows_of(vocab, size)
    except InvalidValue as exc:
        raise InvalidValue(f"vocab: {exc}") from None


def _encoded(survey: Survey, model, tokenizer) -> list[list[int]]:
    """The survey's prompts as token ids (texts chat-templated where a template exists)."""
    target = Model(model=model, tokenizer=tokenizer, name="target")
    out = []
    for p in survey.prompts:
        if isinstance(p, str):
            if tokenizer is None:
                raise InvalidValue(
                    "vocab=N picks the tokens from text the target generates from prompts, "
                    "which needs its tokenizer; pass the kept token ids instead (vocab=[ids] "
                    "or a JSON file of them)")
            ids = target.encode(p, chat=True)
        else:
            ids = [int(i) for i in p]
        if not ids:
            raise InvalidValue(f"the survey prompt {p!r} has no tokens")
        out.append(ids)
    return out


@torch.inference_mode()
def _survey(model, prompts: list[list[int]], survey: Survey,
            progress: bool) -> tuple[torch.Tensor, int]:  # [V] float64, tokens generated
    """Plain decoding of every prompt `survey.samples` times; the mass of p at every generated
    position (up to and including each row's EOS) summed per token."""
    target = Model(model=model, tokenizer=None, name="target")
    eos = torch.tensor(target.eos_token_ids, dtype=torch.long)
    params = SamplingParams(temperature=survey.temperature)
    jobs = [p for p in prompts for _ in range(survey.samples)]
    # one random stream per continuation: the text does not depend on how rows are batched
    gens = [torch.Generator().manual_seed(survey.seed * 1_000_003 + j) for j in range(len(jobs))]
    mass = torch.zeros(target.vocab_size, dtype=torch.float64)
    generated = 0
    adapter = TargetAdapter(model, strict=False)  # the target's own (lean) forward
    bar = tqdm(total=len(jobs) * survey.max_new_tokens, disable=not progress, unit="tok",
               desc="frequent tokens: the target generates")
    for start in range(0, len(jobs), survey.rows):
        chunk, streams = jobs[start: start + survey.rows], gens[start: start + survey.rows]
        r = len(chunk)
        adapter.prefill([p[:-1] for p in chunk],
                        capacity=max(map(len, chunk)) + survey.max_new_tokens)
        last = torch.tensor([p[-1] for p in chunk], dtype=torch.long)  # [R]
        live = torch.ones(r, dtype=torch.bool)  # [R] rows before their EOS
        budget = min(survey.max_new_tokens, target.max_context - max(map(len, chunk)))
        steps = 0
        while steps < budget and bool(live.any()):
            logits = adapter.extend(last[:, None].to(adapter.device))[:, -1]  # [R, V]
            adapter.commit(torch.ones(r, dtype=torch.long))
            p = probs_from_logits(logits.float().cpu(), params)  # [R, V]
            mass += (p.double() * live[:, None]).sum(0)
            generated += int(live.sum())
            last = _draw(p, streams)  # [R]
            live &= ~torch.isin(last, eos)
            steps += 1
            bar.update(r)
        bar.update(r * (survey.max_new_tokens - steps))  # the steps EOS made unneeded
    bar.close()
    log.info("frequent tokens: %d tokens generated by the target", generated)
    return mass, generated


def _draw(p: torch.Tensor, streams: list[torch.Generator]) -> torch.Tensor:  # [R, V] -> [R]
    """One token per row by inverse CDF (float64), row i's uniform from streams[i]; a token of
    probability 0 is never drawn."""
    u = torch.cat([torch.rand(1, dtype=torch.float64, generator=g) for g in streams])  # [R]
    cdf = p.double().cumsum(-1)  # [R, V]
    idx = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)[:, 0]
    return idx.clamp(max=p.shape[-1] - 1)


def _digest(model, tokenizer, survey: Survey) -> str:
    """The cache file's name: the weights' fingerprint, the tokenizer's vocabulary and chat
    template, and the survey."""
    h = hashlib.sha256(fingerprint(model).encode())
    if tokenizer is not None:
        vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
        h.update(json.dumps(vocab, ensure_ascii=False).encode())
        h.update(str(getattr(tokenizer, "chat_template", None)).encode())
    h.update(survey.key().encode())
    return h.hexdigest()[:24]


def _read(path: Path) -> torch.Tensor | None:
    """The cached mass at `path`, or None (absent or unreadable: generated again)."""
    if not path.is_file():
        return None
    try:
        with safe_open(str(path), framework="pt") as f:
            return f.get_tensor("mass").double()
    except (SafetensorError, OSError, KeyError) as exc:
        log.warning("frequent tokens: %s is unreadable (%s); generating again", path, exc)
        return None


def _write(path: Path, mass: torch.Tensor, meta: dict[str, str]) -> None:
    """Write atomically (a temporary file renamed), so a reader never sees half a file."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        save_file({"mass": mass.contiguous()}, str(tmp), metadata=meta)
        os.replace(tmp, path)
    except OSError as exc:  # a read-only cache: the mass is kept in memory only
        log.warning("frequent tokens: cannot cache %s (%s)", path, exc)
