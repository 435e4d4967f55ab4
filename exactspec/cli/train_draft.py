"""`exactspec train-draft`: train an EAGLE-style draft head for a target, on this CPU."""

from __future__ import annotations

import argparse

from exactspec.cli.common import UsageError, at_least


def add(sub) -> None:
    p = sub.add_parser(
        "train-draft", help="train an EAGLE-style draft head for a target, on this CPU",
        description="Builds training data offline (the target's own replies to the shipped "
        "chat prompts, with its hidden states and soft labels), trains a one-layer draft head "
        "over the target's features with a progress bar and checkpoints, then writes "
        "OUT/head (load it with exactspec.load_drafter(OUT/head)), OUT/loss.png and "
        "OUT/eval.json (alpha and mean acceptance length on held-out prompts, T=1 and greedy, "
        "K=4). About an hour on 2 CPU cores with the defaults (half of it building data). "
        "Example: exactspec train-draft --model smollm2-135m --out runs/head --minutes 30")
    p.add_argument("--model", default="smollm2-135m",
                   help="target: embedded name, transformers directory or .gguf file")
    p.add_argument("--out", required=True, help="output directory (data, checkpoint, head)")
    p.add_argument("--minutes", type=float, default=30.0,
                   help="training-loop budget in minutes, data building excluded (default 30)")
    p.add_argument("--resume", action="store_true",
                   help="continue the checkpoint in --out (same --model and --replies; "
                   "--minutes and --max-steps may grow)")
    p.add_argument("--replies", type=at_least(1), default=2,
                   help="target replies per training prompt: 1 alternates greedy and T=1 "
                   "between prompts (half the data time), 2+ adds a greedy reply to T=1 ones "
                   "(default 2)")
    p.add_argument("--max-steps", type=at_least(0), default=0,
                   help="also stop after N steps (0 = off)")
    p.add_argument("--threads", type=at_least(1), default=2, help="torch CPU threads (default 2)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if args.minutes < 0 or (args.minutes == 0 and args.max_steps <= 0):
        raise UsageError("give --minutes > 0 or --max-steps > 0")
    import torch

    from exactspec.training.train import TrainConfig, train_draft

    torch.set_num_threads(args.threads)
    cfg = TrainConfig(model=args.model, minutes=args.minutes, max_steps=args.max_steps,
                      replies=args.replies)
    res = train_draft(cfg, args.out, resume=args.resume)
    print(f"head: {res.head_dir} ({res.steps} steps, {res.train_seconds / 60:.1f} min training, "
          f"{res.data_seconds / 60:.1f} min data)")
    print(f"loss curve: {res.loss_png}")
    for mode in ("t1", "greedy"):
        e = res.eval[mode]
        print(f"{mode:>6}: alpha by depth {e['alpha_by_depth']}, P(first k accepted) "
              f"{e['accept_first_k']}, mean acceptance length {e['mean_acceptance_length']}")
    return 0
