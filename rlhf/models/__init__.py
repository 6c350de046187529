"""Models: the char tokenizer and tiny Llama (`tokenizer`, `tiny`), safetensors-only loading,
the critic and atomic saving (`load`), and GGUF checkpoints read by transformers (`gguf`).
Import the submodule you need; this package imports nothing heavy by itself.
"""
