"""config.yaml under DDP: whether a fit's run directory holds a run already is decided once, by the
launching process before the ranks start (check_run_dir), and SaveConfigOnce.setup makes the same
collective calls on every rank, so that no rank raises while another waits for it."""

from types import SimpleNamespace

import pytest
from jsonargparse import Namespace

from lit_thresh.callbacks.run_config import FIT_CONFIG, SaveConfigOnce, check_run_dir


class Ranks:
    """Two ranks' broadcasts, with the ranks run one after the other: rank 0's are recorded, and rank 1's
    get them in order; a broadcast of rank 1 that rank 0 never made would wait forever under DDP."""

    def __init__(self) -> None:
        self.sent: list[object] = []
        self.received = 0
        self.unanswered = 0  # rank 1's broadcasts that rank 0 never made

    def broadcast(self, rank: int):
        def broadcast(obj: object, src: int = 0) -> object:
            if rank == 0:
                self.sent.append(obj)
                return obj
            if self.received == len(self.sent):
                self.unanswered += 1
                raise TimeoutError("rank 1 waits for a broadcast of rank 0")
            self.received += 1
            return self.sent[self.received - 1]

        return broadcast


def setup_on_two_ranks(log_dir: str, ckpt_path: str | None, checked: bool) -> tuple[Ranks, list[Exception | None]]:
    """SaveConfigOnce.setup of a fit on rank 0, then on rank 1, after check_run_dir in the launching process
    (rank 0) when `checked` (the lit_thresh command's fit; not so a Trainer driven after run=False);
    returns the broadcasts and what each rank raised."""
    ranks, raised = Ranks(), []
    for rank in (0, 1):
        callback = SaveConfigOnce(None, Namespace(ckpt_path=ckpt_path))
        strategy = SimpleNamespace(broadcast=ranks.broadcast(rank))
        trainer = SimpleNamespace(log_dir=log_dir, is_global_zero=rank == 0, strategy=strategy, callbacks=[callback])
        if checked and rank == 0:
            check_run_dir(trainer, ckpt_path)
        try:
            callback.setup(trainer, None, "fit")
            raised.append(None)
        except Exception as err:  # noqa: BLE001  (compared across the ranks)
            raised.append(err)
    return ranks, raised


def test_a_fit_not_checked_before_it_starts_fails_on_every_rank(tmp_path):
    """A Trainer driven directly (build_cli(run=False)) into a directory holding a run: every rank raises."""
    (tmp_path / FIT_CONFIG).write_text("seed_everything: 1\n")
    ranks, raised = setup_on_two_ranks(str(tmp_path), None, checked=False)
    assert ranks.unanswered == 0 and ranks.received == len(ranks.sent)
    assert [type(err) for err in raised] == [RuntimeError, RuntimeError]
    assert all(f"{tmp_path / FIT_CONFIG} to NOT exist" in str(err) for err in raised)


def test_a_resume_keeps_the_config_on_every_rank(tmp_path):
    (tmp_path / FIT_CONFIG).write_text("seed_everything: 1\n")
    ranks, raised = setup_on_two_ranks(str(tmp_path), "last.ckpt", checked=True)
    assert raised == [None, None] and ranks.unanswered == 0 and ranks.received == len(ranks.sent)
    assert (tmp_path / FIT_CONFIG).read_text() == "seed_everything: 1\n"


def test_a_new_fit_over_a_run_is_refused_before_the_ranks_start(tmp_path):
    (tmp_path / FIT_CONFIG).write_text("seed_everything: 1\n")
    trainer = SimpleNamespace(log_dir=str(tmp_path), callbacks=[])
    with pytest.raises(ValueError, match="already holds a run"):
        check_run_dir(trainer, None)
