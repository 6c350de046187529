"""A character-level tokenizer built with the `tokenizers` library.

One token per character of printable ASCII plus newline, and four specials. It is a
BPE model with no merges and no pre-tokenizer, so text maps to its characters with
nothing inserted or stripped, and `save_pretrained` writes a `tokenizer.json` that
`AutoTokenizer` and vLLM load as they would any other fast tokenizer. Encoding
prepends `<bos>` (as Llama does); decoding concatenates the characters. Text that
spells a special token ("<eos>") is encoded as its characters (`split_special_tokens`), so
no prompt or response text can smuggle in a control token and every text round-trips.
"""

from __future__ import annotations


from tokenizers import Tokenizer, decoders, models, processors
from transformers import PreTrainedTokenizerFast

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIALS = (PAD, BOS, EOS, UNK)  # ids 0, 1, 2, 3
CHARS = "\n" + "".join(chr(c) for c in range(32, 127))  # printable ASCII and newline

# `messages` is a list of {role, content}; each turn is "role: content\n".
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


def char_vocab() -> dict[str, int]:
    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    for ch in CHARS:
        vocab[ch] = len(vocab)
    return vocab


def build_char_tokenizer() -> PreTrainedTokenizerFast:
    """The character tokenizer: pad/bos/eos/unk set, `<bos>` prepended when encoding."""
    vocab = char_vocab()
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=UNK))
    tok.add_special_tokens(list(SPECIALS))
    tok.decoder = decoders.Fuse()
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, vocab[BOS])])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        padding_side="left",
        clean_up_tokenization_spaces=False,
        split_special_tokens=True,
        chat_template=CHAT_TEMPLATE,
        model_max_length=4096,
    )
