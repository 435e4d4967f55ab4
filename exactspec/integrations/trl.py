"""exactspec as the rollout engine of TRL's `GRPOTrainer` (the experimental `rollout_func`, trl 1.16).

    from exactspec.integrations.trl import make_rollout_func
    rollout = make_rollout_func(es.QuantizedDraft(8), num_draft_tokens=4)
    trainer = GRPOTrainer(model, reward_funcs, args=GRPOConfig(...), train_dataset=dataset,
                          rollout_func=rollout)

The contract, read from trl 1.16's `GRPOTrainer._generate`: at every generation the trainer calls
`rollout_func(prompts, trainer)` with this process's prompts as its sampler laid them out (each
prompt already repeated `num_generations` times: one completion per entry, in order) and reads a
dict with "prompt_ids", "completion_ids" (token-id lists; a completion ends with the EOS that ended
it) and "logprobs" (one float per completion token, the log p it was drawn with); any other key
goes, sample by sample, to the reward functions. Text prompts are tokenized as the trainer does
(`processing_class(text=prompts)`), conversations with the chat template
(`apply_chat_template(..., add_generation_prompt=True)`, the trainer's template and
`chat_template_kwargs`). The settings are read from `trainer.args` at every call, as the trainer
builds its own GenerationConfig: temperature, top_p, top_k, min_p, repetition_penalty,
max_completion_length, then `generation_kwargs` over them; the stop tokens are
`trainer.eos_token_ids`.

Weights: the function samples from its own copy of the policy, synced with
`Engine.update_weights` whenever `trainer.state.global_step` moved (TRL's rule for its vLLM
engine) or a policy parameter was written in place since the last sync (its version counter
moved), and not from the trainer's model object itself. That object is the trainer's: it is in
train mode, TRL patches its forward (a fused LM head), accelerate may wrap it or run it under
autocast, gradient checkpointing turns its KV cache off, and the engine would have to flip it to
eval mode and back around every call. `update_weights` copies values into the copy's tensors, so
the lean forward's caches and `es.QuantizedDraft` see the version counters move and rebuild: the
self-draft cannot go stale. The price: a second copy of the weights, and one copy per step.
Sharded policies (FSDP, DeepSpeed ZeRO-3) and PEFT adapters are not supported (their parameters
are not the full policy's; `update_weights` refuses mismatched names and shapes by name).

Every sample carries `policy_version`, the trainer's global_step its weights come from. After a
call, `rollout.last` is its `RolloutStats` (acceptance per draft position included) and
`rollout.history` holds every call's; a call that drafted and kept fewer than 5% of its drafts
logs one warning with the numbers.

What the trainer should set: the rollouts follow the current policy's law exactly, and their
logprobs equal the trainer's teacher-forced forward up to float32 rounding (not bit for bit: the
engine and the trainer reduce in different orders; that is issue 23's trainer-exact mode). TRL
1.16 applies its importance-sampling correction (`vllm_importance_sampling_correction`) only with
`use_vllm=True`; with a `rollout_func` alone it takes the rollouts as on-policy and uses the
returned logprobs for `off_policy_mask_threshold` only. Keep the correction on wherever the
trainer offers it until the trainer-exact mode exists. Train in float32 (`bf16=False`): the
rollouts are drawn in the policy's own dtype. The logprobs are under the sampling law (top_p,
top_k, min_p, repetition_penalty included), while the trainer scores tokens at its temperature
only: leave those filters off unless that difference is meant.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from exactspec.drafters.base import Drafter
from exactspec.engine.api import DEFAULT_BATCH_SIZE
from exactspec.engine.engine import Engine
from exactspec.engine.results import Generation, GenerationStats
from exactspec.errors import InvalidType, InvalidValue
from exactspec.models.loading import Model
from exactspec.sampling import SamplingParams
from exactspec.sampling.params import SEED_LIMIT

log = logging.getLogger(__name__)

COLLAPSE = 0.05  # a drafting call keeping fewer than this share of its drafts logs a warning
# sampling settings the trainer owns (read from trainer.args): it scores the rollouts with them
TRAINER_OWNED = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
# SamplingParams fields make_rollout_func takes on top (seed: the base of every call's seed)
EXTRA = ("presence_penalty", "frequency_penalty", "logit_bias", "seed")
# keys of trainer.args.generation_kwargs the rollouts honour
GENERATION_KWARGS = (*TRAINER_OWNED, "max_new_tokens", "do_sample")


@dataclass
class RolloutStats:
    """One rollout call: which weights it sampled, how much, how often the drafts were kept."""

    policy_version: int  # trainer.state.global_step of the weights sampled
    synced: bool  # the weights were copied from the trainer at this call
    samples: int  # completions returned (one per prompt entry)
    tokens: int  # completion tokens returned
    steps: int  # target forwards, summed over the samples
    drafted: int  # draft tokens proposed
    accepted: int  # draft tokens kept
    drafted_per_position: list[int] = field(default_factory=list)  # [i]: steps with a draft i
    accepted_per_position: list[int] = field(default_factory=list)  # [i]: ... with draft i kept
    seconds: float = 0.0  # wall time of the call, the weight sync included

    @property
    def acceptance_rate(self) -> float:
        """accepted / drafted (0.0 when nothing was drafted)."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def acceptance_per_position(self) -> list[float]:
        """[i]: share of the steps drafting a token at position i that kept it."""
        return [a / d if d else 0.0
                for a, d in zip(self.accepted_per_position, self.drafted_per_position, strict=True)]

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens per target forward, the recovered / bonus token included."""
        return self.tokens / self.steps if self.steps else 0.0

    def summary(self) -> str:
        """One line for logs."""
        per = ", ".join(f"{a:.2f}" for a in self.acceptance_per_position)
        return (f"step {self.policy_version}: {self.samples} samples, {self.tokens} tokens in "
                f"{self.seconds:.1f} s, {self.mean_acceptance_length:.2f} tokens/step, acceptance "
                f"{self.accepted}/{self.drafted} = {self.acceptance_rate:.1%} (per position {per})")


def make_rollout_func(drafter: Drafter | None = None, num_draft_tokens: int | str = 4, *,
                      verify: str = "token", batch_size: int = DEFAULT_BATCH_SIZE,
                      **sampling) -> TRLRollout:
    """A `rollout_func` for `trl.GRPOTrainer`: exact speculative rollouts of the current policy.

    drafter: es.QuantizedDraft(8) (rebuilt from the policy at every weight version), any other
    `Drafter`, or None for plain decoding. num_draft_tokens, verify, batch_size: as for
    `es.Engine`. sampling: presence_penalty, frequency_penalty, logit_bias, and seed (the base
    of each call's seed; default trainer.args.seed). Temperature, top_p, top_k, min_p and
    repetition_penalty are the trainer's: set them on GRPOConfig.
    """
    return TRLRollout(drafter, num_draft_tokens, verify=verify, batch_size=batch_size,
                      sampling=sampling)


class TRLRollout:
    """The callable `make_rollout_func` returns; see the module docstring for the contract."""

    def __init__(self, drafter: Drafter | None = None, num_draft_tokens: int | str = 4, *,
                 verify: str = "token", batch_size: int = DEFAULT_BATCH_SIZE,
                 sampling: Mapping | None = None) -> None:
        sampling = dict(sampling or {})
        owned = [k for k in TRAINER_OWNED if k in sampling]
        if owned:
            raise InvalidValue(
                f"{owned[0]}={sampling[owned[0]]!r}: the trainer owns {list(TRAINER_OWNED)} (it "
                f"scores the rollouts with them); set {owned[0]} on GRPOConfig instead")
        unknown = sorted(set(sampling) - set(EXTRA))
        if unknown:
            raise InvalidValue(f"make_rollout_func got unknown setting(s) {unknown}; it takes "
                               f"{list(EXTRA)} (the rest is read from trainer.args)")
        SamplingParams(**sampling)  # a bad value is refused now, not at the first step
        if drafter is not None and not isinstance(drafter, Drafter):
            raise InvalidType(f"drafter={drafter!r} must be a Drafter (es.QuantizedDraft(8), "
                              "es.DraftModel(model), ...) or None")
        self.drafter = drafter  # proposes the drafts; None = plain decoding
        self.num_draft_tokens = num_draft_tokens  # K, or "auto"
        self.verify = verify  # the engine's verify method
        self.batch_size = batch_size  # rows per forward pass
        self.sampling = sampling  # the extra SamplingParams fields
        self.engine: Engine | None = None  # built at the first call on a copy of the policy
        self.synced_step: int | None = None  # trainer.state.global_step at the last sync
        self.last: RolloutStats | None = None  # the latest call's statistics
        self.history: list[RolloutStats] = []  # every call's, in order
        self._versions: int | None = None  # sum of the policy's parameter versions at the sync
        self._source: int | None = None  # id() of the trainer's model the copy follows
        self._seed_key: tuple[int, int] = (-1, 0)  # (global_step, calls at that step)

    def __repr__(self) -> str:
        return (f"TRLRollout(drafter={self.drafter!r}, num_draft_tokens={self.num_draft_tokens!r},"
                f" synced_step={self.synced_step})")

    def __call__(self, prompts: Sequence, trainer) -> dict[str, list]:
        """One completion per prompt entry, drawn from the trainer's current policy."""
        t0 = time.perf_counter()
        if isinstance(prompts, str) or not isinstance(prompts, Sequence) or not prompts:
            raise InvalidValue(f"prompts must be a non-empty list of texts or conversations, got "
                               f"{type(prompts).__name__}")
        policy = _policy(trainer)
        synced = self._sync(policy, trainer)
        assert self.engine is not None
        params, max_new_tokens = _settings(trainer, self.sampling, self._seed(trainer))
        ids = _encode(prompts, trainer)  # [P] token lists
        groups = self.engine.generate(ids, n=1, params=params, max_new_tokens=max_new_tokens,
                                      return_logprobs=True)
        gens = [group[0] for group in groups]  # [P]
        step = int(self.synced_step or 0)
        self.last = _stats(gens, step, synced, time.perf_counter() - t0)
        self.history.append(self.last)
        if self.last.drafted and self.last.acceptance_rate < COLLAPSE:
            log.warning("exactspec rollout: draft acceptance collapsed below %.0f%% at %s; the "
                        "samples stay exact, only slower (a stale or mismatched drafter?)",
                        100 * COLLAPSE, self.last.summary())
        else:
            log.info("exactspec rollout %s", self.last.summary())
        return {
            "prompt_ids": ids,
            "completion_ids": [list(g.token_ids) for g in gens],
            "logprobs": [list(g.logprobs or []) for g in gens],
            "policy_version": [step] * len(gens),
        }

    def _sync(self, policy, trainer) -> bool:
        """Bring the engine's copy to the policy's weights; True when they were copied."""
        step = int(trainer.state.global_step)
        versions = sum(p._version for p in policy.parameters())
        if self.engine is None or self._source != id(policy):
            self.engine = Engine(_engine_model(policy, trainer), self.drafter,
                                 num_draft_tokens=self.num_draft_tokens, verify=self.verify,
                                 batch_size=self.batch_size)
        elif step == self.synced_step and versions == self._versions:
            return False
        else:
            self.engine.update_weights(policy.state_dict())
        self.synced_step, self._versions, self._source = step, versions, id(policy)
        return True

    def _seed(self, trainer) -> int:
        """This call's seed, from (base seed, process, global_step, calls at that step): a rerun
        of the same training draws the same rollouts, processes draw different ones."""
        step = int(trainer.state.global_step)
        calls = self._seed_key[1] + 1 if self._seed_key[0] == step else 0
        self._seed_key = (step, calls)
        base = self.sampling.get("seed", getattr(trainer.args, "seed", 0))
        process = getattr(getattr(trainer, "accelerator", None), "process_index", 0)
        digest = hashlib.sha256(f"{base}:{process}:{step}:{calls}".encode()).digest()
        return int.from_bytes(digest[:8], "little") % SEED_LIMIT


def _policy(trainer):
    """The trainer's policy as a plain transformers model (accelerate's wrapper removed)."""
    from transformers import PreTrainedModel

    for name in ("model", "args", "state", "processing_class"):
        if not hasattr(trainer, name):
            raise InvalidType(f"rollout_func(prompts, trainer): trainer has no .{name}; pass it "
                              "to trl.GRPOTrainer(rollout_func=...), which calls it")
    model = trainer.model
    accelerator = getattr(trainer, "accelerator", None)
    if accelerator is not None:
        model = accelerator.unwrap_model(model)
    if hasattr(model, "peft_config"):
        raise InvalidValue("the policy is a PEFT model: exactspec rollouts need the full weights "
                           "(merge the adapters, or train without peft_config)")
    if not isinstance(model, PreTrainedModel):
        raise InvalidType(f"the trainer's model is a {type(model).__name__}, not a transformers "
                          "PreTrainedModel")
    if getattr(trainer, "tools", None) or getattr(trainer, "environment_factories", None):
        raise InvalidValue("tools / environments: TRL would sample the turns after a tool call "
                           "with its own generate, not exactspec; train without them")
    return model


def _engine_model(policy, trainer) -> Model:
    """The engine's copy of the policy: eval mode, no gradients, the trainer's stop tokens."""
    model = copy.deepcopy(policy)
    model.__dict__.pop("forward", None)  # TRL's fused-LM-head patch, bound to the trainer's model
    for p in model.parameters():
        p.requires_grad_(False)
        p.grad = None
    model.eval()
    eos = getattr(trainer, "eos_token_ids", None)
    if eos:  # the trainer's: the tokenizer's EOS and every EOS the model declares
        model.generation_config.eos_token_id = [int(i) for i in eos]
    name = getattr(policy.config, "name_or_path", "") or type(policy).__name__
    return Model(model=model, tokenizer=trainer.processing_class, name=f"{name} (rollouts)")


def _settings(trainer, sampling: Mapping, seed: int) -> tuple[SamplingParams, int]:
    """The trainer's sampling settings (args, then generation_kwargs) and completion budget."""
    args = trainer.args
    values = {"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k,
              "min_p": args.min_p, "repetition_penalty": args.repetition_penalty,
              "max_new_tokens": args.max_completion_length}
    extra = getattr(args, "generation_kwargs", None) or {}
    if isinstance(extra, str):
        extra = json.loads(extra)
    unknown = sorted(set(extra) - set(GENERATION_KWARGS))
    if unknown:
        raise InvalidValue(f"generation_kwargs {unknown} cannot be honoured by exactspec rollouts "
                           f"(it honours {list(GENERATION_KWARGS)}); drop them")
    if extra.get("do_sample", True) is not True:
        raise InvalidValue("generation_kwargs do_sample=False: GRPO needs sampled rollouts")
    values.update({k: v for k, v in extra.items() if k != "do_sample"})
    off = {"top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0}  # None = off
    values.update({k: v for k, v in off.items() if values[k] is None})
    temperature = values["temperature"]
    if temperature is None or temperature <= 0:
        raise InvalidValue(f"temperature={temperature!r}: GRPO samples, and the trainer divides "
                           "its logits by the temperature; set a temperature > 0")
    max_new_tokens = values.pop("max_new_tokens")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) \
            or max_new_tokens < 1:
        raise InvalidValue(f"max_completion_length={max_new_tokens!r} must be an int >= 1")
    rest = {k: v for k, v in sampling.items() if k != "seed"}
    return SamplingParams(**values, **rest, seed=seed), max_new_tokens


def _conversational(prompt) -> bool:
    return (isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], Mapping)
            and "role" in prompt[0] and "content" in prompt[0])


def _encode(prompts: Sequence, trainer) -> list[list[int]]:
    """Token ids of every prompt, as the trainer's own generation path tokenizes them."""
    tok = trainer.processing_class
    if _conversational(prompts[0]):
        for i, p in enumerate(prompts):
            if not _conversational(p):
                raise InvalidValue(f"prompt {i} is not a conversation while prompt 0 is; a batch "
                                   "holds one kind")
            if any(not isinstance(m["content"], str) for m in p):
                raise InvalidValue(f"prompt {i} has a non-text message content; exactspec "
                                   "rollouts take text only")
        out = tok.apply_chat_template(
            conversation=[list(p) for p in prompts], chat_template=getattr(trainer,
                                                                           "chat_template", None),
            add_generation_prompt=True, tokenize=True, return_dict=True,
            **(getattr(trainer, "chat_template_kwargs", None) or {}))
        ids = out["input_ids"]
    else:
        bad = next((i for i, p in enumerate(prompts) if not isinstance(p, str)), None)
        if bad is not None:
            raise InvalidType(f"prompt {bad} is a {type(prompts[bad]).__name__}; a prompt is a "
                              "text or a list of {'role', 'content'} messages")
        ids = tok(text=list(prompts))["input_ids"]
    return [[int(t) for t in row] for row in ids]


def _stats(gens: list[Generation], step: int, synced: bool, seconds: float) -> RolloutStats:
    """The call's totals over its samples."""
    total = GenerationStats.total(g.stats for g in gens)
    width = len(total.drafted_per_position)  # a draft kept at i was drafted at i
    accepted = total.accepted_per_position + [0] * (width - len(total.accepted_per_position))
    return RolloutStats(policy_version=step, synced=synced, samples=len(gens),
                        tokens=sum(len(g.token_ids) for g in gens),
                        steps=total.steps, drafted=total.drafted, accepted=total.accepted,
                        drafted_per_position=total.drafted_per_position,
                        accepted_per_position=accepted, seconds=seconds)
