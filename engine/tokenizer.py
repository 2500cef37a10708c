"""The tokenizer a GGUF describes, built with the `tokenizers` library from the file's own vocabulary.

Byte-level BPE (`tokenizer.ggml.model` = "gpt2") is supported: the vocabulary and merges as stored, control
tokens (token type 3) as special tokens, user-defined tokens (type 4) as added tokens, and the split regex
named by `tokenizer.ggml.pre` where it differs from GPT-2's. This mirrors how Hugging Face transformers builds
the same tokenizer from a GGUF, so both give the same ids. Gemma's SentencePiece vocabularies
(`tokenizer.ggml.model` = "llama") are built by engine/tokenizer_spm.py.

Decoding goes through each token's bytes, which also gives UTF-8-safe streaming (`StreamDecoder`).
"""

from __future__ import annotations

import codecs

from tokenizers import AddedToken, Regex, Tokenizer as HFTokenizer, decoders, models, pre_tokenizers

from engine.errors import EngineError
from engine.gguf_file import GGUFFile
from engine.tokenizer_spm import build_sentencepiece

_TOKEN_CONTROL = 3
_TOKEN_USER_DEFINED = 4

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen3.5's: Qwen2's, with combining marks (\p{M}) kept in words and out of punctuation runs.
_QWEN35_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Pre-tokenizer names (tokenizer.ggml.pre) whose merges were learned on another split than GPT-2's.
_SPLITS = {
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "llama-bpe": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT,
    "dbrx": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
    "qwen35": _QWEN35_SPLIT,
}


def byte_alphabet() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map: printable Latin-1 bytes stand for themselves, the
    other 68 bytes take the characters from U+0100 on, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


class Tokenizer:
    """Encode text to token ids and decode ids to text for one model."""

    def __init__(self, gguf: GGUFFile):
        kind = gguf.get("tokenizer.ggml.model")
        if kind is None:
            raise EngineError(
                f"{gguf.path.name} has no tokenizer in its metadata (tokenizer.ggml.model); it is not a complete "
                "model file. Download the model again or pick another one."
            )
        if kind not in ("gpt2", "llama"):
            raise EngineError(
                f"The model {gguf.path.name} uses a {kind!r} tokenizer; this engine supports byte-level BPE "
                "('gpt2') and Gemma's SentencePiece ('llama') tokenizers only. Pick a model with one of these."
            )
        tokens: list[str] = gguf.require("tokenizer.ggml.tokens")
        token_types = gguf.get("tokenizer.ggml.token_type")
        token_types = [int(t) for t in token_types] if token_types is not None else [1] * len(tokens)
        if kind == "llama":
            self._hf, self.special_ids, self._bytes = build_sentencepiece(gguf, tokens, token_types)
        else:
            self._build_byte_level(gguf, tokens, token_types)
        self._plain: HFTokenizer | None = None  # made on first use by encode_plain
        self._ids = {t: i for i, t in enumerate(tokens)}
        self.vocab_size = len(tokens)
        self.bos_id = gguf.get("tokenizer.ggml.bos_token_id")
        self.eos_id = gguf.get("tokenizer.ggml.eos_token_id")
        self.add_bos = bool(gguf.get("tokenizer.ggml.add_bos_token", False))

    def _build_byte_level(self, gguf: GGUFFile, tokens: list[str], token_types: list[int]) -> None:
        alphabet = byte_alphabet()
        decode_char = {c: b for b, c in alphabet.items()}
        allowed = set(alphabet.values())

        spelled = [t if set(t) <= allowed else "".join(alphabet[b] for b in t.encode("utf-8")) for t in tokens]
        merges = [tuple(m.split(" ", 1)) for m in gguf.require("tokenizer.ggml.merges")]
        self._hf = HFTokenizer(models.BPE({t: i for i, t in enumerate(spelled)}, merges, fuse_unk=False))
        split = _SPLITS.get(gguf.get("tokenizer.ggml.pre"))
        if split is None:
            self._hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        else:
            self._hf.pre_tokenizer = pre_tokenizers.Sequence(
                [
                    pre_tokenizers.Split(Regex(split), behavior="isolated"),
                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
                ]
            )
        self._hf.decoder = decoders.ByteLevel()
        # A control token spelled outside the byte alphabet is a converter mislabel, not a real token.
        self.special_ids = {
            i for i, (t, kind) in enumerate(zip(tokens, token_types)) if kind == _TOKEN_CONTROL and set(t) <= allowed
        }
        self._hf.add_special_tokens([AddedToken(tokens[i], normalized=False, special=True) for i in sorted(self.special_ids)])
        user = [i for i, kind in enumerate(token_types) if kind == _TOKEN_USER_DEFINED]
        self._hf.add_tokens([AddedToken(tokens[i], normalized=False, special=False) for i in user])

        # Bytes of every token: added tokens are literal text, the rest are spelled in the byte alphabet.
        literal = self.special_ids | set(user)
        self._bytes = [
            tokens[i].encode("utf-8") if i in literal else bytes(decode_char[c] for c in spelled[i])
            for i in range(len(tokens))
        ]

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        """Token ids of text; special tokens written in the text (like <|im_start|>) become their ids.
        BOS is prepended if the model asks for it (or add_bos says so)."""
        ids = self._hf.encode(text, add_special_tokens=False).ids
        if (self.add_bos if add_bos is None else add_bos) and self.bos_id is not None:
            ids = [self.bos_id, *ids]
        return ids

    def encode_plain(self, text: str) -> list[int]:
        """Token ids of text with no special token parsed: "<|im_start|>" written in it stays those characters."""
        if self._plain is None:
            # The same tokenizer with control tokens matched as plain text: a chat message never becomes one.
            self._plain = HFTokenizer.from_str(self._hf.to_str())
            self._plain.encode_special_tokens = True
        return self._plain.encode(text, add_special_tokens=False).ids

    def holds_control_text(self, text: str) -> bool:
        """Whether text spells a control token somewhere (e.g. "<|im_end|>"); the tokenizer's own matcher finds them."""
        return not self.special_ids.isdisjoint(self._hf.encode(text, add_special_tokens=False).ids)

    def encode_segments(self, segments: list[tuple[str, bool]]) -> list[int]:
        """Token ids of (text, plain) pieces in order: plain pieces through encode_plain, the others with special
        tokens parsed; BOS as `encode` adds it."""
        ids = [self.bos_id] if self.add_bos and self.bos_id is not None else []
        for text, plain in segments:
            ids += self.encode_plain(text) if plain else self._hf.encode(text, add_special_tokens=False).ids
        return ids

    def token_bytes(self, token_id: int) -> bytes:
        return self._bytes[token_id]

    def decode(self, ids: list[int]) -> str:
        """Text of the ids; bytes that are not valid UTF-8 become U+FFFD, as in `tokenizers`."""
        return b"".join(self._bytes[i] for i in ids).decode("utf-8", errors="replace")

    def token_id(self, text: str) -> int | None:
        """The id of a token spelled exactly `text` in the vocabulary (e.g. "<|im_end|>"), or None."""
        return self._ids.get(text)

    def stream_decoder(self) -> StreamDecoder:
        return StreamDecoder(self)


class StreamDecoder:
    """Turns token ids, one at a time, into text pieces that never end inside a UTF-8 character."""

    def __init__(self, tokenizer: Tokenizer):
        self._tokenizer = tokenizer
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        """The complete characters this token finishes (may be "" while a character is incomplete). Bytes that
        can never form a character become U+FFFD; those of a character still incomplete at the end of
        generation are never returned."""
        return self._utf8.decode(self._tokenizer.token_bytes(token_id))
