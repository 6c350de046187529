"""One rank of a tensor-parallel vLLM group (CPU build, gloo), run under torchrun:

    torchrun --nproc_per_node=2 tests/vllm_tp_worker.py MODEL_A MODEL_B OUT

The two ranks share one engine of tensor parallel size 2 (`external_launcher`). Each rank
generates its own prompts, then the same prompts as the other rank, is released and refused,
is given model B's weights from memory, and writes `<OUT>/rank<k>.json`.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

TEXTS = ["12+34=", "5+6=", "100+200+300="]
MAX_TOKENS = 10


def main(model_a: str, model_b: str, out: str) -> None:
    import torch.distributed as dist

    from rlhf.config import RolloutConfig
    from rlhf.models.load import load_causal_lm
    from rlhf.models.tokenizer import build_char_tokenizer
    from rlhf.rollout.base import SamplingParams
    from rlhf.rollout.vllm import VLLMRolloutEngine

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    tok = build_char_tokenizer()
    prompts = [tok(t)["input_ids"] for t in TEXTS]
    own = prompts[:2] if rank == 0 else prompts[2:]
    greedy = SamplingParams(n=1, temperature=0.0, max_tokens=MAX_TOKENS)
    engine = VLLMRolloutEngine(model_a, RolloutConfig(name="vllm", tensor_model_parallel_size=2,
                                                      max_num_batched_tokens=512), seed=0)
    result = {"backend": engine.group.backend, "members": engine.group.members(),
              "in_memory": engine.loads_from_memory}
    result["greedy_a"] = engine.generate(own, greedy).response_ids
    sampled = engine.generate(own, SamplingParams(n=2, temperature=1.0, max_tokens=MAX_TOKENS, seed=11 + rank))
    result["sampled"] = {"prompt_index": sampled.prompt_index, "prompt_ids": sampled.prompt_ids,
                         "response_ids": sampled.response_ids, "logprobs": sampled.logprobs}
    result["same_prompts_greedy_a"] = engine.generate(prompts, greedy).response_ids
    engine.release()
    try:
        engine.generate(own, greedy)
        result["released_refused"] = False
    except RuntimeError:
        result["released_refused"] = True
    engine.load_weights(load_causal_lm(model_b).state_dict().items())
    result["greedy_b"] = engine.generate(own, greedy).response_ids
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    engine.close()


if __name__ == "__main__":
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    main(*sys.argv[1:4])
