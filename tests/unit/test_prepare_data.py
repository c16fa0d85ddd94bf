"""``raytrain-ckpt prepare-data``: real files, a real tokenizer, real worker processes."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from tokenizers import Tokenizer

from raytrain_ckpt.cli import main
from raytrain_ckpt.data import TokenCorpus, build_data

DOCS = ["The quick brown fox jumps over the lazy dog. " * 20,
        "Checkpoints are data; job specs are code. " * 15,
        "Sample i of the global stream is a pure function of the data and i. " * 10]


def _decode(out: Path, shard: str) -> list[str]:
    meta = json.loads((out / "meta.json").read_text())
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    ids = np.fromfile(out / shard, dtype=meta["dtype"]).tolist()
    docs, cur = [], []
    for i in ids:
        if i == meta["separator_id"]:
            docs.append(tok.decode(cur))
            cur = []
        else:
            cur.append(i)
    assert not cur, "every document ends with the separator"
    return docs


@pytest.fixture
def texts(tmp_path: Path) -> Path:
    root = tmp_path / "texts"
    root.mkdir()
    for i, doc in enumerate(DOCS):
        (root / f"doc{i}.txt").write_text(doc)
    return root


def test_text_files_round_trip_through_a_trained_tokenizer(tmp_path, texts, capsys):
    out = tmp_path / "out"
    assert main(["prepare-data", str(texts), "--out", str(out), "--vocab-size", "300", "--workers", "2"]) == 0
    meta = json.loads((out / "meta.json").read_text())
    assert meta["vocab_size"] == 300 and meta["dtype"] == "uint16" and len(meta["tokenizer_sha256"]) == 64
    assert sorted(meta["shards"]) == ["00000-doc0.bin", "00001-doc1.bin", "00002-doc2.bin"]
    for i, doc in enumerate(DOCS):
        assert _decode(out, f"0000{i}-doc{i}.bin") == [doc]
    assert meta["num_tokens"] == TokenCorpus(out, "uint16", 300).num_tokens
    assert "data.source=tokens" in capsys.readouterr().out


def test_jsonl_field_and_parquet_column(tmp_path):
    src = tmp_path / "in"
    src.mkdir()
    (src / "a.jsonl").write_text("".join(json.dumps({"body": d, "id": i}) + "\n" for i, d in enumerate(DOCS[:2])))
    pq.write_table(pa.table({"content": [DOCS[2], DOCS[0]]}), src / "b.parquet")
    tok_dir = tmp_path / "tok"
    assert main(["prepare-data", str(src / "a.jsonl"), "--out", str(tok_dir), "--vocab-size", "300",
                 "--field", "body", "--workers", "1"]) == 0
    out = tmp_path / "out"
    assert main(["prepare-data", str(src), "--out", str(out), "--tokenizer", str(tok_dir / "tokenizer.json"),
                 "--field", "body", "--column", "content", "--workers", "2"]) == 0
    assert _decode(out, "00000-a.bin") == DOCS[:2]
    assert _decode(out, "00001-b.bin") == [DOCS[2], DOCS[0]]
    assert json.loads((out / "meta.json").read_text())["tokenizer_sha256"] == \
        json.loads((tok_dir / "meta.json").read_text())["tokenizer_sha256"]


@pytest.mark.parametrize("args,expected", [
    (["--field", "nope"], "a.jsonl:1: no string field 'nope'; pick the text field with --field"),
    ([], "give --tokenizer PATH/tokenizer.json, or --vocab-size N"),
    (["--vocab-size", "100"], "--vocab-size 100: a byte-level BPE needs at least 257"),
])
def test_user_mistakes_are_one_line_and_exit_2(tmp_path, capsys, args, expected):
    (tmp_path / "a.jsonl").write_text(json.dumps({"text": "hello"}) + "\n")
    extra = args if "--vocab-size" in args or not args else [*args, "--vocab-size", "300"]
    code = main(["prepare-data", str(tmp_path / "a.jsonl"), "--out", str(tmp_path / "out"), "--workers", "1", *extra])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and expected in err[0], err


def test_rerun_is_a_no_op_and_an_interrupted_run_resumes(tmp_path, texts):
    out = tmp_path / "out"
    args = ["prepare-data", str(texts), "--out", str(out), "--vocab-size", "300", "--workers", "2"]
    assert main(args) == 0
    first = {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in out.glob("*.bin")}
    meta = (out / "meta.json").read_text()
    (out / "00001-doc1.bin").unlink()  # as if the run had died before this shard was renamed into place
    assert main(args) == 0
    again = {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in out.glob("*.bin")}
    assert again["00000-doc0.bin"] == first["00000-doc0.bin"]  # kept, not rewritten
    assert again["00001-doc1.bin"][1] == first["00001-doc1.bin"][1]  # rewritten, identical
    assert (out / "meta.json").read_text() == meta
    (texts / "doc2.txt").write_text("changed text " * 30)
    assert main(args) == 0
    assert _decode(out, "00002-doc2.bin") == ["changed text " * 30]


def test_validate_refuses_a_model_vocab_smaller_than_the_tokenizer(tmp_path, texts, capsys):
    out = tmp_path / "out"
    assert main(["prepare-data", str(texts), "--out", str(out), "--vocab-size", "300", "--workers", "1"]) == 0
    spec = tmp_path / "job.yaml"
    spec.write_text(yaml.safe_dump({"name": "t", "model": {"name": "debug"},
                                    "data": {"source": "tokens", "path": str(out)}}))
    capsys.readouterr()
    assert main(["validate", str(spec)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "vocab_size 300 (meta.json) but the model has 256" in err[0], err
    assert main(["validate", str(spec), "--set", "model.overrides.vocab_size=300"]) == 0
    data = build_data(source="tokens", path=out, dtype="uint16", eval_path=None, eval_fraction=0.2, bos_id=None,
                      kwargs={}, seq_len=16, seed=0, vocab_size=300)
    assert data.train.sample(0).shape == (17,) and data.eval is not None
