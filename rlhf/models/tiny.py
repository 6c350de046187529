"""The default policy: a small Llama built in code (no download, no pretrained weights)."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from rlhf.config.schema import TinyModelConfig


def tiny_llama_config(cfg: TinyModelConfig, vocab_size: int, pad_token_id: int, bos_token_id: int,
                      eos_token_id: int) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=cfg.tie_word_embeddings,
        pad_token_id=pad_token_id,
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
    )


def build_tiny_model(cfg: TinyModelConfig, vocab_size: int, pad_token_id: int, bos_token_id: int,
                     eos_token_id: int, seed: int = 0) -> LlamaForCausalLM:
    """A randomly initialised `LlamaForCausalLM`; the same seed gives the same weights."""
    config = tiny_llama_config(cfg, vocab_size, pad_token_id, bos_token_id, eos_token_id)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model.generation_config.pad_token_id = pad_token_id
    model.generation_config.bos_token_id = bos_token_id
    model.generation_config.eos_token_id = eos_token_id
    return model.float()


def count_parameters(model: torch.nn.Module) -> int:
    """Distinct parameters (tied embeddings counted once)."""
    return sum(p.numel() for p in model.parameters())
