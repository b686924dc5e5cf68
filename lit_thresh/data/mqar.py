"""Multi-query associative recall (MQAR), as in Zoology (Arora, Eyuboglu et al., 2023).

Token 0 is the filler, keys come from ``[1, V/2)`` and values from ``[V/2, V)``. A sequence starts with
``N`` distinct key-value pairs (key, then value); every key is then queried once, at the even offsets
after the pairs, the gap following Zoology's power law ``p(g) ~ (g + 1)^(power_a - 1)`` (small gaps are
likely). The label at a query is the key's value (the next-token target at that position), -100
elsewhere. With ``random_non_queries`` the fillers are drawn uniformly from the whole vocabulary.
"""

from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor
from torch.nn import functional as F
from torch.utils.data import DataLoader

from lit_thresh.data.batched import TensorRows, batched_loader_options
from lit_thresh.data.resumable import ResumableDataModule, seeded_loader
from lit_thresh.metrics import IGNORE_INDEX

_SPLITS = ("train", "val", "test")


class MQARSetting(NamedTuple):
    """``num_examples`` sequences of ``seq_len`` tokens holding ``num_kv_pairs`` key-value pairs."""

    seq_len: int
    num_kv_pairs: int
    num_examples: int

    @property
    def name(self) -> str:
        return f"len{self.seq_len}_n{self.num_kv_pairs}"


def multiquery_ar(
    num_examples: int,
    seq_len: int,
    num_kv_pairs: int,
    vocab_size: int,
    *,
    power_a: float = 0.01,
    random_non_queries: bool = True,
    generator: torch.Generator | None = None,
) -> tuple[Tensor, Tensor]:
    """Generate MQAR ``(input_ids, labels)``, both ``(num_examples, seq_len)`` int64.

    Worked example (``V = 16``, ``L = 12``, ``N = 2``, no random fillers)::

        position     0    1    2    3    4    5    6    7    8    9   10   11
        role       key  val  key  val  qry                 qry
        input_ids    3    9    4   11    4    0    0    0    3    0    0    0
        labels       .    .    .    .   11    .    .    .    9    .    .    .   (. = -100)

    >>> input_ids, labels = multiquery_ar(1, 12, 2, 16, random_non_queries=False,
    ...                                   generator=torch.Generator().manual_seed(0))
    >>> input_ids
    tensor([[ 3,  9,  4, 11,  4,  0,  0,  0,  3,  0,  0,  0]])
    >>> labels
    tensor([[-100, -100, -100, -100,   11, -100, -100, -100,    9, -100, -100, -100]])
    """
    _check_setting(num_examples, seq_len, num_kv_pairs, vocab_size, power_a)

    half = vocab_size // 2
    keys = 1 + _sample_without_replacement(num_examples, num_kv_pairs, half - 1, generator)  # (B, N)
    values = half + _sample_without_replacement(num_examples, num_kv_pairs, vocab_size - half, generator)

    context = 2 * num_kv_pairs
    space = (seq_len - context) // 2  # query slots: even offsets after the pairs
    gap_weights = torch.arange(1, space + 1, dtype=torch.float64) ** (power_a - 1)  # (space,)
    gaps = torch.multinomial(gap_weights.expand(num_examples, space), num_kv_pairs, generator=generator)
    query_positions = context + 2 * gaps  # (B, N), key j is queried at query_positions[:, j]

    input_ids = torch.zeros(num_examples, seq_len, dtype=torch.long)  # (B, L)
    input_ids[:, 0:context:2] = keys
    input_ids[:, 1:context:2] = values
    input_ids.scatter_(1, query_positions, keys)
    labels = torch.full_like(input_ids, IGNORE_INDEX).scatter_(1, query_positions, values)  # (B, L)
    if random_non_queries:
        fillers = input_ids == 0
        input_ids[fillers] = torch.randint(vocab_size, (int(fillers.sum()),), generator=generator)
    return input_ids, labels


def _check_setting(num_examples: int, seq_len: int, num_kv_pairs: int, vocab_size: int, power_a: float) -> None:
    """Raises ValueError naming the argument that makes MQAR impossible."""
    for name, value in (("num_examples", num_examples), ("num_kv_pairs", num_kv_pairs)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    if seq_len < 4 * num_kv_pairs:
        raise ValueError(f"seq_len must be >= 4 * num_kv_pairs = {4 * num_kv_pairs}, got {seq_len}")
    if num_kv_pairs >= vocab_size // 2:
        raise ValueError(f"vocab_size={vocab_size} holds fewer than num_kv_pairs={num_kv_pairs} keys")
    if power_a <= 0:
        raise ValueError(f"power_a must be > 0, got {power_a}")


def _sample_without_replacement(rows: int, k: int, n: int, generator: torch.Generator | None) -> Tensor:
    """``(rows, k)`` integers from ``[0, n)``, distinct within a row, in random order.

    Robert Floyd's algorithm, vectorised over rows: ``k`` steps, no ``(rows, n)`` buffer.
    """
    samples = torch.empty(rows, k, dtype=torch.long)
    for i, j in enumerate(range(n - k, n)):
        draw = torch.randint(j + 1, (rows,), generator=generator)  # (rows,)
        taken = (samples[:, :i] == draw[:, None]).any(dim=1)
        samples[:, i] = torch.where(taken, j, draw)
    order = torch.rand(rows, k, generator=generator).argsort(dim=1)  # Floyd: uniform set, not order
    return samples.gather(1, order)


class MQARDataModule(ResumableDataModule):
    """MQAR train/val/test sets, generated in memory from ``seed``.

    ``train`` and ``val`` are mixtures of settings (right-padded with filler 0 / label -100 to their
    longest sequence). Test sets: ``all`` (the ``val`` settings, fresh examples; logged as ``test/acc``),
    then for every ``val`` setting (L, N) and multiplier m in ``test_length_multipliers`` a length test
    set of m·L tokens with the same N pairs and one with m·N pairs (the latter where the vocabulary holds
    m·N keys), logged as ``test/len{m·L}_n{N}/acc`` and ``test/len{m·L}_n{m·N}/acc``. Length test sets
    hold ``test_examples`` sequences each and are batched by ``batch_size // m`` (the same tokens per
    batch). Train, val and test are drawn from disjoint generator seeds; every DDP rank generates the
    same sets. The training order is a function of ``seed`` and the epoch, sharded over DDP ranks and
    resumed mid-epoch from checkpoints (``ResumableDataModule``); Lightning's DistributedSampler shards
    val and test.
    """

    def __init__(
        self,
        vocab_size: int = 8192,
        train: Sequence[MQARSetting] = (MQARSetting(seq_len=256, num_kv_pairs=16, num_examples=100_000),),
        val: Sequence[MQARSetting] = (MQARSetting(seq_len=256, num_kv_pairs=16, num_examples=3_000),),
        test_length_multipliers: Sequence[int] = (2, 4, 8),
        test_examples: int | None = None,
        power_a: float = 0.01,
        random_non_queries: bool = True,
        batch_size: int = 256,
        num_workers: int = 0,
        seed: int = 0,
    ) -> None:
        """
        Args:
            vocab_size: tokens; keys are ``[1, V/2)``, values ``[V/2, V)``.
            train: settings mixed into the training set.
            val: settings mixed into the validation set (and the primary test set).
            test_length_multipliers: length test sets at these multiples of each ``val`` length.
            test_examples: sequences per length test set; default: as many as the ``val`` setting.
            power_a: Zoology's power-law exponent for the query gaps (1.0 = uniform).
            random_non_queries: fill the non-pair, non-query slots with random tokens instead of 0.
            batch_size: examples per batch (per device under DDP).
            num_workers: DataLoader worker processes.
            seed: seed of the sets and of the training order, independent of ``seed_everything``.
        """
        super().__init__()
        if not train or not val:
            raise ValueError("train and val must each hold at least one MQARSetting")
        if any(m < 1 for m in test_length_multipliers):
            raise ValueError(f"test_length_multipliers must be >= 1, got {list(test_length_multipliers)}")
        if test_examples is not None and test_examples < 1:
            raise ValueError(f"test_examples must be >= 1 or None, got {test_examples}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.save_hyperparameters()
        self.train_settings = tuple(MQARSetting(*s) for s in train)
        self.val_settings = tuple(MQARSetting(*s) for s in val)
        self.test_settings = {"all": self.val_settings}
        self.test_batch_sizes = {"all": batch_size}
        for m in test_length_multipliers:
            for s in self.val_settings:
                for pairs in dict.fromkeys((s.num_kv_pairs, s.num_kv_pairs * m)):
                    scaled = MQARSetting(s.seq_len * m, pairs, test_examples or s.num_examples)
                    fits = pairs < vocab_size // 2  # keys are [1, V/2); m·L >= 4·m·N holds as L >= 4·N
                    if fits and scaled.name not in self.test_settings:
                        self.test_settings[scaled.name] = (scaled,)
                        self.test_batch_sizes[scaled.name] = max(1, batch_size // m)
        for s in (*self.train_settings, *self.val_settings):
            _check_setting(s.num_examples, s.seq_len, s.num_kv_pairs, vocab_size, power_a)
        self.datasets: dict[str, TensorRows] = {}

    @property
    def vocab_size(self) -> int:
        return self.hparams.vocab_size

    def order_settings(self) -> dict[str, int]:
        return {"seed": self.hparams.seed, "batch_size": self.hparams.batch_size}

    @property
    def train_seq_len(self) -> int:
        """Longest training sequence: the positions the model learns."""
        return max(s.seq_len for s in self.train_settings)

    @property
    def max_seq_len(self) -> int:
        """Longest sequence fed to the model, length test sets included."""
        settings = (*self.train_settings, *(s for group in self.test_settings.values() for s in group))
        return max(s.seq_len for s in settings)

    @property
    def test_set_names(self) -> list[str]:
        return list(self.test_settings)

    def setup(self, stage: str) -> None:
        if stage == "fit":
            self.datasets["train"] = self._generate(self.train_settings, self._generator("train"))
        if stage in ("fit", "validate"):
            self.datasets["val"] = self._generate(self.val_settings, self._generator("val"))
        if stage in ("test", "predict"):
            generator = self._generator("test")
            for name, settings in self.test_settings.items():
                self.datasets[f"test/{name}"] = self._generate(settings, generator)

    def train_dataloader(self) -> DataLoader:
        options = batched_loader_options(self.hparams.num_workers)
        # whole batches only: a compiled model then sees one shape (a last, shorter batch would recompile it)
        train, batch_size = self.datasets["train"], self.hparams.batch_size
        return self.resumable_loader(train, batch_size, self.hparams.seed, drop_last=True, **options)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.datasets["val"])

    def test_dataloader(self) -> list[DataLoader]:
        return [
            self._loader(self.datasets[f"test/{name}"], batch_size=self.test_batch_sizes[name])
            for name in self.test_set_names
        ]

    def predict_dataloader(self) -> DataLoader:
        return self._loader(self.datasets["test/all"])

    def _generator(self, split: str) -> torch.Generator:
        """The split's own generator: seeds 3 * seed + {0, 1, 2} never coincide across splits."""
        return torch.Generator().manual_seed(len(_SPLITS) * self.hparams.seed + _SPLITS.index(split))

    def _generate(self, settings: Sequence[MQARSetting], generator: torch.Generator) -> TensorRows:
        """The settings' sequences, right-padded to the longest and concatenated."""
        seq_len = max(s.seq_len for s in settings)
        input_ids, labels = [], []
        for s in settings:
            x, y = multiquery_ar(
                s.num_examples,
                s.seq_len,
                s.num_kv_pairs,
                self.vocab_size,
                power_a=self.hparams.power_a,
                random_non_queries=self.hparams.random_non_queries,
                generator=generator,
            )
            input_ids.append(F.pad(x, (0, seq_len - s.seq_len), value=0))
            labels.append(F.pad(y, (0, seq_len - s.seq_len), value=IGNORE_INDEX))
        return TensorRows(input_ids=torch.cat(input_ids), labels=torch.cat(labels))

    def _loader(self, dataset: TensorRows, batch_size: int | None = None) -> DataLoader:
        options = batched_loader_options(self.hparams.num_workers)
        return seeded_loader(dataset, batch_size or self.hparams.batch_size, self.hparams.seed, **options)
