"""Data and starting-policy tasks: fingerprint, prepare_dataset (cached), prepare_policy
(cached), sample_prompts."""

from __future__ import annotations

from typing import NamedTuple

from flytekit import Cache, task
from flytekit.types.directory import FlyteDirectory

from containers.images import CPU_IMAGE
from rlhf.data.checks import check_fit
from rlhf.models.load import load_tokenizer
from rlhf.train import stateless as P
from rlhf.round import stages
from rlhf.config.schema import DataConfig, ModelConfig, PPOConfig
from rlhf.config.sizes import resolve_epochs
from rlhf.round.state import RoundState
from tasks.base import CACHE_VERSION, CPU_MEDIUM, CPU_SMALL, Prompts, retry_transient, workdir

Splits = NamedTuple("Splits", [("train", Prompts), ("val", Prompts), ("sft", Prompts)])
Sampled = NamedTuple("Sampled", [("prompts", Prompts), ("state", RoundState)])


@task(requests=CPU_SMALL, container_image=CPU_IMAGE, retries=2)
def dataset_fingerprint(data: DataConfig) -> str:
    """A digest of the dataset files (sizes, times, ETags): the cache key of `prepare_dataset`."""
    with retry_transient():
        return P.dataset_fingerprint(data)


@task(cache=Cache(version=CACHE_VERSION), requests=CPU_MEDIUM, container_image=CPU_IMAGE, retries=2)
def prepare_dataset(data: DataConfig, fingerprint: str) -> Splits:
    """Train/val prompt tables (verl parquet, local or fsspec URI, or the synthetic task) and
    the labeled SFT split (empty for user data). Cached on the data config and fingerprint."""
    del fingerprint  # part of the cache key only
    with retry_transient():
        b = P.prepare_dataset(data)
    return Splits(train=b.train, val=b.val, sft=b.sft)


@task(cache=Cache(version=CACHE_VERSION), requests=CPU_MEDIUM, container_image=CPU_IMAGE, retries=2)
def prepare_policy(model: ModelConfig, seed: int, sft: Prompts) -> FlyteDirectory:
    """The starting and reference policy: `model.path` (a remote directory URI is passed by
    reference; a GGUF file, local or remote, is converted to safetensors), or the tiny default
    model built and SFT-warm-started on `sft`. Cached."""
    if "://" in model.path and not model.path.startswith("file://"):
        if not model.path.lower().endswith(".gguf"):
            return FlyteDirectory(path=model.path)
        from dataclasses import replace

        from flytekit.types.file import FlyteFile

        with retry_transient():
            model = replace(model, path=FlyteFile(path=model.path).download())
    return FlyteDirectory(path=P.prepare_base_model(model, seed, sft, workdir("policy")))


Fitted = NamedTuple("Fitted", [("train", Prompts), ("val", Prompts)])


@task(requests=CPU_SMALL, container_image=CPU_IMAGE, retries=2)
def fit_prompts(cfg: PPOConfig, train: Prompts, val: Prompts, policy: FlyteDirectory) -> Fitted:
    """The train and val prompts that fit in `data.max_prompt_length` tokens of the policy's
    tokenizer when `data.filter_overlong_prompts` (the rest dropped and counted in the log)."""
    if cfg.data.filter_overlong_prompts:
        tokenizer = load_tokenizer(policy.download(), trust_remote_code=cfg.model.trust_remote_code)
        train, val = stages.fit_prompts(train, tokenizer, cfg, "train"), stages.fit_prompts(val, tokenizer, cfg, "val")
    check_fit(cfg, len(train), policy.download())
    return Fitted(train=train, val=val)


@task(requests=CPU_SMALL, container_image=CPU_IMAGE)
def rounds_from_epochs(cfg: PPOConfig, train: Prompts) -> PPOConfig:
    """`cfg` with `trainer.total_epochs` (passes over the train set, verl's key) turned into
    `trainer.total_rounds` for this train set; `cfg` itself when it is not set."""
    return resolve_epochs(cfg, len(train))


@task(requests=CPU_SMALL, container_image=CPU_IMAGE)
def sample_prompts(cfg: PPOConfig, train: Prompts, state: RoundState) -> Sampled:
    """The round's `steps_per_round * train_batch_size` prompts; the sampler cursor moves in the state."""
    prompts, new = stages.sample_prompts(train, state, cfg)
    return Sampled(prompts=prompts, state=new)
