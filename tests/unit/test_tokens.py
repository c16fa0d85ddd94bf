"""Pre-tokenized, memory-mapped corpora and user datasets as index-addressed samples."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from raytrain_ckpt.data import (
    META_FILE,
    CorpusWindows,
    DatasetWindows,
    FeistelPermutation,
    ShuffledWindows,
    TokenCorpus,
    build_data,
    local_micro_batches,
)


def _shards(root: Path, sizes: list[int], dtype: str = "uint16", vocab: int = 1000) -> np.ndarray:
    """Write consecutive shards holding 0, 1, 2, ... modulo ``vocab``; returns the whole stream."""
    root.mkdir(parents=True, exist_ok=True)
    stream = np.arange(sum(sizes), dtype=np.int64) % vocab
    pos = 0
    for i, n in enumerate(sizes):
        stream[pos:pos + n].astype(dtype).tofile(root / f"shard-{i:03d}.bin")
        pos += n
    return stream


def _data(path: Path, seq_len: int = 16, vocab: int = 1000, **kw) -> ShuffledWindows:
    args = {"source": "tokens", "path": path, "dtype": "uint16", "eval_path": None, "eval_fraction": None,
            "bos_id": None, "kwargs": {}, "seq_len": seq_len, "seed": 7, "vocab_size": vocab} | kw
    return build_data(**args)


@pytest.mark.parametrize("n", [1, 2, 3, 5, 16, 17, 1000, 4097])
def test_feistel_is_a_permutation(n: int) -> None:
    perm = FeistelPermutation(n, key=123)
    assert sorted(perm(i) for i in range(n)) == list(range(n))


def test_feistel_keys_give_different_orders() -> None:
    a = [FeistelPermutation(1000, 1)(i) for i in range(1000)]
    b = [FeistelPermutation(1000, 2)(i) for i in range(1000)]
    assert a != b and a != list(range(1000))


def test_windows_span_shards_and_match_the_stream(tmp_path: Path) -> None:
    stream = _shards(tmp_path / "c", [50, 7, 100])
    windows = CorpusWindows(TokenCorpus(tmp_path / "c", "uint16", 1000), seq_len=16)
    assert len(windows) == (157 - 1) // 16
    for j in range(len(windows)):
        assert windows.window(j).tolist() == stream[j * 16: j * 16 + 17].tolist()


def test_bos_is_prepended(tmp_path: Path) -> None:
    stream = _shards(tmp_path / "c", [64])
    windows = CorpusWindows(TokenCorpus(tmp_path / "c", "uint16", 1000), seq_len=16, bos_id=999)
    assert len(windows) == 4
    assert windows.window(1).tolist() == [999, *stream[16:32].tolist()]


def test_npy_and_uint32_shards(tmp_path: Path) -> None:
    ids = (np.arange(100) * 70001 % 100000).astype(np.uint32)
    np.save(tmp_path / "a.npy", ids)
    windows = CorpusWindows(TokenCorpus(tmp_path / "a.npy", "uint16", 100000), seq_len=9)
    assert windows.window(2).tolist() == ids[18:28].tolist()
    ids.tofile(tmp_path / "b.bin")
    assert CorpusWindows(TokenCorpus(tmp_path / "b.bin", "uint32", 100000), 9).window(2).tolist() == ids[18:28].tolist()


def test_every_epoch_covers_every_training_window_once(tmp_path: Path) -> None:
    _shards(tmp_path / "c", [16 * 40 + 1])
    src = _data(tmp_path / "c").train
    for epoch in range(2):
        firsts = sorted(int(src.sample(epoch * 40 + k)[0]) for k in range(40))
        assert firsts == [16 * j for j in range(40)]
    assert [int(src.sample(k)[0]) for k in range(40)] != [int(src.sample(40 + k)[0]) for k in range(40)]


def test_sample_i_is_the_same_for_every_world_size_and_resume_point(tmp_path: Path) -> None:
    _shards(tmp_path / "c", [300, 300, 301])
    src = _data(tmp_path / "c").train
    fresh = _data(tmp_path / "c").train  # a resumed process builds its source anew
    for step in range(6):
        ref = torch.stack([fresh.sample(i) for i in range(step * 8, step * 8 + 8)])
        for dp in (1, 2, 4):
            rows = [torch.cat([x, y[:, -1:]], 1) for r in range(dp) for x, y in local_micro_batches(
                src, step=step, global_batch_size=8, micro_batch_size=2, dp_rank=r, dp_size=dp)]
            assert torch.equal(torch.cat(rows), ref)


def test_eval_fraction_holds_out_the_last_windows(tmp_path: Path) -> None:
    _shards(tmp_path / "c", [16 * 100 + 1], vocab=1 << 16)
    data = _data(tmp_path / "c", eval_fraction=0.1, vocab=1 << 16)
    train = {int(data.train.sample(i)[0]) for i in range(90)}
    held = {int(data.eval.sample(i)[0]) for i in range(10)}
    assert train == {16 * j for j in range(90)} and held == {16 * j for j in range(90, 100)}


def test_eval_path_is_a_separate_corpus(tmp_path: Path) -> None:
    _shards(tmp_path / "train", [200])
    _shards(tmp_path / "val", [50], vocab=7)
    data = _data(tmp_path / "train", eval_path=tmp_path / "val")
    assert int(data.eval.sample(0).max()) < 7 and data.eval_offset == 0


def test_wrong_dtype_is_refused_with_the_fix(tmp_path: Path) -> None:
    (tmp_path / "odd.bin").write_bytes(b"\x01\x00\x02\x00\x03\x00")  # 6 bytes: 3 uint16, not uint32
    with pytest.raises(ValueError, match=r"not a multiple of 4 .*data.dtype=uint32.*set data.dtype"):
        TokenCorpus(tmp_path / "odd.bin", "uint32", 100)


def test_meta_dtype_and_vocab_mismatch_are_refused(tmp_path: Path) -> None:
    _shards(tmp_path / "c", [100])
    (tmp_path / "c" / META_FILE).write_text(json.dumps({"dtype": "uint16", "vocab_size": 5000}))
    with pytest.raises(ValueError, match=r"shards were written as uint16 .*set data.dtype=uint16"):
        TokenCorpus(tmp_path / "c", "uint32", 8000)
    with pytest.raises(ValueError, match=r"vocab_size 5000 .*model has 1000; set model.overrides.vocab_size >= 5000"):
        TokenCorpus(tmp_path / "c", "uint16", 1000)


@pytest.mark.parametrize("meta", ["[1, 2]", "{not json", '{"shards": "x.bin"}', '{"shards": {"../up.bin": 5}}'])
def test_a_damaged_meta_json_is_refused_with_the_fix(tmp_path: Path, meta: str) -> None:
    _shards(tmp_path / "c", [100])
    (tmp_path / "c" / META_FILE).write_text(meta)
    with pytest.raises(ValueError, match=r"meta.json is (unreadable|not what prepare-data writes).*prepare-data"):
        TokenCorpus(tmp_path / "c", "uint16", 1000)


def test_a_shard_meta_json_lists_that_is_gone_is_refused_with_the_fix(tmp_path: Path) -> None:
    _shards(tmp_path / "c", [100, 100])
    (tmp_path / "c" / META_FILE).write_text(json.dumps({"dtype": "uint16", "shards": {"shard-000.bin": 100,
                                                                                      "shard-001.bin": 100}}))
    (tmp_path / "c" / "shard-001.bin").unlink()
    with pytest.raises(ValueError, match=r"shard-001.bin' cannot be read \(No such file or directory\); restore it"):
        TokenCorpus(tmp_path / "c", "uint16", 1000)


def test_token_outside_the_vocabulary_is_refused(tmp_path: Path) -> None:
    _shards(tmp_path / "c", [100], vocab=1000)
    src = _data(tmp_path / "c", vocab=50).train
    with pytest.raises(ValueError, match=r"token id \d+ is outside the model vocabulary \[0, 50\)"):
        for i in range(10):
            src.sample(i)


def test_too_short_corpus(tmp_path: Path) -> None:
    _shards(tmp_path / "c", [10])
    with pytest.raises(ValueError, match="fewer than one sample of 17; add data or lower training.seq_len"):
        _data(tmp_path / "c")


def test_dataset_factory_items_are_samples() -> None:
    data = build_data(source="tests.user_data:counting_dataset", path=None, dtype="uint16", eval_path=None,
                      eval_fraction=0.25, bos_id=None, kwargs={"items": 8, "length": 20}, seq_len=16, seed=1,
                      vocab_size=1000)
    assert sorted(int(data.train.sample(i)[0]) for i in range(6)) == [0, 100, 200, 300, 400, 500]
    assert sorted(int(data.eval.sample(i)[0]) for i in range(2)) == [600, 700]
    assert data.train.sample(0).shape == (17,)


def test_dataset_factory_errors() -> None:
    with pytest.raises(ValueError, match="returned int, expected a map-style dataset"):
        DatasetWindows(3, 16, 100, "m:f")  # type: ignore[arg-type]
    short = DatasetWindows([[1, 2, 3]], 16, 100, "m:f")
    with pytest.raises(ValueError, match="item 0 has 3 tokens, fewer than the 17"):
        short.window(0)


_RSS_SCRIPT = """
import sys
from pathlib import Path
from raytrain_ckpt.data import build_data
def rss_kb():
    fields = dict(line.split(":", 1) for line in open("/proc/self/status"))
    return [int(fields[k].split()[0]) for k in ("VmRSS", "RssAnon")]
before = rss_kb()
src = build_data(source="tokens", path=Path(sys.argv[1]), dtype="uint32", eval_path=None, eval_fraction=None,
                 bos_id=None, kwargs={}, seq_len=128, seed=0, vocab_size=1 << 20).train
for i in range(2000):
    src.sample(i)
after = rss_kb()
print(*before, *after)
"""


def test_reading_samples_does_not_load_the_corpus_into_memory(tmp_path: Path) -> None:
    # 200 MB of uint32 tokens; 2000 random samples of 129 tokens touch at most 2 pages each.
    path = tmp_path / "big.bin"
    n = 50_000_000
    with open(path, "wb") as f:
        chunk = np.arange(1 << 20, dtype=np.uint32) % 50000
        for _ in range(n // len(chunk)):
            chunk.tofile(f)
    out = subprocess.run([sys.executable, "-c", _RSS_SCRIPT, str(path)], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}, check=True)
    rss0, anon0, rss1, anon1 = map(int, out.stdout.split())
    size_kb = path.stat().st_size // 1024
    # Nothing is copied into process memory. The mapped file pages (VmRSS - RssAnon) are page
    # cache the kernel can drop; with the file just written they may be mapped in large folios.
    assert anon1 - anon0 < size_kb // 50, (anon0, anon1, size_kb)


_BUDGET_SCRIPT = """
import resource, sys
from pathlib import Path
import numpy as np
from raytrain_ckpt.data import build_data

def status():
    fields = dict(line.split(":", 1) for line in open("/proc/self/status"))
    return {k: int(fields[k].split()[0]) * 1024 for k in ("VmRSS", "RssAnon", "VmData")}

budget = int(sys.argv[2])
start = status()
# The data's RAM budget, enforced: private writable memory (what a copy of the corpus, or a
# materialised permutation of its windows, would need) may grow by `budget` at most; the
# read-only shared maps of the shards do not count against it.
resource.setrlimit(resource.RLIMIT_DATA, (start["VmData"] + budget, resource.RLIM_INFINITY))
try:  # the limit is live (free heap the process already holds makes it slightly loose)
    np.ones(2 * budget, dtype=np.uint8)
    raise SystemExit("the limit is not enforced")
except MemoryError:
    pass
data = build_data(source="tokens", path=Path(sys.argv[1]), dtype="uint32", eval_path=None, eval_fraction=0.01,
                  bos_id=None, kwargs={}, seq_len=128, seed=0, vocab_size=1 << 20)
for i in range(2000):
    data.train.sample(i)
    data.eval.sample(i)
end = status()
print(end["VmRSS"] - start["VmRSS"], end["RssAnon"] - start["RssAnon"])
"""


def test_rank_memory_does_not_grow_with_a_corpus_64x_its_data_budget(tmp_path: Path) -> None:
    # 16 sparse shards of 256 MiB: 4 GiB of tokens on no disk, 64 x the 64 MiB data budget
    budget, shards, shard_bytes = 64 << 20, 16, 256 << 20
    for i in range(shards):
        with open(tmp_path / f"shard-{i:02d}.bin", "wb") as f:
            f.truncate(shard_bytes)
    out = subprocess.run([sys.executable, "-c", _BUDGET_SCRIPT, str(tmp_path), str(budget)], capture_output=True,
                         text=True, env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    assert out.returncode == 0, out.stderr[-2000:]
    rss_growth, anon_growth = map(int, out.stdout.split())
    corpus = shards * shard_bytes
    assert corpus >= 64 * budget
    # 4000 samples of 516 bytes touch at most two 4 KiB pages each: about 32 MiB of page cache
    assert rss_growth < budget, (rss_growth, corpus)
    assert anon_growth < budget // 8, (anon_growth, corpus)
