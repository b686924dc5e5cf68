import json
import os
import random
import re
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from lightning.pytorch import LightningModule, Trainer
from torch.utils.data import SequentialSampler

from lit_thresh.data.resumable import ResumableSampler
from lit_thresh.data.text import TextDataModule, block_starts, random_starts
from lit_thresh.data.tokenizers import BPETokenizer, ByteTokenizer, CharTokenizer, Tokenizer
from lit_thresh.model import TransformerConfig
from lit_thresh.module import LanguageModel

WORDS = "the king queen lord speak hear me now good night sweet prince to be or not".split()


def make_lines(n_lines: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choices(WORDS, k=rng.randint(1, 8))).capitalize() + "\n" for _ in range(n_lines)]


@pytest.fixture
def text_file(tmp_path):
    path = tmp_path / "input.txt"
    path.write_text("".join(make_lines(400)))
    return path


def make_dm(tmp_path, data_files, tokenizer: Tokenizer | None = None, **kwargs) -> TextDataModule:
    kwargs = {"block_size": 16, "batch_size": 4, "cache_dir": str(tmp_path / "cache"), **kwargs}
    return TextDataModule(tokenizer or CharTokenizer(), data_files=data_files, **kwargs)


def ready(dm: TextDataModule) -> TextDataModule:
    dm.prepare_data()
    dm.setup("fit")
    return dm


def stream(dm: TextDataModule, split: str) -> str:
    windows = dm.test_sets["test"] if split == "test" else getattr(dm, f"{split}_set")
    return dm.decode(windows.tokens.tolist())


def cache_files(dm: TextDataModule) -> list[str]:
    return [file["filename"] for files in dm._tokenized().cache_files.values() for file in files]


# Sources and splits


def test_text_file_fraction_split_as_nanogpt(tmp_path, text_file):
    text = text_file.read_text()
    dm = ready(make_dm(tmp_path, str(text_file)))
    n_train = int(len(text) * 0.9)
    assert stream(dm, "train") == text[:n_train]
    assert stream(dm, "val") == text[n_train:]
    assert dm.vocab_size == len(set(text))  # a CharTokenizer's alphabet: every character, as nanoGPT
    assert dm.max_seq_len == 16
    assert dm.decode(dm.encode("Good night")) == "Good night"


@pytest.mark.parametrize("fmt", ["json", "parquet"])
def test_json_and_parquet_sources_with_text_column(tmp_path, fmt):
    docs = make_lines(300)
    path = tmp_path / f"docs.{fmt}"
    if fmt == "json":
        path.write_text("".join(json.dumps({"body": doc, "id": i}) + "\n" for i, doc in enumerate(docs)))
    else:
        pq.write_table(pa.table({"body": docs, "id": list(range(len(docs)))}), path)
    dm = ready(make_dm(tmp_path, str(path), path=fmt, text_column="body"))
    text = "".join(docs)
    assert stream(dm, "train") + stream(dm, "val") == text


def test_glob_and_per_split_mapping(tmp_path):
    parts = ["".join(make_lines(100, seed)) for seed in range(3)]
    for i, part in enumerate(parts):
        (tmp_path / f"train{i}.txt").write_text(part)
    (tmp_path / "valid.txt").write_text("".join(make_lines(50, seed=9)))

    glob = ready(make_dm(tmp_path, str(tmp_path / "train*.txt")))
    assert stream(glob, "train") + stream(glob, "val") == "".join(parts)

    mapping = {"train": [str(tmp_path / f"train{i}.txt") for i in (0, 1)], "dev": str(tmp_path / "valid.txt")}
    dm = ready(make_dm(tmp_path, mapping, val_split="dev"))
    assert stream(dm, "train") == parts[0] + parts[1]  # a validation split: no cut
    assert stream(dm, "val") == (tmp_path / "valid.txt").read_text()


def test_validation_and_test_splits_used_when_present(tmp_path):
    files = {}
    for seed, split in enumerate(["train", "validation", "test"]):
        files[split] = str(tmp_path / f"{split}.txt")
        (tmp_path / f"{split}.txt").write_text("".join(make_lines(60, seed)))
    dm = ready(make_dm(tmp_path, files))
    dm.setup("test")
    for split, role in [("train", "train"), ("validation", "val"), ("test", "test")]:
        assert stream(dm, role) == (tmp_path / f"{split}.txt").read_text()
    (loader,) = dm.test_dataloader()
    assert dm.test_set_names == ["test"]
    assert sum(len(batch["input_ids"]) for batch in loader) == len(loader.dataset)


@pytest.mark.parametrize("pattern", ["missing.txt", "*.md"])
def test_missing_file_is_one_clear_error(tmp_path, pattern):
    expected = rf"data_files: no file matches '.*{re.escape(pattern)}' \(split 'train'\)"
    with pytest.raises(FileNotFoundError, match=expected) as info:
        make_dm(tmp_path, str(tmp_path / pattern)).prepare_data()
    assert info.value.__cause__ is None and info.value.__suppress_context__


def test_unknown_split_or_column_is_one_clear_error(tmp_path, text_file):
    with pytest.raises(ValueError, match=r"val_split='valid' is not a split of the source; it has \['train'\]"):
        make_dm(tmp_path, str(text_file), val_split="valid").prepare_data()
    with pytest.raises(ValueError, match=r"train_split='training'"):
        make_dm(tmp_path, str(text_file), train_split="training").prepare_data()
    with pytest.raises(ValueError, match=r"text_column='body' is not a column"):
        make_dm(tmp_path, str(text_file), text_column="body").prepare_data()


def test_bad_arguments(tmp_path, text_file):
    with pytest.raises(ValueError, match="data_files is required"):
        TextDataModule(CharTokenizer(), path="json")
    with pytest.raises(ValueError, match="train_fraction"):
        make_dm(tmp_path, str(text_file), train_fraction=1.0)
    with pytest.raises(ValueError, match="sampling"):
        make_dm(tmp_path, str(text_file), sampling="strided")
    with pytest.raises(ValueError, match="samples_per_epoch"):
        make_dm(tmp_path, str(text_file), sampling="blocks", samples_per_epoch=10)
    with pytest.raises(ValueError, match="block_size"):
        make_dm(tmp_path, str(text_file), block_size=0)
    with pytest.raises(TypeError, match="tokenizer"):
        TextDataModule("char", data_files=str(text_file))
    with pytest.raises(ValueError, match="test_length_multipliers must be >= 1"):
        make_dm(tmp_path, str(text_file), test_length_multipliers=[2, 0])
    with pytest.raises(ValueError, match=r"test_length_multipliers: the test stream has \d+ tokens, too few"):
        ready(make_dm(tmp_path, str(text_file), test_length_multipliers=[1000]))


@pytest.mark.parametrize(
    "content,problem",
    [
        (b"", "is empty"),
        (b"GIF89a\x01\x00\x00\x00" + bytes(range(256)), r"is a binary file, not text \(a NUL byte at offset 7\)"),
        ("Été naïf".encode("latin-1"), r"is not UTF-8 text \(byte 0xc9 at offset 0\); convert it to UTF-8"),
        ("caf\u00e9\n".encode("utf-16"), "is UTF-16 text, not UTF-8; convert it to UTF-8"),
    ],
    ids=["empty", "binary", "latin-1", "utf-16"],
)
def test_unreadable_text_file_is_one_clear_error(tmp_path, content, problem):
    path = tmp_path / "input.txt"
    path.write_bytes(content)
    with pytest.raises(ValueError, match=rf"^data_files: {re.escape(str(path))} {problem}"):
        make_dm(tmp_path, str(path)).prepare_data()


@pytest.mark.parametrize(
    "n_chars,block_size,message",
    [
        (10_000, 100_000, r"its train part has 9000 tokens, and one window of block_size=100000 needs 100001"),
        (100, 16, r"its val part \(the text after train_fraction\) has 10 tokens, and one window of block_size=16 "
                  r"needs 17"),
    ],
)
def test_text_too_short_for_a_window_says_so(tmp_path, n_chars, block_size, message):
    path = tmp_path / "input.txt"
    path.write_text("".join(make_lines(2000))[:n_chars])
    with pytest.raises(ValueError, match=rf"^the text is too short: {message}; use more text or a smaller block_size"):
        ready(make_dm(tmp_path, str(path), block_size=block_size))


def test_char_vocabulary_covers_characters_only_in_the_validation_part(tmp_path):
    path = tmp_path / "input.txt"
    text = "".join(make_lines(200))
    path.write_text(text + "Zyx!" * 20)  # the last 80 characters, all in the validation part
    dm = ready(make_dm(tmp_path, str(path)))
    assert {"Z", "y", "x", "!"} <= set(dm.tokenizer.chars) and dm.vocab_size == len(set(text) | set("Zyx!"))
    assert stream(dm, "val").endswith("Zyx!" * 20)


# Tokenizers

SAMPLE = "First Citizen:\nBefore we proceed any further, hear me speak.\n\tÉté — naïve 😀\n"


@pytest.mark.parametrize("make", [ByteTokenizer, CharTokenizer, lambda: BPETokenizer(vocab_size=300, min_frequency=1)])
def test_tokenizer_roundtrip(make):
    tokenizer = make()
    if isinstance(tokenizer, (CharTokenizer, BPETokenizer)):
        tokenizer.train([SAMPLE[:30], SAMPLE[30:]])
    ids = tokenizer.encode(SAMPLE)
    assert tokenizer.decode(ids) == SAMPLE
    assert all(0 <= i < tokenizer.vocab_size for i in ids)
    assert tokenizer.encode_batch([SAMPLE, "me"]) == [ids, tokenizer.encode("me")]


def test_byte_vocab():
    assert ByteTokenizer().vocab_size == 256
    assert ByteTokenizer().encode("é") == [0xC3, 0xA9]
    assert ByteTokenizer().decode([0xC3]) == "\N{REPLACEMENT CHARACTER}"


def test_char_vocab_is_sorted_training_characters():
    tokenizer = CharTokenizer()
    tokenizer.train(["hello\n", "world"])
    assert tokenizer.chars == "\ndehlorw" and tokenizer.vocab_size == 8
    assert tokenizer.encode("hold") == [3, 5, 4, 1]
    with pytest.raises(ValueError, match="character 'z' is not in the vocabulary"):
        tokenizer.encode("zoo")
    assert CharTokenizer("ab").encode("ba") == [1, 0]
    with pytest.raises(ValueError, match="must not repeat"):
        CharTokenizer("aba")


def test_untrained_tokenizers_say_so():
    for tokenizer in [CharTokenizer(), BPETokenizer()]:
        assert not tokenizer.is_trained
        with pytest.raises(RuntimeError, match="call train"):
            tokenizer.encode("a")
    with pytest.raises(ValueError, match="vocab_size must be at least 256"):
        BPETokenizer(vocab_size=100)


def test_fingerprint_is_stable_and_tracks_the_vocabulary():
    a, b, c = BPETokenizer(300), BPETokenizer(300), BPETokenizer(400)
    assert a.fingerprint == b.fingerprint != c.fingerprint
    a.train([SAMPLE])
    trained = a.fingerprint
    assert trained != b.fingerprint
    a.encode(SAMPLE)  # using it changes nothing
    assert a.fingerprint == trained
    assert CharTokenizer("ab").fingerprint != CharTokenizer("abc").fingerprint


# Caching


def test_bpe_is_trained_on_the_training_text_and_cached(tmp_path, text_file, monkeypatch):
    dm = make_dm(tmp_path, str(text_file), BPETokenizer(vocab_size=300, min_frequency=1))
    ready(dm)
    assert dm.vocab_size == 300
    assert stream(dm, "train") + stream(dm, "val") == text_file.read_text()

    def no_training(self, texts):
        raise AssertionError("trained again")

    monkeypatch.setattr(BPETokenizer, "train", no_training)
    again = make_dm(tmp_path, str(text_file), BPETokenizer(vocab_size=300, min_frequency=1))
    assert again.tokenizer is not dm.tokenizer
    assert again.vocab_size == 300 and again.tokenizer.fingerprint == dm.tokenizer.fingerprint


def test_second_datamodule_reuses_the_tokenized_cache(tmp_path, text_file, monkeypatch):
    first = ready(make_dm(tmp_path, str(text_file)))

    def no_encoding(self, texts):
        raise AssertionError("tokenized again")

    monkeypatch.setattr(CharTokenizer, "encode_batch", no_encoding)
    second = ready(make_dm(tmp_path, str(text_file)))
    assert cache_files(second) == cache_files(first)
    assert torch.equal(second.train_set.tokens, first.train_set.tokens)


def test_new_tokenizer_or_new_file_makes_a_new_cache(tmp_path, text_file):
    first = ready(make_dm(tmp_path, str(text_file)))
    by_bytes = ready(make_dm(tmp_path, str(text_file), ByteTokenizer()))
    assert set(cache_files(by_bytes)).isdisjoint(cache_files(first))

    text_file.write_text("".join(make_lines(400, seed=1)))
    os.utime(text_file, ns=(0, 0))  # a distinct modification time even on a coarse clock
    changed = ready(make_dm(tmp_path, str(text_file)))
    assert set(cache_files(changed)).isdisjoint(cache_files(first))
    assert stream(changed, "train") + stream(changed, "val") == text_file.read_text()


def test_other_process_offline_finds_the_same_caches(tmp_path, text_file):
    """What the next run and the other DDP ranks do: no training, no tokenising, no network."""
    dm = ready(make_dm(tmp_path, str(text_file), BPETokenizer(vocab_size=300, min_frequency=1)))
    script = f"""
from lit_thresh.data.text import TextDataModule
from lit_thresh.data.tokenizers import BPETokenizer
BPETokenizer.train = BPETokenizer.encode_batch = None
dm = TextDataModule(BPETokenizer(vocab_size=300, min_frequency=1), data_files={str(text_file)!r},
                    cache_dir={str(tmp_path / "cache")!r})
files = sorted(f["filename"] for fs in dm._tokenized().cache_files.values() for f in fs)
print(dm.tokenizer.fingerprint, *files)
"""
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "PYTHONHASHSEED": "123"}
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True)
    assert result.stdout.split() == [dm.tokenizer.fingerprint, *sorted(cache_files(dm))]


# Windows and batches


def test_batch_format(tmp_path, text_file):
    dm = ready(make_dm(tmp_path, str(text_file)))
    batch = next(iter(dm.train_dataloader()))
    assert set(batch) == {"input_ids", "labels"}
    assert batch["input_ids"].shape == batch["labels"].shape == (4, 16)
    assert batch["input_ids"].dtype == batch["labels"].dtype == torch.long
    assert torch.equal(batch["input_ids"][:, 1:], batch["labels"][:, :-1])
    for row in batch["input_ids"]:
        assert dm.decode(row.tolist()) in text_file.read_text()


@pytest.mark.parametrize("split", ["train", "val", "test"])
def test_batches_are_the_windows_of_their_indices(tmp_path, text_file, split):
    """The loaders fetch a batch in one gather (TokenWindows.__getitems__): each row is the window that
    __getitem__ gives for the index the sampler drew, in order, and contiguous."""
    dm = ready(make_dm(tmp_path, str(text_file)))
    loader = {"train": dm.train_dataloader, "val": dm.val_dataloader, "test": lambda: dm.test_dataloader()[0]}[split]()
    batch = next(iter(loader))
    indices = next(iter(loader.batch_sampler))
    assert len(indices) == batch["input_ids"].shape[0] > 1
    for key in ("input_ids", "labels"):
        assert batch[key].is_contiguous()
        assert torch.equal(batch[key], torch.stack([loader.dataset[i][key] for i in indices]))


def test_random_and_block_sampling(tmp_path, text_file):
    blocks = ready(make_dm(tmp_path, str(text_file), sampling="blocks")).train_set
    n = len(blocks.tokens)
    assert torch.equal(blocks.starts, torch.arange(0, n - 16, 16))
    predicted = torch.cat([blocks[i]["labels"] for i in range(len(blocks))])
    assert torch.equal(predicted, blocks.tokens[1 : len(predicted) + 1].long())  # each token once, in order

    every = ready(make_dm(tmp_path, str(text_file))).train_set
    assert torch.equal(every.starts, torch.arange(n - 16))

    drawn = ready(make_dm(tmp_path, str(text_file), samples_per_epoch=1000, seed=1)).train_set
    same = ready(make_dm(tmp_path, str(text_file), samples_per_epoch=1000, seed=1)).train_set
    other = ready(make_dm(tmp_path, str(text_file), samples_per_epoch=1000, seed=2)).train_set
    assert len(drawn) == 1000 and drawn.starts.max() <= n - 17
    assert torch.equal(drawn.starts, same.starts) and not torch.equal(drawn.starts, other.starts)


def test_train_order_is_seeded_per_epoch_and_distinct_per_rank(tmp_path, text_file):
    """The training order: a ResumableSampler, a shuffle of (seed, epoch) sharded over DDP ranks."""
    dm = ready(make_dm(tmp_path, str(text_file), samples_per_epoch=512, seed=7))
    loader = dm.train_dataloader()
    assert isinstance(loader.sampler, ResumableSampler) and loader.sampler.seed == 7 and loader.drop_last

    def indices(rank, epoch, seed=7):
        sampler = ResumableSampler(dm.train_set, dm.batch_size, num_replicas=2, rank=rank, seed=seed)
        sampler.set_epoch(epoch)
        return list(sampler)

    rank0, rank1 = indices(0, 0), indices(1, 0)
    assert len(rank0) == len(rank1) == 256
    assert set(rank0).isdisjoint(rank1) and set(rank0) | set(rank1) == set(range(512))
    assert indices(0, 0) == rank0 != indices(0, 1)
    assert indices(0, 0, seed=8) != rank0


class RecordBatches(LightningModule):
    def __init__(self):
        super().__init__()
        self.seen = []

    def validation_step(self, batch, batch_idx):
        self.seen.append(batch["input_ids"])


@pytest.mark.parametrize("val_samples", [None, 40])
def test_val_windows_fixed_and_independent_of_limit_val_batches(tmp_path, text_file, val_samples):
    dm = ready(make_dm(tmp_path, str(text_file), val_samples=val_samples, seed=3))
    loader = dm.val_dataloader()
    assert isinstance(loader.sampler, SequentialSampler)
    everything = torch.cat(list(batch["input_ids"] for batch in loader))
    assert torch.equal(everything, torch.cat([batch["input_ids"] for batch in dm.val_dataloader()]))
    again = ready(make_dm(tmp_path, str(text_file), val_samples=val_samples, seed=3))
    assert torch.equal(everything, torch.cat([batch["input_ids"] for batch in again.val_dataloader()]))
    if val_samples is None:
        assert torch.equal(dm.val_set.starts, block_starts(len(dm.val_set.tokens), 16))
    else:
        assert len(everything) == val_samples

    model = RecordBatches()
    trainer = Trainer(limit_val_batches=2, logger=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.validate(model, datamodule=make_dm(tmp_path, str(text_file), val_samples=val_samples, seed=3))
    assert torch.equal(torch.cat(model.seen), everything[:8])


def test_val_draw_follows_val_seed_not_the_training_seed(tmp_path, text_file):
    """Runs with other training orders (`seed`) are scored on the same drawn windows; `val_seed` redraws them."""
    base = ready(make_dm(tmp_path, str(text_file), val_samples=40, samples_per_epoch=100, seed=1))
    other_order = ready(make_dm(tmp_path, str(text_file), val_samples=40, samples_per_epoch=100, seed=2))
    redrawn = ready(make_dm(tmp_path, str(text_file), val_samples=40, samples_per_epoch=100, seed=1, val_seed=5))
    assert not torch.equal(base.train_set.starts, other_order.train_set.starts)
    assert torch.equal(base.val_set.starts, other_order.val_set.starts)
    assert torch.equal(base.val_set.starts, random_starts(len(base.val_set.tokens), 16, 40, 0))
    assert not torch.equal(base.val_set.starts, redrawn.val_set.starts)
    assert torch.equal(base.train_set.starts, redrawn.train_set.starts)


# Length generalisation


def test_length_test_sets_are_fixed_consecutive_windows(tmp_path, text_file):
    """Without a test split, every test set cuts the validation stream into windows of m x block_size."""
    dm = ready(make_dm(tmp_path, str(text_file), test_length_multipliers=[2, 4, 8]))
    assert dm.test_set_names == ["test", "len32", "len64", "len128"]
    assert dm.train_seq_len == 16 and dm.max_seq_len == 128
    loaders = dm.test_dataloader()
    val = dm.val_set.tokens
    for name, loader, length in zip(dm.test_set_names, loaders, [16, 32, 64, 128], strict=True):
        assert loader.batch_size == max(1, 4 * 16 // length), name  # the same tokens per batch
        assert isinstance(loader.sampler, SequentialSampler)
        windows = torch.cat([batch["input_ids"] for batch in loader])  # (n, length)
        labels = torch.cat([batch["labels"] for batch in loader])
        n = (len(val) - 1) // length
        assert windows.shape == (n, length), name
        assert torch.equal(labels.flatten(), val[1 : n * length + 1].long()), name  # every token once, in order
    again = ready(make_dm(tmp_path, str(text_file), test_length_multipliers=[2, 4, 8], seed=5))
    for loader, other in zip(loaders, again.test_dataloader(), strict=True):
        assert torch.equal(torch.cat([b["input_ids"] for b in loader]), torch.cat([b["input_ids"] for b in other]))


def test_fit_then_test_logs_every_length(tmp_path, text_file):
    dm = make_dm(tmp_path, str(text_file), test_length_multipliers=[2, 4], sampling="blocks")
    config = TransformerConfig(dm.vocab_size, d_model=16, n_layers=1, n_heads=2, max_seq_len=dm.max_seq_len)
    model = LanguageModel(config)
    trainer = Trainer(
        max_steps=2,
        limit_val_batches=1,
        limit_test_batches=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    trainer.fit(model, dm)
    trainer.test(model, dm)
    expected = {f"test{s}/{m}" for s in ("", "/len32", "/len64") for m in ("loss", "acc", "ppl")}
    assert expected <= set(trainer.callback_metrics)
    assert 0 <= trainer.callback_metrics["test/len64/acc"] <= 1
