"""Datasets: reading/validating prompt tables (ground truths in one text form:
`ground_truth`), GSM8K preprocessing, the synthetic
arithmetic task, prompt sampling/tokenization, and micro-batching/packing.

Submodules are imported directly (`from rlhf.data.io import read_prompts`) so that
importing one does not pull in the others' dependencies (torch for batching).
"""
