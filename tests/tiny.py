"""A very small Llama for unit tests (the default model's shape, scaled down)."""

from rlhf.config import TinyModelConfig
from rlhf.models.tiny import build_tiny_model

SMALL = TinyModelConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                        num_key_value_heads=2, max_position_embeddings=64)


def small_model(tok, seed=0, cfg=SMALL):
    return build_tiny_model(cfg, len(tok), tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, seed=seed)
