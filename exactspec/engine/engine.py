"""`Engine`: a long-lived generation engine for RL loops and batch jobs.

It holds a target (loaded once), a drafter and default settings, generates n samples per
prompt with the target's log-probabilities, and takes new policy weights in place with
`update_weights`: the model object and its parameters stay the same tensors, only their values
change, so nothing is reloaded, and every cache built from the weights (the lean forward's fused
copies, a quantized self-draft) sees the parameters' `_version` counters move and rebuilds
itself on the next call. Whatever the drafter, the samples stay distributed exactly as the
*current* weights sample (tested against the new law, and shown to fail against the old one).
"""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import replace

import torch

from exactspec.drafters.base import Drafter
from exactspec.engine.api import DEFAULTS, generate
from exactspec.engine.arguments import parse_verify
from exactspec.engine.results import Generation
from exactspec.errors import InvalidType, InvalidValue
from exactspec.invariant import batch_invariant, check_invariant_target
from exactspec.models.loading import Model, as_target, load
from exactspec.sampling import SamplingParams


class Engine:
    """A target, a drafter and default settings, kept across many `generate` calls.

    `Engine(target, drafter=es.QuantizedDraft(8), params=es.SamplingParams(temperature=1))`:
    target is an `es.Model`, a transformers causal LM, or a name / path for `es.load`.
    `generate(prompts, n=4)` returns, for each prompt, its n samples (the GRPO shape: the n
    copies of a prompt are prefilled once). `update_weights(state_dict)` swaps in new weights.
    `batch_invariant=True` runs every call under `es.batch_invariant()`: the logprobs are then
    the very floats `es.token_logprobs` computes in the trainer's forward (float32 Llama).
    """

    def __init__(self, target, drafter: Drafter | None = None,
                 params: SamplingParams | None = None, *,
                 max_new_tokens: int = DEFAULTS.max_new_tokens,
                 num_draft_tokens: int | str = DEFAULTS.num_draft_tokens,
                 verify=DEFAULTS.verify, stop: str | Sequence[str] | None = DEFAULTS.stop,
                 batch_size: int = DEFAULTS.batch_size, batch_invariant: bool = False) -> None:
        if isinstance(target, str | os.PathLike):
            target = load(target)
        self.model: Model = as_target(target)  # the policy; its parameters are updated in place
        if drafter is not None and not isinstance(drafter, Drafter):
            raise InvalidType(f"drafter={drafter!r} must be a Drafter (es.PromptLookup(), "
                              "es.DraftModel(model), es.QuantizedDraft(8), ...) or None")
        self.drafter = drafter  # proposes draft tokens; None = plain decoding
        self.params = _check_params(params) if params is not None else SamplingParams()
        self.max_new_tokens = max_new_tokens  # default per call
        self.num_draft_tokens = num_draft_tokens  # K, or "auto"
        # the verify method, parsed once here (a VerifyMethod, or a callable as a UserRule)
        self.verify = parse_verify(verify)
        self.stop = stop  # strings that end a row
        self.batch_size = batch_size  # rows per forward pass
        self.policy_version = 0  # number of update_weights calls so far
        # every generate call under es.batch_invariant(): logprobs es.token_logprobs reproduces
        self.batch_invariant = check_invariant_target(self.model.model, batch_invariant)

    def __repr__(self) -> str:
        return (f"Engine({self.model.name!r}, drafter={self.drafter!r}, "
                f"policy_version={self.policy_version})")

    def generate(self, prompts: str | Sequence[str] | Sequence[Sequence[int]], *, n: int = 1,
                 params: SamplingParams | None = None, max_new_tokens: int | None = None,
                 return_logprobs: bool = True, chat: bool = False) -> list[list[Generation]]:
        """n samples of every prompt: `out[i][j]` is sample j of prompt i.

        prompts: as `es.generate` takes them (text, a list of texts, or token-id lists); with
        `chat`, texts are encoded as one user turn of the chat template. params (default: the
        engine's): one seed for the whole call, sample j of prompt i drawing from the stream
        (seed, i * n + j); seed None draws a fresh one. logprobs: log p of each token under the
        target's standardized distribution, the policy's own log-probabilities.
        """
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise InvalidValue(f"n={n!r} must be an int >= 1 (samples per prompt)")
        params = _check_params(params) if params is not None else self.params
        if params.seed is None:
            params = replace(params, seed=secrets.randbits(63))
        ids = self.encode(prompts, chat=chat)  # [P] token lists
        rows = [p for p in ids for _ in range(n)]  # [P * n], the n copies of a prompt adjacent
        with self._mode():
            gens = generate(self.model, rows, drafter=self.drafter, params=params,
                            max_new_tokens=max_new_tokens or self.max_new_tokens,
                            num_draft_tokens=self.num_draft_tokens, verify=self.verify,
                            stop=self.stop, return_logprobs=return_logprobs,
                            batch_size=self.batch_size)
        return [gens[i * n:(i + 1) * n] for i in range(len(ids))]

    def generate_rows(self, prompts: Sequence[Sequence[int]], params: Sequence[SamplingParams],
                      *, max_new_tokens: int | None = None,
                      return_logprobs: bool = True) -> list[Generation]:
        """One generation per row, row i drawn with its own `params[i]` (its seed included).

        A row's output depends only on its prompt and its params, never on its position or
        on the other rows (up to float rounding of batched matrix products), which is what a
        resumable or re-sharded batch job needs. Every params[i].seed must be set. Rows are
        decoded together, identical prompts prefilled once (the n samples of a prompt).
        """
        if len(prompts) != len(params):
            raise InvalidValue(f"got {len(prompts)} prompts and {len(params)} params; pass one "
                               "SamplingParams per row")
        for i, p in enumerate(params):
            _check_params(p)
            if p.seed is None:
                raise InvalidValue(f"params[{i}].seed is None; generate_rows needs a seed per row")
        with self._mode():
            return generate(self.model, [list(p) for p in prompts], drafter=self.drafter,
                            params=list(params),
                            max_new_tokens=max_new_tokens or self.max_new_tokens,
                            num_draft_tokens=self.num_draft_tokens, verify=self.verify,
                            stop=self.stop, return_logprobs=return_logprobs,
                            batch_size=self.batch_size)

    def _mode(self):
        return batch_invariant() if self.batch_invariant else contextlib.nullcontext()

    def encode(self, prompts, *, chat: bool = False) -> list[list[int]]:
        """Prompts as token-id lists (texts through the tokenizer, chat-templated if `chat`)."""
        if isinstance(prompts, str):
            prompts = [prompts]
        if not isinstance(prompts, Sequence) or len(prompts) == 0:
            raise InvalidValue(f"prompts={prompts!r} must be a non-empty list of texts or of "
                               "token-id lists")
        out = []
        for i, p in enumerate(prompts):
            if isinstance(p, str):
                if not p:
                    raise InvalidValue(f"prompt {i} is empty")
                out.append(self.model.encode(p, chat=chat))
            else:
                out.append(list(p))
        return out

    def update_weights(self, state_dict: Mapping[str, torch.Tensor], *,
                       strict: bool = True) -> int:
        """Copy new policy weights into the target's parameters, in place; returns tensors copied.

        Names and shapes must match the target's own `state_dict()` (strict: every tensor
        present; strict=False: any subset, e.g. only the layers that were trained). Values are
        converted to the parameter's dtype and device. The parameters keep their identity, so
        the model is not reloaded; caches derived from the weights (the lean forward's copies,
        `es.QuantizedDraft`) notice the change through the parameters' version counters and
        rebuild. A drafter with weights of its own (a separate `DraftModel`) is not touched:
        it stays exact, only its acceptance may drop.
        """
        if not isinstance(state_dict, Mapping):
            raise InvalidType(f"state_dict must be a mapping name -> tensor, got "
                              f"{type(state_dict).__name__}")
        model = self.model.model
        own = model.state_dict()
        problems = []
        unknown = sorted(set(state_dict) - set(own))
        if unknown:
            problems.append(f"unknown names {unknown[:5]}" + (" ..." if len(unknown) > 5 else ""))
        missing = sorted(set(own) - set(state_dict)) if strict else []
        if missing:
            problems.append(f"missing names {missing[:5]}" + (" ..." if len(missing) > 5 else "")
                            + " (pass strict=False to update a subset)")
        for name, value in state_dict.items():
            if name not in own:
                continue
            if not isinstance(value, torch.Tensor):
                problems.append(f"{name} is a {type(value).__name__}, not a tensor")
            elif tuple(value.shape) != tuple(own[name].shape):
                problems.append(f"{name} has shape {tuple(value.shape)}, the target's is "
                                f"{tuple(own[name].shape)}")
            elif not torch.isfinite(value).all():
                problems.append(f"{name} holds NaN or inf")
        if problems:
            raise InvalidValue("update_weights: " + "; ".join(problems) + "; pass the policy's "
                               "own state_dict() (same architecture)")
        with torch.no_grad():
            for name, value in state_dict.items():
                own[name].copy_(value)  # shares storage and version counter with the parameter
        self.policy_version += 1
        return len(state_dict)


def _check_params(params) -> SamplingParams:
    if not isinstance(params, SamplingParams):
        raise InvalidType(f"params must be exactspec.SamplingParams, got {type(params).__name__}")
    return params
