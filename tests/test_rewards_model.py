import math

import pytest
import torch
from transformers import LlamaConfig, LlamaForSequenceClassification

from rlhf.config import RewardConfig
from rlhf.models.tokenizer import build_char_tokenizer
from rlhf.rewards import RewardError, compute_scores, load_reward_model
from rlhf.rewards.model import RewardModel, render_pair

PROMPTS = ["1+1=", "12+34=", "what is 7 times 6? ", "5+6=", "100+200=", "9-3=", "a"]
RESPONSES = ["#### 2", "#### 46", "the answer is #### 42", "#### 11", "#### 300", "#### 6", "b" * 20]


def _save_classifier(path, tok, seed=0, num_labels=1, nan_head=False) -> str:
    config = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=128,
                         num_labels=num_labels, pad_token_id=tok.pad_token_id)
    torch.manual_seed(seed)
    model = LlamaForSequenceClassification(config)
    if nan_head:
        with torch.no_grad():
            model.score.weight[0, 0] = float("nan")
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


@pytest.fixture(scope="module")
def rm_dir(tmp_path_factory, tok):
    return _save_classifier(tmp_path_factory.mktemp("rm"), tok)


def _reference(path, tok, prompts, responses) -> list[float]:
    """Each pair alone, no padding: the classifier's logit at the last token."""
    model = LlamaForSequenceClassification.from_pretrained(path).eval()
    out = []
    with torch.no_grad():
        for p, r in zip(prompts, responses):
            ids = torch.tensor([tok(p + r)["input_ids"]])
            out.append(model(input_ids=ids).logits[0, 0].item())
    return out


def test_scores_match_unpadded_reference(rm_dir, tok):
    scores = RewardModel(rm_dir, batch_size=3).score(PROMPTS, RESPONSES)
    ref = _reference(rm_dir, tok, PROMPTS, RESPONSES)
    assert len(scores) == len(PROMPTS) and all(isinstance(s, float) for s in scores)
    assert max(abs(a - b) for a, b in zip(scores, ref)) < 1e-5
    assert len({round(s, 6) for s in scores}) == len(scores), "different texts should score differently"


def test_batched_equals_unbatched_and_is_deterministic(rm_dir):
    batched = RewardModel(rm_dir, batch_size=4).score(PROMPTS, RESPONSES)
    single = RewardModel(rm_dir, batch_size=1).score(PROMPTS, RESPONSES)
    assert max(abs(a - b) for a, b in zip(batched, single)) < 1e-5
    rm = RewardModel(rm_dir, batch_size=4)
    assert rm.score(PROMPTS, RESPONSES) == rm.score(PROMPTS, RESPONSES) == batched
    assert rm.score(PROMPTS[::-1], RESPONSES[::-1]) == pytest.approx(batched[::-1], abs=1e-5)


def test_non_finite_output_is_returned_with_a_warning(tmp_path, tok, caplog):
    """A NaN reward reaches the trainer, which drops the step (tests/test_faults.py)."""
    path = _save_classifier(tmp_path / "nan", tok, nan_head=True)
    with caplog.at_level("WARNING", logger="rlhf.rewards.model"):
        scores = RewardModel(path).score(PROMPTS[:2], RESPONSES[:2])
    assert all(math.isnan(s) for s in scores)
    assert "returned nan for 2 of 2 rows (first: row 0" in caplog.text


def test_bad_directories_raise(tmp_path, tok):
    with pytest.raises(FileNotFoundError, match="reward.model_path"):
        RewardModel(str(tmp_path / "missing"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no .safetensors"):
        RewardModel(str(tmp_path / "empty"))
    two = _save_classifier(tmp_path / "two", tok, num_labels=2)
    with pytest.raises(ValueError, match="num_labels=2"):
        RewardModel(two)


def test_chat_prompts_use_the_chat_template(tok):
    chat = '[{"role": "user", "content": "1+1="}]'
    assert render_pair(chat, "#### 2", tok) == "user: 1+1=\nassistant: #### 2\n"
    assert render_pair("1+1=", "#### 2", tok) == "1+1=#### 2"
    assert render_pair("[not json", "x", tok) == "[not jsonx"


def test_compute_scores_sends_model_rows_to_the_reward_model(rm_dir):
    cfg = RewardConfig(model_path=rm_dir, model_batch_size=2)
    rm = load_reward_model(cfg)
    styles = ["model", "rule", "model", "model"]
    scores = compute_scores(["openai/gsm8k", "openai/gsm8k", "my/chat", "my/chat"], RESPONSES[:4],
                            [None, "46", None, None], [None] * 4, styles, cfg, reward_model=rm, prompts=PROMPTS[:4])
    expected = rm.score([PROMPTS[0], PROMPTS[2], PROMPTS[3]], [RESPONSES[0], RESPONSES[2], RESPONSES[3]])
    assert [scores[0], scores[2], scores[3]] == expected
    assert scores[1] == 1.0
    with pytest.raises(RewardError, match="pass prompts="):
        compute_scores(["x"], ["y"], [None], [None], ["model"], cfg, reward_model=rm)
    assert load_reward_model(RewardConfig()) is None
