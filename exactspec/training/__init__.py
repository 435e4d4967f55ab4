"""Training draft heads on this machine: data from the target's own replies, training, evaluation.

`train_draft(TrainConfig(...), out_dir)` is what `exactspec train-draft` runs.

data.py         the target's own replies (prompts.txt) with its features, offline
train.py        `train_draft`: training-time test, checkpoints, resume
evaluate.py     teacher-forced held-out evaluation (heldout_prompts.txt) and the loss plot
engine_eval.py  a head measured through the engine: acceptance and speed
scaling.py      held-out alpha against data and training steps (docs/head_scaling.md)
"""

from exactspec.training.train import TrainConfig, TrainResult, train_draft

__all__ = ["TrainConfig", "TrainResult", "train_draft"]
