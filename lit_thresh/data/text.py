"""Language modelling on any Hugging Face `datasets` text source, in windows of `block_size + 1` tokens.

`datasets` (about a second to import) is imported where it is used, so that commands reading no text (MQAR runs,
`--help`) start without it.
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Iterable, Iterator, Sequence
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import pyarrow.compute as pc
import torch
from filelock import FileLock
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

from lit_thresh.data.batched import batched_loader_options
from lit_thresh.data.resumable import ResumableDataModule, seeded_loader
from lit_thresh.data.tokenizers import Tokenizer, TrainableTokenizer

if TYPE_CHECKING:
    import datasets

DataFiles = str | list[str] | dict[str, str | list[str]]
FILE_BUILDERS = ("text", "json", "csv", "parquet", "arrow")  # `datasets` builders that read data_files


class TokenWindows(Dataset[dict[str, Tensor]]):
    """Windows of a token stream as next-token pairs: item i starts at `starts[i]`."""

    def __init__(self, tokens: Tensor, starts: Tensor, block_size: int) -> None:
        self.tokens = tokens  # (N,)
        self.starts = starts  # (len,)
        self.block_size = block_size

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, index: int) -> dict[str, Tensor]:
        start = int(self.starts[index])
        window = self.tokens[start : start + self.block_size + 1].long()  # (T + 1,)
        return {"input_ids": window[:-1], "labels": window[1:]}

    def __getitems__(self, indices: list[int]) -> dict[str, Tensor]:
        """A whole batch in one gather (lit_thresh.data.batched): the DataLoader calls this instead of
        __getitem__ per index when its collate_fn is `collate_batch`."""
        offsets = torch.arange(self.block_size + 1)  # (T + 1,)
        windows = self.tokens[self.starts[indices, None] + offsets].long()  # (B, T + 1)
        return {"input_ids": windows[:, :-1].contiguous(), "labels": windows[:, 1:].contiguous()}


def block_starts(n_tokens: int, block_size: int) -> Tensor:
    """Starts of consecutive windows that predict every token after the first exactly once."""
    return torch.arange(0, n_tokens - block_size, block_size)


def random_starts(n_tokens: int, block_size: int, count: int, seed: int) -> Tensor:
    """`count` uniformly drawn window starts (with replacement, as nanoGPT), fixed by `seed`."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(n_tokens - block_size, (count,), generator=generator)


def _head(texts: Iterable[str], n_chars: int) -> Iterator[str]:
    """The first `n_chars` characters of the concatenated `texts`."""
    for text in texts:
        if n_chars <= 0:
            return
        yield text[:n_chars]
        n_chars -= len(text)


def unreadable_text_file(data_files: DataFiles) -> str | None:
    """What makes the first bad file of `data_files` unreadable as UTF-8 text (empty, binary or another
    encoding), naming it; None when every file reads. Called only after `datasets` failed to load them."""
    from datasets.data_files import resolve_pattern, sanitize_patterns

    for patterns in sanitize_patterns(data_files).values():
        for path in (file for pattern in patterns for file in resolve_pattern(pattern, base_path=os.getcwd())):
            data = Path(path).read_bytes()
            if not data:
                return f"{path} is empty"
            if data[:2] in (b"\xff\xfe", b"\xfe\xff"):  # a UTF-16 byte order mark
                return f"{path} is UTF-16 text, not UTF-8; convert it to UTF-8"
            if (nul := data.find(b"\0")) >= 0:
                return f"{path} is a binary file, not text (a NUL byte at offset {nul})"
            try:
                data.decode("utf-8")
            except UnicodeDecodeError as error:
                byte = data[error.start]
                return f"{path} is not UTF-8 text (byte 0x{byte:02x} at offset {error.start}); convert it to UTF-8"
    return None


def _pick(source: datasets.DatasetDict, split: str, arg: str) -> datasets.Dataset:
    if split not in source:
        raise ValueError(f"{arg}={split!r} is not a split of the source; it has {list(source)}")
    return source[split]


def _encode_batch(batch: dict[str, list], tokenizer: Tokenizer, column: str) -> dict[str, list[list[int]]]:
    return {"input_ids": tokenizer.encode_batch(batch[column])}


class TextDataModule(ResumableDataModule):
    """Next-token prediction on a text source, tokenised once and cached by `datasets`.

    The rows of a split, concatenated, form its token stream. The source's train / validation /
    test splits are used when present; without a validation split the train stream is cut: its
    first `train_fraction` trains, the rest validates (nanoGPT's shakespeare_char). Rows of the
    `text` builder keep their line breaks, so the stream is the file itself.

    A trainable tokenizer learns from the training text (the first `train_fraction` of the
    characters when the stream is cut) and is cached next to the data; a CharTokenizer learns its
    alphabet from all of the text, every split, as nanoGPT (`covers_only_seen_text`), so that a
    character found only in the validation or test text has an id too. A text file that is empty,
    binary or not UTF-8 is a ValueError naming the file. Tokenising happens in
    `prepare_data`; `datasets` caches it under a fingerprint of the data and the tokenizer, so later
    runs and the other DDP ranks read the cache and a new file or tokenizer makes a new one.

    Training windows: `sampling="random"` takes windows at random starts (all starts, or a fixed
    draw of `samples_per_epoch`), `"blocks"` consecutive non-overlapping windows; either way they are
    shuffled in an order fixed by `seed` and the epoch, sharded over DDP ranks, and a checkpoint
    resumes it mid-epoch (`ResumableDataModule`). Validation takes consecutive windows (or a
    fixed draw of `val_samples`) in a fixed order, so `limit_val_batches=N` always sees the same
    first N batches. Test takes consecutive windows of the test split, or of the validation stream
    when the source has no test split (logged as `test/...`), and with `test_length_multipliers` also
    consecutive windows of m x `block_size` tokens of the same stream (logged as `test/len{L}/...`,
    L = m x `block_size`, batched by `batch_size // m`: the same tokens per batch).

    Args:
        tokenizer: text <-> ids, e.g. `CharTokenizer()`.
        path: `datasets` source: a builder (`text`, `json`, `parquet`, ...) or a Hub dataset name.
        name: the source's configuration, e.g. `wikitext-103-raw-v1`.
        data_files: path, glob, list of them, or a mapping from split name to them.
        text_column: column holding the text.
        train_split: split to train on.
        val_split: split to validate on; default `validation` when present, else cut from train.
        test_split: split to test on; default `test` when present, else the validation stream.
        train_fraction: share of the train stream kept for training when there is no validation split.
        block_size: tokens per input sequence.
        batch_size: sequences per batch (per device).
        sampling: training windows at random starts, or consecutive blocks.
        samples_per_epoch: with random sampling, a fixed draw of this many windows per epoch
            instead of every start.
        val_samples: a fixed draw of this many validation windows instead of consecutive blocks.
        test_length_multipliers: extra test sets of windows at these multiples of `block_size`.
        seed: seed of the training windows' draw (`samples_per_epoch`) and order.
        val_seed: seed of the validation draw (`val_samples`), apart from `seed` so that runs with
            other training orders are scored on the same windows.
        cache_dir: `datasets` cache directory; default `datasets`' own.
        num_proc: processes for loading and tokenising.
        num_workers: data loader worker processes; 0 (load in the training process) suits in-memory
            token streams, whose batches are one gather (TokenWindows.__getitems__).
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        path: str = "text",
        name: str | None = None,
        data_files: DataFiles | None = None,
        text_column: str = "text",
        train_split: str = "train",
        val_split: str | None = None,
        test_split: str | None = None,
        train_fraction: float = 0.9,
        block_size: int = 256,
        batch_size: int = 64,
        sampling: Literal["random", "blocks"] = "random",
        samples_per_epoch: int | None = None,
        val_samples: int | None = None,
        test_length_multipliers: Sequence[int] = (),
        seed: int = 0,
        val_seed: int = 0,
        cache_dir: str | None = None,
        num_proc: int | None = None,
        num_workers: int = 0,
    ) -> None:
        super().__init__()
        if not isinstance(tokenizer, Tokenizer):
            raise TypeError(f"tokenizer must be a lit_thresh.data.tokenizers.Tokenizer, got {type(tokenizer).__name__}")
        if path in FILE_BUILDERS and data_files is None:
            raise ValueError(f"data_files is required to read the {path!r} builder's files")
        if not 0.0 < train_fraction < 1.0:
            raise ValueError(f"train_fraction must be in (0, 1), got {train_fraction}")
        if sampling not in ("random", "blocks"):
            raise ValueError(f"sampling must be 'random' or 'blocks', got {sampling!r}")
        if samples_per_epoch is not None and sampling != "random":
            raise ValueError("samples_per_epoch applies to sampling='random' only")
        for arg, value in [("block_size", block_size), ("batch_size", batch_size)]:
            if value < 1:
                raise ValueError(f"{arg} must be positive, got {value}")
        for arg, value in [("samples_per_epoch", samples_per_epoch), ("val_samples", val_samples)]:
            if value is not None and value < 1:
                raise ValueError(f"{arg} must be positive or None, got {value}")
        if any(m < 1 for m in test_length_multipliers):
            raise ValueError(f"test_length_multipliers must be >= 1, got {list(test_length_multipliers)}")
        self.tokenizer = tokenizer
        self.path = path
        self.name = name
        self.data_files = data_files
        self.text_column = text_column
        self.train_split = train_split
        self.val_split = val_split
        self.test_split = test_split
        self.train_fraction = train_fraction
        self.block_size = block_size
        self.batch_size = batch_size
        self.sampling = sampling
        self.samples_per_epoch = samples_per_epoch
        self.val_samples = val_samples
        self.test_length_multipliers = tuple(dict.fromkeys(test_length_multipliers))
        self.seed = seed
        self.val_seed = val_seed
        self.cache_dir = cache_dir
        self.num_proc = num_proc
        self.num_workers = num_workers

    @property
    def vocab_size(self) -> int:
        """Number of token ids (learns the vocabulary first where needed)."""
        return self._fit_tokenizer().vocab_size

    def order_settings(self) -> dict[str, int]:
        return {"seed": self.seed, "batch_size": self.batch_size}

    @property
    def train_seq_len(self) -> int:
        """Tokens per training sequence: `block_size`."""
        return self.block_size

    @property
    def max_seq_len(self) -> int:
        """Longest sequence fed to the model: `block_size` times the largest test length multiplier."""
        return self.block_size * max(self.test_length_multipliers, default=1)

    @property
    def test_set_names(self) -> list[str]:
        """`test` (windows of `block_size`), then `len{L}` per test length multiplier."""
        return ["test"] + [f"len{m * self.block_size}" for m in self.test_length_multipliers]

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, e.g. a generation prompt."""
        return self._fit_tokenizer().encode(text)

    def decode(self, ids: Sequence[int]) -> str:
        """Text of token `ids`."""
        return self._fit_tokenizer().decode(ids)

    @cached_property
    def _raw(self) -> datasets.DatasetDict:
        """The source's splits, each named by its role: `train`, `val` (if any), `test` (if any)."""
        from datasets import DatasetDict, load_dataset
        from datasets.data_files import resolve_pattern, sanitize_patterns
        from datasets.exceptions import DatasetGenerationError

        if self.data_files is not None:
            for split, patterns in sanitize_patterns(self.data_files).items():
                for pattern in patterns:
                    try:
                        resolve_pattern(pattern, base_path=os.getcwd())
                    except FileNotFoundError:
                        raise FileNotFoundError(f"data_files: no file matches {pattern!r} (split {split!r})") from None
        kwargs = {"keep_linebreaks": True} if self.path == "text" else {}
        try:
            source = load_dataset(
                self.path,
                self.name,
                data_files=self.data_files,
                cache_dir=self.cache_dir,
                num_proc=self.num_proc,
                **kwargs,
            )
        except DatasetGenerationError as error:
            if self.path == "text" and (problem := unreadable_text_file(self.data_files)):
                raise ValueError(f"data_files: {problem}") from error
            raise
        roles = {"train": _pick(source, self.train_split, "train_split")}
        for role, arg, split, default in [
            ("val", "val_split", self.val_split, "validation"),
            ("test", "test_split", self.test_split, "test"),
        ]:
            if split is not None:
                roles[role] = _pick(source, split, arg)
            elif default in source:
                roles[role] = source[default]
        for role, dataset in roles.items():
            if self.text_column not in dataset.column_names:
                raise ValueError(
                    f"text_column={self.text_column!r} is not a column of the {role} split; "
                    f"it has {dataset.column_names}"
                )
        return DatasetDict(roles)

    def _training_text(self) -> Iterator[str]:
        """The text the tokenizer learns from: the training part of the train split, or every split's
        text for a tokenizer that can only encode what it has seen (a CharTokenizer's alphabet)."""
        if self.tokenizer.covers_only_seen_text:
            return (text for split in self._raw.values() for text in split[self.text_column])
        texts = self._raw["train"][self.text_column]
        if "val" in self._raw:
            return iter(texts)
        return _head(texts, int(sum(map(len, texts)) * self.train_fraction))

    def _fit_tokenizer(self) -> Tokenizer:
        """The tokenizer, its vocabulary learned from the training text or read from the cache."""
        from datasets.fingerprint import Hasher

        tokenizer = self.tokenizer
        if not isinstance(tokenizer, TrainableTokenizer) or tokenizer.is_trained:
            return tokenizer
        # The directory of the prepared source is specific to its files and their modification times.
        data_dir = Path(self._raw["train"].cache_files[0]["filename"]).parent
        if tokenizer.covers_only_seen_text:
            text = ["every split", self.train_split, self.val_split, self.test_split]
        else:
            text = [self.train_split, None if "val" in self._raw else self.train_fraction]
        key = Hasher.hash([tokenizer, self.text_column, text])
        path = data_dir / f"lit_thresh-tokenizer-{key}.pkl"
        with FileLock(f"{path}.lock"):
            if path.exists():
                self.tokenizer = pickle.loads(path.read_bytes())
            else:
                tokenizer.train(self._training_text())
                path.write_bytes(pickle.dumps(tokenizer))
        return self.tokenizer

    def _tokenized(self) -> datasets.DatasetDict:
        """Token ids of every row; computed once, then read from `datasets`' cache."""
        from datasets import Features, List, Value

        return self._raw.map(
            _encode_batch,
            batched=True,
            fn_kwargs={"tokenizer": self._fit_tokenizer(), "column": self.text_column},
            remove_columns=self._raw["train"].column_names,
            features=Features({"input_ids": List(Value("int32"))}),
            num_proc=self.num_proc,
            desc="Tokenizing",
        )

    def prepare_data(self) -> None:
        self._tokenized()

    def setup(self, stage: str) -> None:
        streams = {  # role -> (N,) int32, the concatenated rows
            role: torch.tensor(pc.list_flatten(dataset.with_format("arrow")["input_ids"]).to_numpy())
            for role, dataset in self._tokenized().items()
        }
        if "val" not in streams:
            n_train = int(len(streams["train"]) * self.train_fraction)
            streams["train"], streams["val"] = streams["train"][:n_train], streams["train"][n_train:]
        for role, stream in streams.items():
            if len(stream) <= self.block_size:
                cut = " (the text after train_fraction)" if role == "val" and "val" not in self._raw else ""
                raise ValueError(
                    f"the text is too short: its {role} part{cut} has {len(stream)} tokens, and one window of "
                    f"block_size={self.block_size} needs {self.block_size + 1}; use more text or a smaller block_size"
                )

        n_train = len(streams["train"])
        if self.sampling == "blocks":
            train_starts = block_starts(n_train, self.block_size)
        elif self.samples_per_epoch is None:
            train_starts = torch.arange(n_train - self.block_size)
        else:
            train_starts = random_starts(n_train, self.block_size, self.samples_per_epoch, self.seed)
        n_val = len(streams["val"])
        if self.val_samples is None:
            val_starts = block_starts(n_val, self.block_size)
        else:
            val_starts = random_starts(n_val, self.block_size, self.val_samples, self.val_seed)
        self.train_set = TokenWindows(streams["train"], train_starts, self.block_size)
        self.val_set = TokenWindows(streams["val"], val_starts, self.block_size)
        test = streams.get("test", streams["val"])
        self.test_sets = {"test": TokenWindows(test, block_starts(len(test), self.block_size), self.block_size)}
        for name, m in zip(self.test_set_names[1:], self.test_length_multipliers, strict=True):
            length = m * self.block_size
            if len(test) <= length:
                raise ValueError(
                    f"test_length_multipliers: the test stream has {len(test)} tokens, too few for "
                    f"windows of {m} x block_size = {length}"
                )
            self.test_sets[name] = TokenWindows(test, block_starts(len(test), length), length)

    def _loader_options(self) -> dict[str, Any]:
        """DataLoader options of every split."""
        return batched_loader_options(self.num_workers) | {"persistent_workers": self.num_workers > 0}

    def _loader(self, dataset: Dataset, batch_size: int | None = None) -> DataLoader:
        return seeded_loader(dataset, batch_size or self.batch_size, self.seed, **self._loader_options())

    def train_dataloader(self) -> DataLoader:
        options = self._loader_options()
        return self.resumable_loader(self.train_set, self.batch_size, self.seed, drop_last=True, **options)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_set)

    def test_dataloader(self) -> list[DataLoader]:
        multipliers = (1, *self.test_length_multipliers)
        return [
            self._loader(self.test_sets[name], batch_size=max(1, self.batch_size // m))
            for name, m in zip(self.test_set_names, multipliers, strict=True)
        ]
