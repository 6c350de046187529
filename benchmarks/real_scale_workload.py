"""The workload of benchmarks/real_scale.py: the config of the 1.5B round measured on one H200
(and a tiny one for the CPU), a random policy saved as a model directory, word-token prompt
tables, and the word-level tokenizer the drivers are handed."""

from __future__ import annotations

from pathlib import Path

import torch

import gpu_common as G

WORKLOAD = {  # the 1.5B round measured on one H200
    "data.train_batch_size": 64, "rollout.n": 4, "data.max_prompt_length": 512, "data.max_response_length": 256,
    "actor.ppo_mini_batch_size": 64, "actor.ppo_micro_batch_size_per_gpu": 4, "actor.ppo_epochs": 2,
    "critic.ppo_epochs": 2,
    "critic.ppo_micro_batch_size_per_gpu": 4, "actor.use_dynamic_bsz": True, "actor.ppo_max_token_len_per_gpu": 16384,
    "data.use_sequence_packing": True, "rollout.name": "hf_fast", "rollout.generate_batch_size": 256,
    "algorithm.adv_estimator": "gae", "model.dtype": "bfloat16", "deepspeed.bf16": True, "deepspeed.zero_stage": 0,
    "trainer.test_freq": 1, "trainer.val_before_train": False, "trainer.save_freq": 5,
    "trainer.max_ckpt_to_keep": 1, "early_stop.enable": False, "trainer.logger": "[none]", "trainer.device": "cuda",
    "trainer.num_threads": 0, "trainer.resume": "disable", "actor.lr": 1e-6, "critic.lr": 1e-5,
}
TINY = {**WORKLOAD, "data.train_batch_size": 4, "rollout.n": 2, "data.max_prompt_length": 24,
        "data.max_response_length": 8, "actor.ppo_mini_batch_size": 4, "actor.ppo_micro_batch_size_per_gpu": 2,
        "critic.ppo_micro_batch_size_per_gpu": 2, "actor.ppo_max_token_len_per_gpu": 256,
        "rollout.generate_batch_size": 16, "model.dtype": "float32", "deepspeed.bf16": False,
        "trainer.device": "cpu", "trainer.num_threads": 1, "trainer.save_freq": 2}
N_VAL = {"1.5b": 64, "7b": 64, "tiny": 4}


def make_workload(root: Path, shape: str, device: torch.device, n_train: int, n_val: int, max_prompt: int):
    """A random `shape` policy saved as a model directory, and train/val prompt parquets of
    word tokens ("t123 t9 ...") with GSM8K-like lengths up to `max_prompt`."""
    import pandas as pd

    model_dir = root / "model"
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = G.build_policy(shape, device, dtype)
    model.save_pretrained(str(model_dir))
    vocab = G.SHAPES[shape]["vocab_size"]
    G.synthetic_tokenizer(vocab).save_pretrained(str(model_dir))
    del model
    g = torch.Generator().manual_seed(0)
    paths = {}
    for split, n in (("train", n_train), ("val", n_val)):
        lens, _ = G.sample_lengths(n, 1, max_prompt, 8, seed=len(split), min_prompt=4, min_response=1)
        prompts = [" ".join(f"t{int(i)}" for i in torch.randint(3, vocab, (k,), generator=g)) for k in lens]
        table = pd.DataFrame({"prompt": prompts, "data_source": "synthetic/arithmetic", "ability": "math",
                              "reward_style": "rule", "ground_truth": "7", "extra_info": "{}"})
        paths[split] = root / f"{split}.parquet"
        table.to_parquet(paths[split])
    return str(model_dir), str(paths["train"]), str(paths["val"])


def use_word_tokenizer(vocab: int) -> None:
    """Every `load_tokenizer` call of the drivers gets the benchmark's word-level tokenizer."""
    import rlhf.models.load as L

    tok = G.synthetic_tokenizer(vocab)
    L.load_tokenizer = lambda path, trust_remote_code=False, allow_network=False: tok


def config(base: dict, model_dir: str, train: str, val: str, out: Path, rounds: int):
    from rlhf.config import load_config

    d = {**base, "model.path": model_dir, "data.train_files": train, "data.val_files": val,
         "trainer.output_dir": str(out), "trainer.total_rounds": rounds}
    return load_config(None, [f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in d.items()])
