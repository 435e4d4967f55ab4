"""The engine hands drafters with `hidden_layers` the target's own features, aligned by token."""

import torch

from exactspec import SamplingParams, generate
from exactspec.drafters import PromptLookup
from tests.engine.tiny import tiny_llama


class FeatureSpy(PromptLookup):
    """Prompt lookup that records every context's features (a drafter asking for hidden states)."""

    hidden_layers = (0, -1)

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def propose(self, context, num_tokens):
        self.seen.append((context.tokens.clone(), context.lengths.clone(), context.hidden.clone()))
        return super().propose(context, num_tokens)


def test_hidden_matches_a_full_forward():
    model = tiny_llama(3)
    spy = FeatureSpy()
    prompts = [[5, 6, 7, 5, 6, 7, 5, 6], [9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9]]
    generate(model, prompts, drafter=spy, params=SamplingParams(temperature=0.8, seed=1),
             max_new_tokens=12, num_draft_tokens=3)
    assert len(spy.seen) >= 3
    for tokens, lengths, hidden in spy.seen:
        for b in range(tokens.shape[0]):
            n = int(lengths[b])
            with torch.no_grad():
                out = model(tokens[b : b + 1, :n], output_hidden_states=True)
            want = torch.cat([out.hidden_states[0], out.hidden_states[-1]], -1)[0, : n - 1]
            torch.testing.assert_close(hidden[b, : n - 1], want, rtol=1e-4, atol=1e-4)
