"""vLLM's CPU build serving SmolLM2-135M-Instruct converted from GGUF, checked against the HF engine."""

import pytest
import torch

from rlhf.config import RolloutConfig
from rlhf.data.sampling import encode_prompts
from rlhf.rollout.base import SamplingParams

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
MAX_TOKENS = 12


def _teacher_forced(model, prompt: list[int], response: list[int], temperature: float) -> torch.Tensor:
    """log_softmax(logits / T) of each response token under `model`: (R,)."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + response])).logits[0, len(prompt) - 1:-1].float()
    return torch.log_softmax(logits / temperature, -1).gather(-1, torch.tensor(response)[:, None])[:, 0]


def test_vllm_serves_the_converted_directory_with_hf_logprobs(smollm2_dir, word_problem_files):
    from rlhf.data.io import read_prompts
    from rlhf.models.load import load_causal_lm, load_tokenizer
    from rlhf.rollout.hf import HFRolloutEngine
    from rlhf.rollout.vllm import VLLMRolloutEngine

    torch.set_num_threads(1)
    tok = load_tokenizer(smollm2_dir)
    prompts = encode_prompts(read_prompts(word_problem_files["test"])["prompt"].tolist()[:2], tok, "chat")
    engine = VLLMRolloutEngine(smollm2_dir, RolloutConfig(name="vllm", max_num_batched_tokens=1024), seed=0,
                               max_model_len=512)
    try:
        greedy = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
        sampled = engine.generate(prompts, SamplingParams(n=2, temperature=1.0, max_tokens=MAX_TOKENS, seed=1))
    finally:
        engine.close()
    model = load_causal_lm(smollm2_dir).eval()
    hf = HFRolloutEngine(model, tok, batch_size=8).generate(prompts, SamplingParams(temperature=0.0,
                                                                                   max_tokens=MAX_TOKENS))
    assert greedy.response_ids == hf.response_ids
    assert all(len(r) > 0 for r in greedy.response_ids)
    worst = max((torch.tensor(a) - torch.tensor(b)).abs().max().item() for a, b in zip(greedy.logprobs, hf.logprobs))
    assert worst < 1e-3, f"greedy log-probs of vLLM and the HF engine differ by {worst}"
    worst = max((torch.tensor(lps) - _teacher_forced(model, p, ids, 1.0)).abs().max().item()
                for p, ids, lps in zip(sampled.prompt_ids, sampled.response_ids, sampled.logprobs))
    assert worst < 1e-3, f"sampled log-probs of vLLM differ from HF log_softmax by {worst}"
