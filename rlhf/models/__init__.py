"""Models: the char tokenizer and tiny Llama (`tokenizer`, `tiny`), safetensors-only loading,
the critic and atomic saving (`load`), GGUF checkpoints read by transformers (`gguf`), and
varlen attention over packed sequences shared by the trainer and the fast decoder (`attention`).
Import the submodule you need; this package imports nothing heavy by itself.
"""
