"""Live outputs of a recording beside the run file: ``upd.record(..., sinks=[...])``. See ``upd.sinks.base``."""
from .base import LIVE_COLUMNS, Sink, SinkStep, metrics
from .mlflow import MLflow
from .tensorboard import TensorBoard
from .wandb import WandB

__all__ = ["Sink", "SinkStep", "LIVE_COLUMNS", "metrics", "TensorBoard", "WandB", "MLflow"]
