"""Tokenizers with one interface: bytes and characters, byte-level BPE trained locally, pretrained by name.

Only `PretrainedTokenizer` downloads anything. Every tokenizer pickles deterministically (plain
attributes, ordered containers), so `fingerprint` and the fingerprints `datasets` computes for a
`map` that uses it are the same in every process: the tokenised cache is found again on the next
run and on every DDP rank.
"""

from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from typing import ClassVar

import tokenizers
from tokenizers.implementations import ByteLevelBPETokenizer


class Tokenizer(ABC):
    """Maps text to token ids and back."""

    @property
    @abstractmethod
    def vocab_size(self) -> int:
        """Number of distinct token ids."""

    @abstractmethod
    def encode(self, text: str) -> list[int]:
        """Token ids of `text`."""

    @abstractmethod
    def decode(self, ids: Sequence[int]) -> str:
        """Text of token `ids`."""

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids of each text."""
        return [self.encode(text) for text in texts]

    @property
    def fingerprint(self) -> str:
        """Stable hash of the configuration and vocabulary, the same in every process: a cache key."""
        from datasets.fingerprint import Hasher  # imported here, as in data/text.py

        return Hasher.hash(self)


class TrainableTokenizer(Tokenizer):
    """A tokenizer whose vocabulary is learned from the training text.

    `covers_only_seen_text`: it cannot encode text unlike what it learned from (a character never
    seen), so TextDataModule trains it on all of the source's text (every split), not only the
    training part.
    """

    covers_only_seen_text: ClassVar[bool] = False

    @property
    @abstractmethod
    def is_trained(self) -> bool:
        """Whether the vocabulary has been learned."""

    @abstractmethod
    def train(self, texts: Iterable[str]) -> None:
        """Learn the vocabulary from `texts`."""

    def _check_trained(self) -> None:
        if not self.is_trained:
            raise RuntimeError(f"{type(self).__name__} has no vocabulary yet: call train() first")


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes: 256 ids, nothing to learn."""

    @property
    def vocab_size(self) -> int:
        return 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        # Generated ids need not form valid UTF-8.
        return bytes(ids).decode("utf-8", errors="replace")


class CharTokenizer(TrainableTokenizer):
    """One id per character, the sorted characters of the text it is trained on (nanoGPT's
    shakespeare_char). TextDataModule trains it on the whole text, validation and test included (as
    nanoGPT), so that every character it will encode has an id (covers_only_seen_text).

    Args:
        chars: a fixed alphabet instead of one learned by `train`.
    """

    covers_only_seen_text = True

    def __init__(self, chars: str | None = None) -> None:
        if chars is not None and len(set(chars)) != len(chars):
            raise ValueError(f"chars must not repeat a character, got {chars!r}")
        self._set_chars(chars)

    def _set_chars(self, chars: str | None) -> None:
        self.chars = chars
        self._ids = {char: i for i, char in enumerate(chars or "")}

    @property
    def is_trained(self) -> bool:
        return self.chars is not None

    def train(self, texts: Iterable[str]) -> None:
        seen: set[str] = set()
        for text in texts:
            seen.update(text)
        self._set_chars("".join(sorted(seen)))

    @property
    def vocab_size(self) -> int:
        self._check_trained()
        return len(self.chars)

    def encode(self, text: str) -> list[int]:
        self._check_trained()
        try:
            return [self._ids[char] for char in text]
        except KeyError as error:
            raise ValueError(f"character {error.args[0]!r} is not in the vocabulary") from None

    def decode(self, ids: Sequence[int]) -> str:
        self._check_trained()
        return "".join(self.chars[i] for i in ids)


class _BackendTokenizer(Tokenizer):
    """Encoding and decoding through a `tokenizers` library tokenizer, without special tokens."""

    backend: tokenizers.Tokenizer | ByteLevelBPETokenizer

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        return self.backend.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        # The library encodes a batch on all cores.
        return [encoding.ids for encoding in self.backend.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Sequence[int]) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=False)


class BPETokenizer(_BackendTokenizer, TrainableTokenizer):
    """Byte-level BPE (GPT-2 style, lossless) trained with the `tokenizers` library.

    Args:
        vocab_size: target vocabulary size, at least the 256 bytes; a small text may yield fewer.
        min_frequency: fewest occurrences for a pair to be merged.
    """

    def __init__(self, vocab_size: int = 4096, min_frequency: int = 2) -> None:
        if vocab_size < 256:
            raise ValueError(f"vocab_size must be at least 256 (the byte alphabet), got {vocab_size}")
        if min_frequency < 1:
            raise ValueError(f"min_frequency must be positive, got {min_frequency}")
        self.target_vocab_size = vocab_size
        self.min_frequency = min_frequency
        self._backend: ByteLevelBPETokenizer | None = None

    @property
    def is_trained(self) -> bool:
        return self._backend is not None

    @property
    def backend(self) -> ByteLevelBPETokenizer:
        self._check_trained()
        return self._backend

    def train(self, texts: Iterable[str]) -> None:
        backend = ByteLevelBPETokenizer()
        backend.train_from_iterator(
            texts, vocab_size=self.target_vocab_size, min_frequency=self.min_frequency, show_progress=False
        )
        self._backend = backend


class PretrainedTokenizer(_BackendTokenizer):
    """A tokenizer from the Hugging Face Hub (needs network on first use), e.g. `gpt2`.

    Args:
        name: Hub repository holding a `tokenizer.json`.
        revision: branch, tag or commit.
    """

    def __init__(self, name: str, revision: str = "main") -> None:
        self.name = name
        self.revision = revision
        self.backend = tokenizers.Tokenizer.from_pretrained(name, revision=revision)
