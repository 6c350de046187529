"""Models: the char tokenizer and tiny Llama (`tokenizer`, `tiny`), safetensors-only loading,
the critic and atomic saving (`load`), the SFT warm-start (`sft`) and the default policy
(`default`). Import the submodule you need; this package imports nothing heavy by itself.
"""
