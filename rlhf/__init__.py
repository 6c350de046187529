"""rlhf: KL-regularized PPO for language models, as a plain library.

`import rlhf` is cheap: heavy dependencies (deepspeed, vllm, mlflow) load only inside
the functions that use them. The Flyte layer (`tasks/`, `workflows/`) calls these
functions; nothing here imports flytekit.
"""

__version__ = "0.1.0"


def __getattr__(name: str):
    # `rlhf.train(cfg)` runs the in-process driver; the module is loaded on first use.
    if name == "train":
        import importlib

        return importlib.import_module("rlhf.train")
    raise AttributeError(f"module 'rlhf' has no attribute {name!r}")
