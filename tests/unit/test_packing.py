"""``forge.packing``: a payload's fields declare what they are, and ``Packed`` builds, joins,
slices, splits and checks it from those declarations alone."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from forge.actors.trainer import _check_batch
from forge.packing import Groups, Packed, per_item, per_token, shared
from forge.types import EpisodeBatch, SFTBatch


@dataclass
class _Rows(Packed):
    names: list[str] = per_item()
    lens: torch.Tensor = per_item(torch.long)
    tokens: torch.Tensor = per_token("lens", torch.long)
    weights: torch.Tensor = per_item(torch.float32)
    version: int = shared()
    mask: torch.Tensor | None = per_token("lens", torch.bool, fill=True)
    reasons: list[str] | None = per_item(fill="stop")


def _rows(names: str, pieces: list[list[int]], version: int = 3, masks=None, reasons=None) -> _Rows:
    return _Rows.build(
        names=list(names),
        tokens=[torch.tensor(p) for p in pieces],
        weights=[float(len(p)) for p in pieces],
        version=version,
        mask=masks,
        reasons=reasons,
    )


def test_build_derives_the_lengths_and_lays_pieces_end_to_end():
    rows = _rows("ab", [[1, 2, 3], [4]])
    assert len(rows) == 2 and rows.lens.tolist() == [3, 1] and rows.tokens.tolist() == [1, 2, 3, 4]
    assert rows.weights.dtype == torch.float32 and rows.mask is None and rows.reasons is None
    assert [p.tolist() for p in rows.pieces("tokens")] == [[1, 2, 3], [4]]


def test_rows_slice_every_field_by_item_and_per_token_fields_by_their_lengths():
    rows = _rows(
        "abc", [[1, 2], [3, 4, 5], [6]], masks=[None, torch.tensor([0, 1, 0]), None], reasons=["length", None, "stop"]
    )
    middle = rows.rows(1, 3)
    assert middle.names == ["b", "c"] and middle.lens.tolist() == [3, 1]
    assert middle.tokens.tolist() == [3, 4, 5, 6] and middle.weights.tolist() == [3.0, 1.0]
    assert middle.mask.tolist() == [False, True, False, True] and middle.reasons == ["stop", "stop"]
    assert middle.version == 3
    assert [len(c) for c in rows.chunks(2)] == [2, 1]


def test_concat_fills_an_optional_field_that_only_some_batches_have_and_split_undoes_it():
    plain = _rows("a", [[1, 2]])
    masked = _rows("b", [[3]], masks=[torch.tensor([False])], reasons=["length"])
    joined = _Rows.concat([plain, masked])
    assert joined.mask.tolist() == [True, True, False] and joined.reasons == ["stop", "length"]
    first, second = joined.split([1, 1])
    assert first.tokens.tolist() == [1, 2] and second.tokens.tolist() == [3] and second.mask.tolist() == [False]
    with pytest.raises(ValueError, match=r"split sizes \[2, 1\] must be positive and add up to the _Rows's 2 items"):
        joined.split([2, 1])


def test_concat_refuses_batches_whose_shared_fields_differ():
    with pytest.raises(ValueError, match="the batches' version differ"):
        _Rows.concat([_rows("a", [[1]], version=1), _rows("b", [[2]], version=2)])


def test_check_names_the_field_that_does_not_fit_the_items_or_tokens():
    rows = _rows("ab", [[1, 2], [3]])
    rows.check()
    rows.tokens = torch.tensor([1, 2])
    with pytest.raises(ValueError, match=r"_Rows.tokens has 2 entries, expected 3: its tokens \(the sum of lens\)"):
        rows.check()
    rows = _rows("ab", [[1, 2], [3]])
    rows.weights = torch.ones(3)
    with pytest.raises(ValueError, match=r"_Rows.weights has 3 entries, expected 2: its items"):
        rows.check()


def test_groups_send_many_payloads_as_one_and_give_each_back():
    parts = [_rows("a", [[1]]), _rows("bc", [[2, 3], [4]])]
    groups = Groups.pack(parts)
    assert groups.sizes == [1, 2] and groups.batch.tokens.tolist() == [1, 2, 3, 4]
    back = groups.unpack()
    assert [r.names for r in back] == [["a"], ["b", "c"]] and back[1].tokens.tolist() == [2, 3, 4]


def test_a_trainer_step_refuses_a_batch_of_another_type_or_one_whose_fields_disagree():
    """train_step takes one type: a list of episodes is a TypeError naming how to pack it."""
    with pytest.raises(
        TypeError, match=r"Trainer.train_step takes one EpisodeBatch \(EpisodeBatch.pack\(episodes\)\), got list"
    ):
        _check_batch([], EpisodeBatch, "train_step", "EpisodeBatch.pack(episodes)")
    with pytest.raises(ValueError, match="SFTBatch.pack needs at least one example"):
        SFTBatch.pack([])
    batch = SFTBatch.build(prompt_ids=[torch.tensor([1, 2])], answer_ids=[torch.tensor([3])])
    batch.answer_lens = torch.tensor([2])
    with pytest.raises(ValueError, match=r"SFTBatch.answer_ids has 1 entries, expected 2"):
        _check_batch(batch, SFTBatch, "sft_step", "SFTBatch.pack(examples)")
