"""Tokenizer, tiny model, loaders, critic, atomic save, frozen reference."""

import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlhf.config import TinyModelConfig
from rlhf.models.load import (ModelLoadError, ValueModel, frozen_reference, load_causal_lm, load_tokenizer,
                              load_weights_into, save_model_atomic)
from rlhf.models.tiny import count_parameters
from rlhf.models.tokenizer import build_char_tokenizer

from tests.tiny import small_model
PRINTABLE = "".join(chr(c) for c in range(32, 127)) + "\n"


pytestmark = pytest.mark.usefixtures("one_thread")


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet=PRINTABLE, max_size=60) | st.sampled_from(["<eos>", "a<bos>b", "<pad><unk>"]))
def test_tokenizer_round_trips_printable_text_exactly(text):
    tok = build_char_tokenizer()
    ids = tok(text)["input_ids"]
    assert ids[0] == tok.bos_token_id and len(ids) == len(text) + 1  # one token per character
    assert tok.decode(ids, skip_special_tokens=True) == text


def test_tokenizer_specials_and_save_load_with_autotokenizer(tok, tmp_path):
    from transformers import AutoTokenizer

    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    tok.save_pretrained(tmp_path)
    assert (tmp_path / "tokenizer.json").exists()
    loaded = AutoTokenizer.from_pretrained(str(tmp_path))
    text = "  12+34=\n#### 46  \n a b"
    assert loaded(text)["input_ids"] == tok(text)["input_ids"]
    assert loaded.decode(loaded(text)["input_ids"], skip_special_tokens=True) == text
    assert (loaded.pad_token, loaded.bos_token, loaded.eos_token) == ("<pad>", "<bos>", "<eos>")
    assert len(loaded) == len(tok)
    assert loaded("<eos>")["input_ids"] == tok("<eos>")["input_ids"] and len(tok("<eos>")["input_ids"]) == 6
    chat = loaded.apply_chat_template([{"role": "user", "content": "1+1="}], tokenize=False,
                                      add_generation_prompt=True)
    assert chat == "user: 1+1=\nassistant: "


def test_tokenizer_maps_unknown_characters_to_unk(tok):
    ids = tok("a\tb")["input_ids"]
    assert ids[2] == tok.unk_token_id and len(ids) == 4


def test_tiny_model_is_small_and_round_trips_through_save_pretrained(tok, tmp_path):
    default = small_model(tok, cfg=TinyModelConfig())
    assert count_parameters(default) < 10_000_000
    model = small_model(tok)
    model.save_pretrained(tmp_path)
    loaded = load_causal_lm(str(tmp_path))
    ids = torch.randint(0, len(tok), (2, 9))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, loaded(ids).logits)


def test_tiny_model_seed_decides_the_weights(tok):
    a, b, c = small_model(tok, 3), small_model(tok, 3), small_model(tok, 4)
    wa, wb, wc = (m.model.embed_tokens.weight for m in (a, b, c))
    assert torch.equal(wa, wb) and not torch.equal(wa, wc)


@pytest.mark.parametrize("name", ["pytorch_model.bin", "model.pt"])
def test_loader_refuses_pickle_only_dirs(tok, tmp_path, name):
    model = small_model(tok)
    model.config.save_pretrained(tmp_path)
    torch.save(model.state_dict(), tmp_path / name)
    with pytest.raises(ModelLoadError, match=r"only pickle weights.*safetensors.*save_pretrained"):
        load_causal_lm(str(tmp_path))
    with pytest.raises(ModelLoadError, match="pickle"):
        ValueModel.from_causal_lm_dir(str(tmp_path))


def test_loader_refuses_dirs_without_weights(tmp_path):
    with pytest.raises(ModelLoadError, match="no \\*.safetensors"):
        load_causal_lm(str(tmp_path))


def test_loader_refuses_hub_names_without_allow_network():
    with pytest.raises(ModelLoadError, match="allow_network"):
        load_causal_lm("Qwen/Qwen2.5-0.5B-Instruct")
    with pytest.raises(ModelLoadError, match="allow_network"):
        load_tokenizer("Qwen/Qwen2.5-0.5B-Instruct")


def test_save_model_atomic_writes_then_replaces(tok, tmp_path):
    out = tmp_path / "policy"
    first, second = small_model(tok, 0), small_model(tok, 1)
    save_model_atomic(first, tok, str(out))
    save_model_atomic(second, tok, str(out))
    assert sorted(os.listdir(tmp_path)) == ["policy"]  # no temp or old dirs left behind
    loaded = load_causal_lm(str(out))
    assert torch.equal(loaded.model.embed_tokens.weight, second.model.embed_tokens.weight)
    assert load_tokenizer(str(out))("1+2=")["input_ids"] == tok("1+2=")["input_ids"]


def test_load_weights_into_copies_in_place_and_refuses_other_shapes(tok, tmp_path):
    src, dst = small_model(tok, 0), small_model(tok, 1)
    src.save_pretrained(tmp_path / "src")
    load_weights_into(dst, str(tmp_path / "src"))
    ids = torch.randint(0, len(tok), (1, 5))
    with torch.no_grad():
        assert torch.equal(src(ids).logits, dst(ids).logits)
    other = small_model(tok, cfg=TinyModelConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                                 num_attention_heads=2, num_key_value_heads=2))
    with pytest.raises(RuntimeError, match="size mismatch"):
        load_weights_into(other, str(tmp_path / "src"))


def test_frozen_reference_is_a_frozen_copy(tok, tmp_path):
    model = small_model(tok)
    ref = frozen_reference(model)
    assert not ref.training and not any(p.requires_grad for p in ref.parameters())
    with torch.no_grad():
        model.model.embed_tokens.weight.add_(1.0)
    assert not torch.equal(ref.model.embed_tokens.weight, model.model.embed_tokens.weight)
    model.save_pretrained(tmp_path)
    loaded = frozen_reference(str(tmp_path))
    assert not loaded.training and not any(p.requires_grad for p in loaded.parameters())


def test_value_model_shapes_backbone_and_round_trip(tok, tmp_path):
    policy = small_model(tok)
    policy.save_pretrained(tmp_path / "policy")
    critic = ValueModel.from_causal_lm_dir(str(tmp_path / "policy"))
    assert torch.equal(critic.backbone.embed_tokens.weight, policy.model.embed_tokens.weight)
    ids = torch.randint(0, len(tok), (3, 7))
    mask = torch.ones_like(ids)
    values = critic(ids, attention_mask=mask)
    assert values.shape == (3, 7) and values.dtype == torch.float32
    assert torch.all(values == 0)  # a fresh head predicts 0
    torch.nn.init.normal_(critic.value_head.weight)
    values = critic(ids, attention_mask=mask)
    values.sum().backward()
    assert critic.backbone.embed_tokens.weight.grad is not None
    critic.save_pretrained(str(tmp_path / "critic"))
    loaded = ValueModel.from_pretrained(str(tmp_path / "critic"))
    with torch.no_grad():
        assert torch.allclose(loaded(ids, attention_mask=mask), values, atol=0, rtol=0)
    with pytest.raises(ModelLoadError, match="value_head"):
        ValueModel.from_pretrained(str(tmp_path / "policy"))


def test_value_model_honours_packed_position_ids(tok):
    critic = ValueModel(small_model(tok).model)
    torch.nn.init.normal_(critic.value_head.weight)
    a, b = torch.randint(3, len(tok), (1, 4)), torch.randint(3, len(tok), (1, 6))
    packed = torch.cat([a, b], dim=1)  # (1, 10)
    position_ids = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3, 4, 5]])
    with torch.no_grad():
        together = critic(packed, position_ids=position_ids)
        apart = torch.cat([critic(a), critic(b)], dim=1)
    assert torch.allclose(together, apart, atol=1e-5)
