"""``latest`` / ``best`` / N step selectors on real committed step directories (no Ray)."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
from torch.distributed.checkpoint.metadata import Metadata

from raytrain_ckpt.checkpoint.errors import ConversionError
from raytrain_ckpt.checkpoint.format.manifest import Manifest, describe_file
from raytrain_ckpt.checkpoint.storage.layout import CheckpointLayout
from raytrain_ckpt.checkpoint.interchange.steps import select_step
from raytrain_ckpt.checkpoint.policy.selection import parse_selector

METADATA = pickle.dumps(Metadata(state_dict_metadata={}))
MIN_EVAL = {"metric": "eval_loss", "mode": "min", "k": 1}
MAX_LOSS = {"metric": "loss", "mode": "max", "k": 1}


def _commit(root: Path, step: int, **values) -> Path:
    layout = CheckpointLayout(root)
    tmp = layout.new_tmp_dir(step)
    files = {}
    for name, data in (("__0_0.distcp", b"x" * 1000), (".metadata", METADATA)):
        (tmp / name).write_bytes(data)
        files[name] = describe_file(tmp / name)
    return layout.commit(tmp, Manifest(step=step, world_size=1, dp_size=1, spec_hash="h", files=files, **values))


def _root(tmp_path: Path, rows: dict[int, dict]) -> Path:
    for step, values in rows.items():
        _commit(tmp_path, step, **values)
    return tmp_path


# (manifest values per step, selector, expected step, words in the reason)
TABLE = [
    ({10: {"eval_loss": 2.0}, 20: {"eval_loss": 1.5}, 30: {"eval_loss": 1.7}}, "best", 20, "eval_loss (min)"),
    ({10: {"eval_loss": 2.0}, 20: {"eval_loss": 1.5}, 30: {}}, "latest", 30, "newest"),
    ({10: {"eval_loss": 2.0}, 20: {"eval_loss": 1.5}}, "10", 10, "step 10"),
    # the policy the job recorded decides: max of the training loss
    ({10: {"loss": 3.0, "eval_loss": 9.0, "keep_best": MAX_LOSS}, 20: {"loss": 4.0, "eval_loss": 1.0,
                                                                        "keep_best": MAX_LOSS}}, "best", 20, "loss (max)"),
    ({10: {"loss": 3.0, "keep_best": MAX_LOSS}, 20: {"loss": 1.0, "keep_best": MAX_LOSS}}, "best", 10, "loss (max)"),
    # the newest manifest's record is the job's current setting
    ({10: {"loss": 3.0, "eval_loss": 1.0, "keep_best": MAX_LOSS},
      20: {"loss": 1.0, "eval_loss": 2.0, "keep_best": MIN_EVAL}}, "best", 10, "eval_loss (min)"),
    ({10: {"eval_loss": 1.0}, 20: {"eval_loss": 1.0}}, "best", 10, "eval_loss"),  # tie: the older
]


@pytest.mark.parametrize("rows,selector,step,words", TABLE)
def test_selector_picks(tmp_path, rows, selector, step, words):
    chosen = select_step(_root(tmp_path, rows), parse_selector(selector), "checksum")
    assert chosen.manifest.step == step and chosen.step_dir.name == f"step-{step:08d}"
    assert words in chosen.reason


def test_best_without_a_recorded_policy_says_it_uses_eval_loss(tmp_path):
    chosen = select_step(_root(tmp_path, {10: {"eval_loss": 2.0}, 20: {"eval_loss": 1.0}}), "best", "size")
    assert chosen.manifest.step == 20
    assert "recorded no checkpoint.keep_best, so eval_loss (min) is used" in chosen.reason
    with_policy = select_step(_root(tmp_path / "b", {10: {"eval_loss": 2.0, "keep_best": MIN_EVAL}}), "best", "size")
    assert "recorded no" not in with_policy.reason


def test_a_damaged_best_step_yields_the_next_best(tmp_path):
    root = _root(tmp_path, {10: {"eval_loss": 2.0}, 20: {"eval_loss": 1.0}, 30: {"eval_loss": 1.5}})
    data = bytearray((root / "step-00000020" / "__0_0.distcp").read_bytes())
    data[100] ^= 0xFF  # same size: only a checksum finds it
    (root / "step-00000020" / "__0_0.distcp").write_bytes(bytes(data))
    assert select_step(root, "best", "checksum").manifest.step == 30


@pytest.mark.parametrize("rows,selector,message", [
    ({10: {}, 20: {"loss": 1.0}}, "best", "no valid committed step records eval_loss"),
    ({10: {"keep_best": MAX_LOSS}}, "best", "no valid committed step records loss"),
    ({10: {}}, "20", "step 20 is not a valid committed step; committed steps whose sizes check: [10]"),
    ({}, "latest", "no valid committed step-N directory"),
])
def test_selector_errors(tmp_path, rows, selector, message):
    with pytest.raises(ConversionError, match=message.replace("[", r"\[").replace("]", r"\]")):
        select_step(_root(tmp_path, rows), parse_selector(selector), "size")


def test_unknown_selector():
    with pytest.raises(ConversionError, match="step selector 'newest': use latest, best or a step number"):
        parse_selector("newest")


def test_a_damaged_step_asked_for_by_number_names_its_damage(tmp_path):
    root = _root(tmp_path, {10: {}, 20: {}})
    data = bytearray((root / "step-00000020" / "__0_0.distcp").read_bytes())
    data[100] ^= 0xFF  # same size: only a checksum finds it
    (root / "step-00000020" / "__0_0.distcp").write_bytes(bytes(data))
    with pytest.raises(ConversionError, match=r"step 20 does not verify \(.*__0_0.distcp fails its CRC-32C check "
                                              r"\(corrupt\)\); export another step or latest"):
        select_step(root, 20, "checksum")
