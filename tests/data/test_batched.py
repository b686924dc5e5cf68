"""lit_thresh.data.batched: whole-batch gathers equal per-item fetching, in DataLoaders too."""

import pytest
import torch
from torch.utils.data import DataLoader

from lit_thresh.data.batched import TensorRows, collate_batch


def test_batches_equal_the_stacked_items():
    gen = torch.Generator().manual_seed(0)
    rows = TensorRows(input_ids=torch.randint(100, (37, 5), generator=gen), labels=torch.randn(37, 5, 2, generator=gen))
    order = torch.randperm(37, generator=gen).tolist()
    loader = DataLoader(rows, batch_size=8, sampler=order, collate_fn=collate_batch)
    batches = list(loader)
    assert len(batches) == 5 and len(rows) == 37
    for batch, start in zip(batches, range(0, 37, 8), strict=True):
        assert batch.keys() == {"input_ids", "labels"}
        for name in batch:
            assert torch.equal(batch[name], torch.stack([rows[i][name] for i in order[start : start + 8]]))
    assert torch.equal(rows[2:4]["labels"], rows.tensors["labels"][2:4])  # slices, as tests read whole sets


@pytest.mark.parametrize("tensors", [{}, {"a": torch.zeros(3), "b": torch.zeros(4)}])
def test_tensors_of_one_length_are_required(tensors):
    with pytest.raises(ValueError, match="tensors of one length"):
        TensorRows(**tensors)
