"""Where a run's results go: metric sinks (`sinks`: console, MLflow, W&B; `buffer`: the
MLflow run training never waits on; `status`: a failed launch's runs marked FAILED), the
files beside the metrics (`artifacts`, `plots`, `results`), console progress (`progress`),
torch.profiler traces (`profiling`), the MLflow model registry (`model_registry`), and a
sweep trial's per-round reports to its Optuna study (`study`, `trial`).

May import: `rlhf.config`, `rlhf.trainer.dist` (ranks), `rlhf.round.state` (the round
history it plots and reports). Heavy clients (mlflow, wandb, optuna, matplotlib) load
inside the functions that use them. Submodules are imported directly.
"""
