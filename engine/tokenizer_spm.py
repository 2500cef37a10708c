"""Gemma's SentencePiece-style vocabulary (`tokenizer.ggml.model` = "llama") as a `tokenizers` BPE.

A Gemma GGUF lists no merges; its tokens' order is their merge rank (the scores do not follow it). So the
merges are recovered from the vocabulary: every way of cutting a token into two tokens, tokens taken in file
order, and within a token the cut with the longer left piece first. Spaces become "▁" before the model sees
the text, the whole text is one word (no pre-splitting), bytes missing from the vocabulary fall back to the
`<0xNN>` tokens. Runs of spaces are stored as real spaces, so they are respelled with "▁" to be found. This is
how Hugging Face transformers builds the same tokenizer from a Gemma GGUF, so both give the same ids.
"""

from __future__ import annotations

import re

from tokenizers import AddedToken, Tokenizer as HFTokenizer, decoders, models, normalizers

from engine.errors import EngineError
from engine.gguf_file import GGUFFile

TOKEN_CONTROL = 3
TOKEN_USER_DEFINED = 4
TOKEN_BYTE = 6
SPACE = "\u2581"
_BYTE_TOKEN = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")
# Architectures whose SentencePiece vocabularies follow the rules above.
GEMMA_FAMILY = ("gemma", "gemma2", "gemma3")


def _respell(token: str) -> str:
    return SPACE * len(token) if " " in token and not token.strip() else token


def recover_merges(spelled: list[str]) -> list[tuple[str, str]]:
    """Merges implied by a vocabulary listed in merge order (see the module docstring)."""
    rank = {t: i for i, t in enumerate(spelled)}  # a token listed twice ranks at its last place
    merges = []
    for token in sorted(rank, key=rank.get):
        for cut in range(len(token) - 1, 0, -1):
            left, right = token[:cut], token[cut:]
            if left in rank and right in rank:
                merges.append((left, right))
    return merges


def build_sentencepiece(gguf: GGUFFile, tokens: list[str], token_types: list[int]) -> tuple[HFTokenizer, set[int], list[bytes]]:
    """(the `tokenizers` object, ids of control tokens, the bytes each token stands for)."""
    if gguf.architecture not in GEMMA_FAMILY:
        raise EngineError(
            f"The model {gguf.path.name} ({gguf.architecture}) has a SentencePiece tokenizer, which this engine "
            f"supports for {', '.join(GEMMA_FAMILY)} models only. Pick a model with a byte-level BPE tokenizer."
        )
    spelled = [_respell(t) for t in tokens]
    vocab = {t: i for i, t in enumerate(spelled)}
    unk_id = gguf.get("tokenizer.ggml.unknown_token_id")
    model = models.BPE(
        vocab,
        recover_merges(spelled),
        unk_token=tokens[unk_id] if unk_id is not None else None,
        fuse_unk=True,
        byte_fallback=True,
    )
    hf = HFTokenizer(model)
    hf.normalizer = normalizers.Replace(" ", SPACE)
    hf.decoder = decoders.Sequence([decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()])
    special_ids = {i for i, kind in enumerate(token_types) if kind == TOKEN_CONTROL}
    hf.add_special_tokens([AddedToken(tokens[i], normalized=False, special=True) for i in sorted(special_ids)])
    # A user-defined token spelled with real spaces was respelled above; only the others match whole.
    user = [i for i, kind in enumerate(token_types) if kind == TOKEN_USER_DEFINED and tokens[i] in vocab]
    hf.add_tokens([AddedToken(tokens[i], normalized=False, special=False) for i in user])

    def token_bytes(i: int) -> bytes:
        byte = _BYTE_TOKEN.match(tokens[i]) if token_types[i] == TOKEN_BYTE else None
        if byte is not None:
            return bytes([int(byte.group(1), 16)])
        return tokens[i].replace(SPACE, " ").encode("utf-8")

    return hf, special_ids, [token_bytes(i) for i in range(len(tokens))]
