"""Two torchrun ranks sharing one vLLM engine of tensor parallel size 2 (vLLM's CPU build,
gloo, `external_launcher`), checked against transformers: each rank gets its own prompts'
responses and vLLM's log-probs, the shared engine refuses to generate once released, and
weights pushed from memory are the ones served."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rlhf.config import TinyModelConfig
from rlhf.models.tiny import build_tiny_model
from rlhf.models.tokenizer import build_char_tokenizer

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from vllm_tp_worker import MAX_TOKENS, TEXTS  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
# head_dim 32 (vLLM CPU's smallest); both attention heads and both KV heads split over the 2 ranks
TINY = TinyModelConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                       intermediate_size=128, max_position_embeddings=64)


def _greedy(model, prompt: list[int], eos: int) -> list[int]:
    out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                         do_sample=False, max_new_tokens=MAX_TOKENS, eos_token_id=eos, pad_token_id=eos)
    return out[0, len(prompt):].tolist()


def _logprobs(model, prompt: list[int], response: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + response])).logits[0, len(prompt) - 1:-1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(response)[:, None])[:, 0]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_ranks_share_one_tensor_parallel_engine(tmp_path):
    pytest.importorskip("vllm")
    tok = build_char_tokenizer()
    models = {}
    for name, seed in (("a", 0), ("b", 1)):
        models[name] = build_tiny_model(TINY, len(tok), tok.pad_token_id, tok.bos_token_id, tok.eos_token_id,
                                        seed=seed).eval()
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():  # a fresh tiny model repeats one token; noise gives each its own greedy text
            for p in models[name].parameters():
                p.add_(0.2 * torch.randn(p.shape, generator=g))
        models[name].save_pretrained(tmp_path / name)
        tok.save_pretrained(tmp_path / name)
    drop = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE"}
    env = {**{k: v for k, v in os.environ.items() if k not in drop}, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                           f"--rdzv-endpoint=127.0.0.1:{_port()}", str(ROOT / "tests" / "vllm_tp_worker.py"),
                           str(tmp_path / "a"), str(tmp_path / "b"), str(tmp_path)],
                          env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]

    prompts = [tok(t)["input_ids"] for t in TEXTS]
    eos = tok.eos_token_id
    hf = {name: [_greedy(m, p, eos) for p in prompts] for name, m in models.items()}
    assert hf["a"] != hf["b"], "models A and B decode alike; the weight push would go unseen"
    for rank, (res, own) in enumerate(zip(ranks, (slice(0, 2), slice(2, 3)))):
        assert res["backend"] == "external_launcher" and res["members"] == [0, 1] and res["in_memory"]
        assert res["greedy_a"] == hf["a"][own], f"rank {rank}: its own prompts' responses"
        assert res["same_prompts_greedy_a"] == hf["a"]
        sampled = res["sampled"]
        n_own = len(prompts[own])
        assert sampled["prompt_index"] == [i for i in range(n_own) for _ in range(2)]
        assert sampled["prompt_ids"] == [prompts[own][i] for i in sampled["prompt_index"]]
        for p, r, lp in zip(sampled["prompt_ids"], sampled["response_ids"], sampled["logprobs"]):
            ref = _logprobs(models["a"], p, r)
            assert (torch.tensor(lp) - ref).abs().max().item() < 1e-4, "vLLM's log-probs under TP 2"
        assert res["released_refused"]
        assert res["greedy_b"] == hf["b"][own], f"rank {rank}: weights pushed from memory"
