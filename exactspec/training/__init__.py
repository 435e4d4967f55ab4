"""Training draft heads on this machine: data from the target's own replies, training, evaluation.

`train_draft(TrainConfig(...), out_dir)` is what `exactspec train-draft` runs.
"""

from exactspec.training.train import TrainConfig, TrainResult, train_draft

__all__ = ["TrainConfig", "TrainResult", "train_draft"]
