import doctest
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lit_thresh.data import mqar
from lit_thresh.data.mqar import IGNORE_INDEX, MQARDataModule, MQARSetting, multiquery_ar


def generate(num_examples=64, seq_len=64, num_kv_pairs=8, vocab_size=128, seed=0, **kwargs):
    return multiquery_ar(
        num_examples, seq_len, num_kv_pairs, vocab_size, generator=torch.Generator().manual_seed(seed), **kwargs
    )


def test_docstring_worked_example():
    assert doctest.testmod(mqar, raise_on_error=True).attempted >= 3


@settings(max_examples=40, deadline=None)
@given(
    num_kv_pairs=st.integers(1, 8),
    extra=st.integers(0, 40),
    vocab_size=st.integers(20, 200),
    power_a=st.sampled_from([0.01, 0.5, 1.0]),
    random_non_queries=st.booleans(),
    seed=st.integers(0, 2**31),
)
def test_invariants(num_kv_pairs, extra, vocab_size, power_a, random_non_queries, seed):
    n, seq_len = num_kv_pairs, 4 * num_kv_pairs + extra
    input_ids, labels = generate(
        16, seq_len, n, vocab_size, seed, power_a=power_a, random_non_queries=random_non_queries
    )
    assert input_ids.shape == labels.shape == (16, seq_len)
    assert input_ids.dtype == labels.dtype == torch.long
    assert input_ids.min() >= 0 and input_ids.max() < vocab_size
    keys, values = input_ids[:, 0 : 2 * n : 2], input_ids[:, 1 : 2 * n : 2]  # (B, N)
    half = vocab_size // 2
    assert ((keys >= 1) & (keys < half)).all() and ((values >= half) & (values < vocab_size)).all()
    assert (keys.sort(dim=1).values.diff(dim=1) > 0).all(), "keys repeat within a sequence"
    for row in range(16):
        (positions,) = (labels[row] != IGNORE_INDEX).nonzero(as_tuple=True)
        assert len(positions) == n
        assert (positions >= 2 * n).all() and (positions % 2 == 0).all()
        queried = input_ids[row, positions]
        assert sorted(queried.tolist()) == sorted(keys[row].tolist()), "every key is queried once"
        answer = dict(zip(keys[row].tolist(), values[row].tolist()))
        assert labels[row, positions].tolist() == [answer[k] for k in queried.tolist()]
    fillers = input_ids[:, 2 * n :][labels[:, 2 * n :] == IGNORE_INDEX]
    assert random_non_queries or (fillers == 0).all()


def test_seeded_and_deterministic():
    a, b, c = generate(seed=1), generate(seed=1), generate(seed=2)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert not torch.equal(a[0], c[0])


def test_power_law_puts_queries_near_the_pairs():
    near = (generate(2000, 256, 8, power_a=0.01)[1] != IGNORE_INDEX).nonzero()[:, 1].float().mean()
    uniform = (generate(2000, 256, 8, power_a=1.0)[1] != IGNORE_INDEX).nonzero()[:, 1].float().mean()
    assert near < uniform - 30


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"seq_len": 31, "num_kv_pairs": 8}, "seq_len"),
        ({"num_kv_pairs": 0}, "num_kv_pairs"),
        ({"vocab_size": 16}, "vocab_size"),
        ({"num_examples": 0}, "num_examples"),
        ({"power_a": 0.0}, "power_a"),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        generate(**kwargs)


def test_zoology_scale_generates_in_seconds():
    start = time.perf_counter()
    input_ids, _ = generate(100_000, 256, 16, 8192)
    assert input_ids.shape == (100_000, 256)
    assert time.perf_counter() - start < 15


def make_datamodule(**kwargs):
    defaults = dict(
        vocab_size=64,
        train=[MQARSetting(32, 4, 96), MQARSetting(64, 8, 32)],
        val=[MQARSetting(32, 4, 40)],
        test_length_multipliers=[2, 4],
        batch_size=16,
    )
    return MQARDataModule(**defaults | kwargs)


def test_datamodule_splits_and_batches():
    dm = make_datamodule()
    assert dm.vocab_size == 64
    assert dm.train_seq_len == 64 and dm.max_seq_len == 128  # the 4x test sets
    assert dm.test_set_names == ["all", "len64_n4", "len64_n8", "len128_n4", "len128_n16"]
    dm.setup("fit")
    batch = next(iter(dm.train_dataloader()))
    assert set(batch) == {"input_ids", "labels"} and batch["input_ids"].shape == (16, 64)
    train, val = dm.datasets["train"][:]["input_ids"], dm.datasets["val"][:]["input_ids"]
    assert train.shape == (128, 64) and val.shape == (40, 32)
    # the mixture: 96 sequences of 32 tokens right-padded to 64, then 32 of 64 tokens
    labels = dm.datasets["train"][:]["labels"]
    assert (labels[:96, 32:] == IGNORE_INDEX).all() and (train[:96, 32:] == 0).all()
    assert ((labels[:96] != IGNORE_INDEX).sum(1) == 4).all() and ((labels[96:] != IGNORE_INDEX).sum(1) == 8).all()
    assert not {tuple(r) for r in val.tolist()} & {tuple(r[:32]) for r in train[:96].tolist()}

    dm.setup("test")
    loaders = dm.test_dataloader()
    assert [len(loader.dataset) for loader in loaders] == [40] * 5
    assert [loader.dataset[0]["input_ids"].shape[0] for loader in loaders] == [32, 64, 64, 128, 128]
    assert not torch.equal(dm.datasets["test/all"][:]["input_ids"], val), "test and val share a seed"


def test_training_batches_are_whole():
    """128 examples in batches of 48: two whole batches an epoch, the last 32 (a different 32 each epoch)
    left out, so that a compiled model sees one batch shape."""
    dm = make_datamodule(batch_size=48)
    dm.setup("fit")
    loader = dm.train_dataloader()
    assert len(loader) == 2
    every = {tuple(row) for row in dm.datasets["train"][:]["input_ids"].tolist()}
    left_out = []
    for epoch in range(2):
        loader.sampler.set_epoch(epoch)
        batches = list(loader)
        assert [b["input_ids"].shape[0] for b in batches] == [48, 48]
        seen = {tuple(row) for b in batches for row in b["input_ids"].tolist()}
        assert len(seen) == 96 and seen <= every
        left_out.append(every - seen)
    assert left_out[0] != left_out[1]


def test_batch_larger_than_the_training_set():
    dm = make_datamodule(batch_size=129)
    dm.setup("fit")
    with pytest.raises(ValueError, match=r"batch_size 129 is larger than the training set \(128 examples\)"):
        dm.train_dataloader()


@pytest.mark.parametrize("vocab_size", [32, 200])
def test_length_test_sets_scale_the_length_and_the_pairs(vocab_size):
    """m x L with the same N pairs and with m x N pairs, where the vocabulary holds m x N keys."""
    val = [MQARSetting(40, 5, 30), MQARSetting(24, 3, 30)]
    dm = make_datamodule(vocab_size=vocab_size, val=val, test_length_multipliers=[2, 4, 8], test_examples=12)
    expected = {"all": (40, None, 60, 16)}  # name -> (length, pairs per row, examples, batch); `all` = val
    for m in (2, 4, 8):
        for s in val:
            for pairs in (s.num_kv_pairs, m * s.num_kv_pairs):
                if pairs < vocab_size // 2:
                    expected[f"len{m * s.seq_len}_n{pairs}"] = (m * s.seq_len, pairs, 12, 16 // m)
    if vocab_size == 32:  # 16 keys: 8 x 3 and 4 x 5 pairs and more do not fit
        assert "len192_n24" not in expected and "len160_n20" not in expected and "len320_n5" in expected
    assert dm.test_set_names == list(expected)
    assert dm.max_seq_len == 320 and dm.train_seq_len == 64
    dm.setup("test")
    for name, loader in zip(dm.test_set_names, dm.test_dataloader(), strict=True):
        length, pairs, examples, batch_size = expected[name]
        data = loader.dataset[:]
        assert data["input_ids"].shape == (examples, length), name
        supervised = (data["labels"] != IGNORE_INDEX).sum(dim=1)  # (examples,)
        assert pairs is None or (supervised == pairs).all(), name
        assert data["input_ids"].max() < vocab_size
        assert loader.batch_size == batch_size, name  # the same tokens per batch


def test_datamodule_is_deterministic_per_seed():
    def train_ids(seed):
        dm = make_datamodule(seed=seed)
        dm.setup("fit")
        return dm.datasets["train"][:]["input_ids"]

    assert torch.equal(train_ids(0), train_ids(0))
    assert not torch.equal(train_ids(0), train_ids(1))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"train": []}, "train"),
        ({"val": [MQARSetting(seq_len=16, num_kv_pairs=8, num_examples=4)]}, "seq_len"),
        ({"vocab_size": 8}, "vocab_size"),
        ({"test_length_multipliers": [0]}, "test_length_multipliers"),
        ({"test_examples": 0}, "test_examples"),
        ({"batch_size": 0}, "batch_size"),
    ],
)
def test_datamodule_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        make_datamodule(**kwargs)
