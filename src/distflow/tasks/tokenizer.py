"""A character-level tokenizer built locally with the `tokenizers` library.

The embedded default must not download anything, so its tokenizer is built from an
alphabet: one token per character, `<bos>` prepended, left padding (generation pads
prompts on the left so every prompt ends at the same column). `decoders.Fuse()` makes
decode the exact inverse of encode (no spaces inserted between characters).
"""

from __future__ import annotations

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<unk>")
DEFAULT_ALPHABET = "0123456789+-*=() "


def build_char_tokenizer(alphabet: str = DEFAULT_ALPHABET) -> PreTrainedTokenizerFast:
    """Return a fast tokenizer with one token per character of `alphabet`.

    >>> tok = build_char_tokenizer()
    >>> ids = tok("12+7=")["input_ids"]
    >>> tok.decode(ids, skip_special_tokens=True)
    '12+7='
    >>> ids[0] == tok.bos_token_id
    True
    """
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS)}
    for char in alphabet:
        if char not in vocab:
            vocab[char] = len(vocab)
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    core.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", vocab["<bos>"])])
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token="<pad>",
        bos_token="<bos>",
        eos_token="<eos>",
        unk_token="<unk>",
        padding_side="left",
    )
