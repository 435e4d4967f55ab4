"""exactspec as TRL's GRPO rollout engine (`make_rollout_func`), on tiny random Llamas.

End to end: a two-step `trl.GRPOTrainer` run on CPU whose rollouts come from the function. At
every rollout the returned log p equal a teacher-forced forward of the trainer's *current* model
(row by row, and as the trainer scores a padded batch) within LOGP_BOUND, while a copy taken
before the optimiser step misses by far more; one completion per prompt entry, tagged with the
step of its weights; the int8 self-draft's acceptance after the step stays within ACCEPT_DRIFT of
its value before, while a draft left on the old weights loses more than that.
Statistical (alpha = 1e-6, fixed seeds, power computed): the first N tokens of 2000 rollouts
drawn through the function follow the policy's exact law at the trainer's settings, also after
new weights and a step; the old policy's samples and a wrong temperature are rejected.
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from datasets import Dataset
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast
from trl import GRPOConfig, GRPOTrainer
from trl.trainer.utils import pad

from exactspec.audit import power, target_law
from exactspec.audit.samplers import sequence_ids
from exactspec.audit.stats import bincount, chi_square
from exactspec.audit.world import logits_table, model_world
from exactspec.drafters import DraftModel, QuantizedDraft
from exactspec.drafters.gguf_draft import llama_cpp_available, llama_cpp_why
from exactspec.engine import generate
from exactspec.errors import InvalidType, InvalidValue
from exactspec.integrations.trl import COLLAPSE, make_rollout_func
from exactspec.sampling import SamplingParams
from tests.batch.helpers import PARAMS, PROMPT, V, policy
from tests.batch.tiny_dir import CHAT_TEMPLATE
from tests.engine.tiny import char_tokenizer, contrarian, perturbed, tiny_llama

pytestmark = pytest.mark.filterwarnings("ignore:You are using 'rollout_func':UserWarning")

# The bound of "equal within float32 rounding": two float32 forwards of the same weights (the
# engine's lean forward; transformers' or TRL's fused head) reduce in different orders, so log p
# differ by a few float32 ulps of the logits: measured <= 2e-6 here (1.8e-5 on the embedded
# model's 49152-token head). 1e-4 leaves a wide margin; the copy from before one Adam step at LR
# misses by > 1e-2 (asserted; measured ~9).
LOGP_BOUND = 1e-4
LR = 0.02  # Adam's first step moves every weight by ~LR: the policy visibly changes
ACCEPT_DRIFT = 0.05  # |acceptance after - before| allowed for a draft that follows the weights
PROMPTS = ["say a", "hi", "tell me", "abc", "go on now", "x"]  # lengths differ: padded batches
GROUP = 4  # num_generations
STEPS = 2


def share_of_a(completions, **kwargs) -> list[float]:
    """Toy reward: the share of the letter "a" in the completion."""
    return [c.count("a") / max(1, len(c)) for c in completions]


def config(tmp_path, **kw) -> GRPOConfig:
    base = dict(output_dir=str(tmp_path), max_steps=STEPS, per_device_train_batch_size=16,
                num_generations=GROUP, max_completion_length=16, learning_rate=LR,
                use_cpu=True, report_to="none", logging_steps=1, save_strategy="no",
                bf16=False, seed=0, temperature=1.0, dataloader_num_workers=0,
                disable_tqdm=True)
    base.update(kw)
    return GRPOConfig(**base)


def snapshot(model):
    """A fresh tiny Llama holding `model`'s current weights (a deepcopy would keep TRL's
    patched forward, which still calls the original model)."""
    out = tiny_llama(0, eos=0)
    out.load_state_dict(model.state_dict())
    return out


def teacher_forced(model, out, temperature: float) -> list[torch.Tensor]:
    """log p of every completion token under `model` at `temperature`, one row at a time."""
    got = []
    with torch.no_grad():
        for p, c in zip(out["prompt_ids"], out["completion_ids"], strict=True):
            logits = model(torch.tensor([p + c])).logits[0, len(p) - 1:-1].float()  # [n, V]
            logp = torch.log_softmax(logits / temperature, -1)
            got.append(logp.gather(1, torch.tensor(c)[:, None])[:, 0])  # [n]
    return got


def trainer_scored(trainer, out) -> list[torch.Tensor]:
    """log p as GRPOTrainer scores them: its model's fused LM head (temperature inside)."""
    got = []
    with torch.no_grad():
        for p, c in zip(out["prompt_ids"], out["completion_ids"], strict=True):
            ids = torch.tensor([p + c])  # [1, T]
            labels = ids.clone()
            labels[:, :len(p)] = -100
            res = trainer.model(input_ids=ids, labels=labels, fused_lm_head=True)
            got.append(res.log_probs[0, -len(c):])  # [n]
    return got


def trainer_batch(trainer, out) -> list[torch.Tensor]:
    """log p as GRPOTrainer scores a whole batch: prompts left-padded, completions right-padded,
    its own (private, trl 1.16) `_get_per_token_logps_and_entropies`."""
    pad_id = trainer.processing_class.pad_token_id
    prompts = [torch.tensor(p) for p in out["prompt_ids"]]
    comps = [torch.tensor(c) for c in out["completion_ids"]]
    ids = torch.cat([pad(prompts, padding_value=pad_id, padding_side="left"),
                     pad(comps, padding_value=pad_id, padding_side="right")], 1)  # [B, T]
    mask = torch.cat([pad([torch.ones_like(p) for p in prompts], padding_value=0,
                          padding_side="left"),
                      pad([torch.ones_like(c) for c in comps], padding_value=0,
                          padding_side="right")], 1)  # [B, T]
    width = max(len(c) for c in comps)
    with torch.no_grad():
        logps, _, _ = trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, width)
    return [logps[i, :len(c)] for i, c in enumerate(comps)]


def gap(a: list[torch.Tensor], out) -> float:
    return max(float((x - torch.tensor(lp)).abs().max())
               for x, lp in zip(a, out["logprobs"], strict=True))


class Recorder:
    """Wraps a rollout function; at each call, scores its output with the trainer's current
    model, with the trainer's fused head, and with the copy taken at the previous call."""

    def __init__(self, rollout) -> None:
        self.rollout = rollout
        self.calls: list[dict] = []
        self.previous = None  # the model's weights at the previous call

    def __call__(self, prompts, trainer):
        out = self.rollout(prompts, trainer)
        model = trainer.accelerator.unwrap_model(trainer.model)
        temperature = trainer.args.temperature
        self.calls.append(dict(
            prompts=list(prompts), out=out, step=trainer.state.global_step,
            current=gap(teacher_forced(model, out, temperature), out),
            trainer=gap(trainer_scored(trainer, out), out),
            batch=gap(trainer_batch(trainer, out), out),
            stale=None if self.previous is None
            else gap(teacher_forced(self.previous, out, temperature), out),
            stale_acceptance=None if self.previous is None else _acceptance(
                generate(snapshot(model), out["prompt_ids"], drafter=DraftModel(self.previous),
                         params=SamplingParams(seed=7), max_new_tokens=16)),
        ))
        self.previous = snapshot(model)
        return out


def _acceptance(gens) -> float:
    return sum(g.stats.accepted for g in gens) / max(1, sum(g.stats.drafted for g in gens))


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """Two GRPO steps with exactspec rollouts and the int8 self-draft."""
    rollout = make_rollout_func(QuantizedDraft(8, backend="torch"), num_draft_tokens=4)
    recorder = Recorder(rollout)
    trainer = GRPOTrainer(model=tiny_llama(0, eos=0), reward_funcs=share_of_a,
                          args=config(tmp_path_factory.mktemp("grpo")),
                          train_dataset=Dataset.from_dict({"prompt": PROMPTS * 4}),
                          processing_class=char_tokenizer(), rollout_func=recorder)
    trainer.train()
    return trainer, recorder, rollout


def test_rollout_logprobs_are_the_current_policys(run):
    _, recorder, _ = run
    assert [c["step"] for c in recorder.calls] == list(range(STEPS))  # one rollout per step
    for call in recorder.calls:
        assert call["current"] < LOGP_BOUND, call
        assert call["trainer"] < LOGP_BOUND, call
        assert call["batch"] < LOGP_BOUND, call
    stale = recorder.calls[1]["stale"]  # the weights before the optimiser step
    assert stale > 100 * LOGP_BOUND, recorder.calls[1]


def test_one_completion_per_prompt_entry_tagged_with_its_weights(run):
    trainer, recorder, _ = run
    tok = trainer.processing_class
    for call in recorder.calls:
        out, prompts = call["out"], call["prompts"]
        assert len(prompts) == 16  # per_device_train_batch_size: 4 prompts x GROUP, repeated
        assert out["prompt_ids"] == [tok(p)["input_ids"] for p in prompts]
        assert len(out["completion_ids"]) == len(prompts)
        assert [len(c) for c in out["completion_ids"]] == [len(lp) for lp in out["logprobs"]]
        assert all(1 <= len(c) <= 16 for c in out["completion_ids"])
        assert out["policy_version"] == [call["step"]] * len(prompts)
        # an EOS ends a completion, and only at its end
        assert all(0 not in c[:-1] for c in out["completion_ids"])
        # the group of a prompt is not GROUP copies of one sample
        assert len({tuple(c) for c in out["completion_ids"]}) > len(prompts) // GROUP


def test_the_int8_draft_follows_the_optimiser_step(run):
    _, recorder, rollout = run
    before, after = rollout.history
    assert (before.policy_version, after.policy_version) == (0, 1)
    assert before.synced and after.synced
    assert before.drafted > 100 and after.drafted > 100
    assert abs(after.acceptance_rate - before.acceptance_rate) < ACCEPT_DRIFT, (before, after)
    # power: a draft left on the old weights, on the same prompts, loses more than the drift
    assert recorder.calls[1]["stale_acceptance"] < before.acceptance_rate - ACCEPT_DRIFT
    assert len(after.acceptance_per_position) == 4
    assert after.accepted == sum(after.accepted_per_position)


# --- the law of the rollouts (V = 8 tokens, the first N of each completion) ---

N, K = 3, 2  # tokens compared (512 outcomes), drafts per step
ROWS = 2000


def v8_tokenizer() -> PreTrainedTokenizerFast:
    """One token per letter a..h (ids 0..7); <eos> at id 8, outside the model's 8 logits, so
    no completion stops before N tokens."""
    vocab = {c: i for i, c in enumerate("abcdefgh")} | {"<eos>": V}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<eos>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")


PROMPT_TEXT = "".join("abcdefgh"[i] for i in PROMPT)


@pytest.fixture(scope="module")
def laws():
    """Exact laws [V**N] of the first N tokens: weights 0 at PARAMS, weights 1 at PARAMS,
    weights 1 at temperature 1."""
    out = []
    for seed, params in ((0, PARAMS), (1, PARAMS), (1, SamplingParams(top_k=6, top_p=0.9))):
        model = policy(seed)
        table = logits_table(lambda ids, m=model: m(ids).logits, PROMPT, V, N + K)
        out.append(target_law(model_world(table, table, V, N + K, params, PROMPT), N))
    return out


def _counts(rollout, trainer) -> torch.Tensor:
    out = rollout([PROMPT_TEXT] * ROWS, trainer)
    assert out["prompt_ids"][0] == PROMPT
    seqs = torch.tensor([c[:N] for c in out["completion_ids"]])  # [ROWS, N]
    return bincount(sequence_ids(seqs, V), V**N)


def test_rollouts_follow_the_policys_law(tmp_path, laws):
    old, new, hot = laws
    assert power(new, old, ROWS) > 1 - 1e-6  # ROWS tells the old weights from the new
    assert power(new, hot, ROWS) > 1 - 1e-6  # and temperature 1 from 0.8
    args = config(tmp_path, max_completion_length=N, temperature=PARAMS.temperature,
                  top_k=PARAMS.top_k, top_p=PARAMS.top_p, num_generations=2)
    trainer = GRPOTrainer(model=policy(0), reward_funcs=share_of_a, args=args,
                          train_dataset=Dataset.from_dict({"prompt": [PROMPT_TEXT] * 2}),
                          processing_class=v8_tokenizer())
    rollout = make_rollout_func(QuantizedDraft(8, backend="torch"), num_draft_tokens=K,
                                batch_size=ROWS)
    first = _counts(rollout, trainer)
    assert not chi_square(first, old).rejected, chi_square(first, old)
    with torch.no_grad():  # an optimiser step's worth of change: new weights, in place
        for p, q in zip(trainer.model.parameters(), policy(1).parameters(), strict=True):
            p.copy_(q)
    trainer.state.global_step += 1
    second = _counts(rollout, trainer)
    assert rollout.last.synced and rollout.last.policy_version == 1
    assert not chi_square(second, new).rejected, chi_square(second, new)
    assert chi_square(first, new).rejected  # the old policy's rollouts fail the new law
    trainer.args.temperature = 1.0  # a wrong temperature, read from the trainer's args
    wrong = _counts(rollout, trainer)
    assert chi_square(wrong, new).rejected
    assert not chi_square(wrong, hot).rejected  # ... which is the law at temperature 1


# --- settings, errors, warnings ---


def test_a_collapsed_draft_logs_one_warning_with_the_numbers(tmp_path, caplog):
    args = config(tmp_path, temperature=0.05, max_completion_length=8)
    model = tiny_llama(0, eos=0)
    trainer = GRPOTrainer(model=model, reward_funcs=share_of_a, args=args,
                          train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
                          processing_class=char_tokenizer())
    bad = make_rollout_func(DraftModel(contrarian(model)), num_draft_tokens=3)
    with caplog.at_level(logging.WARNING, logger="exactspec.integrations.trl"):
        bad(PROMPTS, trainer)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, caplog.text
    stats = bad.last
    assert stats.drafted > 0 and stats.acceptance_rate < COLLAPSE
    assert f"{stats.accepted}/{stats.drafted}" in warnings[0].getMessage()
    caplog.clear()
    good = make_rollout_func(QuantizedDraft(8, backend="torch"), num_draft_tokens=3)
    with caplog.at_level(logging.WARNING, logger="exactspec.integrations.trl"):
        good(PROMPTS, trainer)
    assert good.last.acceptance_rate > 0.5 and not caplog.records


def test_conversations_go_through_the_chat_template(tmp_path):
    tok = char_tokenizer()
    tok.chat_template = CHAT_TEMPLATE
    args = config(tmp_path, max_completion_length=4, chat_template_kwargs={})
    trainer = GRPOTrainer(model=tiny_llama(0, eos=0), reward_funcs=share_of_a, args=args,
                          train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
                          processing_class=tok)
    chats = [[{"role": "user", "content": p}] for p in ("hi", "go on")]
    out = make_rollout_func()(chats, trainer)
    want = [tok.apply_chat_template(c, add_generation_prompt=True, tokenize=True,
                                    return_dict=True)["input_ids"] for c in chats]
    assert out["prompt_ids"] == want
    assert tok.decode(out["prompt_ids"][1]) == "u- go on. a- "


def test_generation_kwargs_override_the_args_and_unknown_ones_are_refused(tmp_path):
    args = config(tmp_path, max_completion_length=4,
                  generation_kwargs={"max_new_tokens": 2, "top_k": 1})
    trainer = GRPOTrainer(model=tiny_llama(0, eos=None), reward_funcs=share_of_a, args=args,
                          train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
                          processing_class=char_tokenizer())
    rollout = make_rollout_func()
    out = rollout(["say a"] * 4, trainer)  # its greedy continuation has no EOS for 4 tokens
    assert out["completion_ids"] == [out["completion_ids"][0]] * 4  # top_k=1: the argmax
    assert [len(c) for c in out["completion_ids"]] == [2] * 4  # max_new_tokens, not 4
    assert all(lp == 0.0 for row in out["logprobs"] for lp in row)  # top_k=1: log p = 0
    trainer.args.generation_kwargs = {"num_beams": 4}
    with pytest.raises(InvalidValue, match="num_beams"):
        rollout(["hello"], trainer)
    trainer.args.generation_kwargs = None
    trainer.args.temperature = 0.0
    with pytest.raises(InvalidValue, match=r"temperature=0\.0"):
        rollout(["hello"], trainer)


@pytest.mark.parametrize(("kwargs", "error", "match"), [
    ({"temperature": 0.7}, InvalidValue, "set temperature on GRPOConfig"),
    ({"top_p": 0.9}, InvalidValue, "set top_p on GRPOConfig"),
    ({"beam_width": 2}, InvalidValue, "unknown setting"),
    ({"presence_penalty": float("nan")}, InvalidValue, "presence_penalty"),
    ({"drafter": "int8"}, InvalidType, "must be a Drafter"),
])
def test_bad_arguments_are_refused_by_name(kwargs, error, match):
    with pytest.raises(error, match=match):
        make_rollout_func(**kwargs)


def test_the_engine_copy_does_not_call_the_trainers_model(tmp_path):
    """TRL binds a patched forward to the trainer's model; the copy must drop it."""
    args = config(tmp_path, max_completion_length=2)
    trainer = GRPOTrainer(model=tiny_llama(0, eos=0), reward_funcs=share_of_a, args=args,
                          train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
                          processing_class=char_tokenizer())
    rollout = make_rollout_func()
    rollout(["hello"], trainer)
    mine = rollout.engine.model.model
    ids = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        before = mine(ids).logits.clone()
        for p in trainer.model.parameters():
            p.mul_(-1.0)
        assert torch.equal(mine(ids).logits, before)
    assert not any(p.requires_grad for p in mine.parameters()) and not mine.training
    copy.deepcopy(rollout.last)  # the stats are plain data


def test_weights_written_in_place_are_synced_without_a_step(tmp_path):
    """The copy follows the policy when a parameter's version counter moved, even if
    global_step did not; an unchanged policy is not copied again."""
    args = config(tmp_path, max_completion_length=2)
    trainer = GRPOTrainer(model=tiny_llama(0, eos=0), reward_funcs=share_of_a, args=args,
                          train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
                          processing_class=char_tokenizer())
    rollout = make_rollout_func()
    rollout(["hello"], trainer)
    rollout(["hello"], trainer)
    assert [s.synced for s in rollout.history] == [True, False]
    with torch.no_grad():
        trainer.model.model.layers[0].mlp.up_proj.weight.mul_(2.0)
    rollout(["hello"], trainer)
    assert rollout.last.synced and rollout.last.policy_version == 0
    mine = rollout.engine.model.model.state_dict()
    assert all(torch.equal(mine[k], v) for k, v in trainer.model.state_dict().items())


def test_rollouts_are_reproducible_per_step_and_fresh_per_call(tmp_path):
    args = config(tmp_path, max_completion_length=8)
    trainer = GRPOTrainer(model=tiny_llama(0, eos=0), reward_funcs=share_of_a, args=args,
                          train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
                          processing_class=char_tokenizer())
    a, b = make_rollout_func(), make_rollout_func()
    first = a(PROMPTS, trainer)["completion_ids"]
    assert b(PROMPTS, trainer)["completion_ids"] == first  # seed from (args.seed, step, call)
    assert a(PROMPTS, trainer)["completion_ids"] != first  # the next call at the step: new draws
    other = make_rollout_func(seed=123)(PROMPTS, trainer)["completion_ids"]
    assert other != first


def test_greedy_rollouts_equal_plain_greedy_decoding_bit_for_bit(tmp_path):
    """top_k=1 makes the law a point mass at the argmax: the speculative rollouts (int8
    self-draft, a perturbed draft model) must equal plain greedy decoding token for token."""
    args = config(tmp_path, max_completion_length=16, top_k=1)
    trainer = GRPOTrainer(model=tiny_llama(0, eos=0), reward_funcs=share_of_a, args=args,
                          train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
                          processing_class=char_tokenizer())
    ids = [char_tokenizer()(p)["input_ids"] for p in PROMPTS]
    plain = [g.token_ids for g in generate(tiny_llama(0, eos=0), ids,
                                           params=SamplingParams(temperature=0),
                                           max_new_tokens=16)]
    for drafter in (QuantizedDraft(8, backend="torch"), DraftModel(perturbed(tiny_llama(0), 0.3))):
        rollout = make_rollout_func(drafter, num_draft_tokens=3)
        out = rollout(PROMPTS, trainer)
        assert out["completion_ids"] == plain
        assert rollout.last.drafted > 0 and rollout.last.accepted > 0


@pytest.mark.skipif(not llama_cpp_available(), reason=llama_cpp_why())
def test_the_llama_cpp_draft_does_not_leave_a_file_per_weight_version(tmp_path, monkeypatch):
    """An RL run exports one GGUF draft per weight version; the superseded ones it wrote are
    deleted, so the cache holds the current version's file, not one per step."""
    monkeypatch.setenv("EXACTSPEC_CACHE", str(tmp_path / "cache"))
    args = config(tmp_path, max_completion_length=4)
    trainer = GRPOTrainer(model=tiny_llama(0, eos=0), reward_funcs=share_of_a, args=args,
                          train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
                          processing_class=char_tokenizer())
    rollout = make_rollout_func(QuantizedDraft(8, backend="llama.cpp"), num_draft_tokens=3)
    drafts = tmp_path / "cache" / "gguf-drafts"
    for step in range(3):
        rollout(PROMPTS, trainer)
        assert rollout.last.drafted > 0
        assert len(list(drafts.glob("*.gguf"))) == 1, sorted(drafts.iterdir())
        with torch.no_grad():  # an optimiser step
            for p in trainer.model.parameters():
                p.mul_(0.99)
        trainer.state.global_step = step + 1


def test_what_the_rollouts_cannot_serve_is_refused_by_name(tmp_path):
    args = config(tmp_path, max_completion_length=2)
    trainer = GRPOTrainer(model=tiny_llama(0, eos=0), reward_funcs=share_of_a, args=args,
                          train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
                          processing_class=char_tokenizer())
    rollout = make_rollout_func()
    with pytest.raises(InvalidType, match="prompt 1 is a list"):
        rollout(["hi", [1, 2]], trainer)
    with pytest.raises(InvalidType, match=r"trainer has no \.model"):
        rollout(["hi"], object())
    trainer.tools = [share_of_a]  # TRL would sample the turns after a tool call itself
    with pytest.raises(InvalidValue, match="tools"):
        rollout(["hi"], trainer)
    trainer.tools = None
    trainer.model.peft_config = {}  # what a PEFT-wrapped policy carries
    with pytest.raises(InvalidValue, match="PEFT"):
        rollout(["hi"], trainer)
