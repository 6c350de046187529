"""Prompt sampling (epochs, resume) and prompt tokenization (formats, truncation, filtering)."""

import json
import string

import numpy as np
import pandas as pd
import pytest

from rlhf.data.sampling import PromptSampler, expand_for_rollout, filter_overlong, tokenize_prompts

CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant: {% endif %}")


@pytest.fixture(scope="module")
def tokenizer():
    """Character-level tokenizer that prepends <bos>, with a chat template."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<bos>", "<eos>", "<unk>"]
    vocab = {t: i for i, t in enumerate(specials + list(string.printable))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), behavior="isolated")
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 1)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>",
                                   eos_token="<eos>", unk_token="<unk>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def drain(sampler, steps):
    return [sampler.next_indices() for _ in range(steps)]


def test_every_row_once_per_epoch_and_orders_differ():
    sampler = PromptSampler(n_rows=10, batch_size=4, seed=0)
    flat = np.concatenate(drain(sampler, 10))  # 40 indices = 4 epochs, batches straddle epoch ends
    epochs = flat.reshape(4, 10)
    for e in epochs:
        assert sorted(e.tolist()) == list(range(10))
    assert len({tuple(e) for e in epochs}) == 4
    assert sampler.state_dict()["epoch"] == 4 and sampler.state_dict()["cursor"] == 0
    assert np.concatenate(drain(PromptSampler(10, 4, seed=0, shuffle=False), 3)).tolist() == list(range(10)) + [0, 1]


def test_seed_determines_order():
    a = np.concatenate(drain(PromptSampler(50, 7, seed=3), 5))
    assert np.array_equal(a, np.concatenate(drain(PromptSampler(50, 7, seed=3), 5)))
    assert not np.array_equal(a, np.concatenate(drain(PromptSampler(50, 7, seed=4), 5)))


def test_resume_from_state_dict_continues_identically():
    full = PromptSampler(13, 5, seed=11)
    expected = drain(full, 9)
    first = PromptSampler(13, 5, seed=11)
    head = drain(first, 4)
    state = json.loads(json.dumps(first.state_dict()))  # survives a checkpoint file
    resumed = PromptSampler(13, 5, seed=11)
    resumed.load_state_dict(state)
    tail = drain(resumed, 5)
    assert all(np.array_equal(a, b) for a, b in zip(head + tail, expected))
    with pytest.raises(ValueError, match="n_rows=13"):
        PromptSampler(14, 5, seed=11).load_state_dict(state)


def test_batch_larger_than_dataset_wraps():
    batch = PromptSampler(3, 7, seed=0).next_indices()
    assert batch.shape == (7,) and batch.dtype == np.int64
    assert sorted(batch[:3].tolist()) == sorted(batch[3:6].tolist()) == [0, 1, 2]


def test_text_prompts_tokenize_with_bos(tokenizer):
    ids = tokenize_prompts(["1+2=", "10+20="], tokenizer, max_prompt_length=16)
    assert ids[0][0] == tokenizer.bos_token_id and len(ids[0]) == 5 and len(ids[1]) == 7
    assert tokenizer.decode(ids[1][1:]).replace(" ", "") == "10+20="


def test_truncation_modes(tokenizer):
    text = ["abcdefgh"]  # 9 tokens with <bos>
    full = tokenize_prompts(text, tokenizer, 9)[0]
    assert tokenize_prompts(text, tokenizer, 4, truncation="left")[0] == full[-4:]
    assert tokenize_prompts(text, tokenizer, 4, truncation="right")[0] == full[:4]
    with pytest.raises(ValueError) as info:
        tokenize_prompts(["ok", "abcdefgh"], tokenizer, 4)
    msg = str(info.value)
    assert "row 1" in msg and "9 tokens" in msg and "data.max_prompt_length=4" in msg and "data.truncation" in msg
    with pytest.raises(ValueError, match="truncation must be one of"):
        tokenize_prompts(text, tokenizer, 4, truncation="middle")


def test_chat_prompts_use_the_template(tokenizer):
    chat = json.dumps([{"role": "user", "content": "2+2="}])
    ids = tokenize_prompts([chat], tokenizer, 64, prompt_format="chat")[0]
    expected = tokenizer("user: 2+2=\nassistant: ", add_special_tokens=False)["input_ids"]
    assert ids == expected
    with pytest.raises(ValueError, match="row 0 is not a JSON chat list"):
        tokenize_prompts(["2+2="], tokenizer, 64, prompt_format="chat")


def test_filter_overlong_drops_and_counts(tokenizer):
    df = pd.DataFrame({"prompt": ["1+1=", "123456789+1=", "2+2="], "other": [0, 1, 2]})
    out = filter_overlong(df, tokenizer, max_prompt_length=6)
    assert out["other"].tolist() == [0, 2] and list(out.index) == [0, 1]
    assert out.attrs["n_overlong"] == 1


def test_expand_for_rollout_groups_are_contiguous():
    assert expand_for_rollout(3, 2).tolist() == [0, 0, 1, 1, 2, 2]
    assert expand_for_rollout(2, 3, start=10).tolist() == [10, 10, 10, 11, 11, 11]


def test_chat_lists_under_text_format_are_not_fed_as_raw_json():
    """verl's chat-list prompts with the default data.prompt_format=text: rendered with the
    chat template when the tokenizer has one, refused (naming the rows) when it has none."""
    import json

    from rlhf.data.sampling import encode_prompts, is_chat_list
    from rlhf.models.tokenizer import build_char_tokenizer

    chat = json.dumps([{"role": "user", "content": "12+30="}])
    assert is_chat_list(chat) and not is_chat_list("[1, 2]") and not is_chat_list("12+30=")
    tok = build_char_tokenizer()
    tok.chat_template = None
    with pytest.raises(ValueError, match=r"prompt rows \[1\] are chat lists.*no chat template"):
        encode_prompts(["1+1=", chat], tok, "text")
    tok.chat_template = "{% for m in messages %}<{{ m['content'] }}>{% endfor %}"
    mixed = encode_prompts(["1+1=", chat], tok, "text")
    assert mixed[0] == encode_prompts(["1+1="], tok, "text")[0]
    assert mixed[1] == tok("<12+30=>", add_special_tokens=False)["input_ids"] == encode_prompts([chat], tok, "chat")[0]
