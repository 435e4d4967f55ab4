"""Glue between exactspec and the training frameworks that call a rollout engine.

`exactspec.integrations.trl.make_rollout_func(...)`: exact speculative rollouts for TRL's
`GRPOTrainer(rollout_func=...)`. Each integration imports its framework lazily (or not at all),
so `import exactspec` never needs it installed. One module per framework: trl.py
(docs/batch_and_rl.md).
"""
