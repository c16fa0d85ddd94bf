"""``raytrain-ckpt prepare-data``: real files, a real tokenizer, real worker processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from tokenizers import Tokenizer

import raytrain_ckpt
from raytrain_ckpt.cli import prepare
from raytrain_ckpt.cli.main import main
from raytrain_ckpt.data import TokenCorpus, build_data

ROOT = Path(raytrain_ckpt.__file__).resolve().parents[1]

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
    (["--vocab-size", "99999999999999999999999"], "--vocab-size 99999999999999999999999: too large, token ids "
                                                  "are stored as uint32; give at most 4294967296"),
    (["--workers", "0"], "--workers 0: must be >= 1"),
    (["--tokenizer", "t.json", "--vocab-size", "300"], "--tokenizer and --vocab-size: give one"),
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


# --- mistakes found before any work, and bad input files: one line, exit 2, nothing left behind ---------

def _cli(*args: str, cwd: Path) -> list[str]:
    """Run the real CLI in a fresh process; returns its stderr lines that are not log lines,
    after checking for the one exit-2 ``error:`` line the contract promises."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "raytrain_ckpt", "prepare-data", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)
    lines = [line for line in proc.stderr.splitlines() if " INFO " not in line]
    assert "Traceback" not in proc.stderr, proc.stderr
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    return lines


def _snapshot(root: Path) -> dict[str, tuple[int, bytes]]:
    return {str(p.relative_to(root)): (p.stat().st_mtime_ns, p.read_bytes()) for p in root.rglob("*") if p.is_file()}


@pytest.fixture
def tokenizer(tmp_path: Path, texts: Path) -> Path:
    out = tmp_path / "tok"
    assert main(["prepare-data", str(texts), "--out", str(out), "--vocab-size", "300", "--workers", "1"]) == 0
    return out / "tokenizer.json"


@pytest.mark.parametrize("out,expected", [
    ("taken.txt", "--out taken.txt: exists and is not a directory"),
    ("/dev/null/x", "--out /dev/null/x: /dev/null is a file, so nothing can be created under it"),
    ("/proc/tok", "--out /proc/tok: "),  # root may write /proc, yet nothing can be made there
    ("~nosuchuser4711/out", "--out ~nosuchuser4711/out: ~nosuchuser4711 names no user of this machine; "
                            "write the path out in full"),
])
def test_an_out_that_cannot_be_a_directory_is_refused_before_any_work(tmp_path, texts, out, expected):
    (tmp_path / "taken.txt").write_text("mine")
    before = _snapshot(tmp_path)
    [line] = _cli(str(texts), "--out", out, "--vocab-size", "300", "--workers", "1", cwd=tmp_path)
    assert expected in line and ("; give" in line or "; write" in line), line
    assert _snapshot(tmp_path) == before  # the file is untouched and no `~nosuchuser4711` directory was made


def test_a_tokenizer_that_is_not_a_tokenizer_file_is_refused_and_not_copied(tmp_path, texts):
    (tmp_path / "notes.txt").write_text("not JSON at all\n")
    [line] = _cli(str(texts), "--out", "out", "--tokenizer", "notes.txt", "--workers", "1", cwd=tmp_path)
    assert line.startswith("error: --tokenizer notes.txt: not a Hugging Face tokenizers file (") and \
        "; give the tokenizer.json" in line, line
    assert not (tmp_path / "out").exists()


def test_an_out_holding_files_prepare_data_did_not_write_is_left_untouched(tmp_path, texts, tokenizer):
    model = tmp_path / "model"  # a model directory: its own tokenizer.json and meta.json
    model.mkdir()
    (model / "tokenizer.json").write_text('{"version": "1.0", "model": "theirs"}')
    (model / "meta.json").write_text('{"model_type": "llama"}')
    before = _snapshot(model)
    [line] = _cli(str(texts), "--out", str(model), "--tokenizer", str(tokenizer), "--workers", "1", cwd=tmp_path)
    assert f"--out {model}: holds files prepare-data did not write (meta.json, tokenizer.json); " \
           "give a new or empty directory" in line, line
    assert _snapshot(model) == before


def _bad_jsonl(path: Path) -> None:
    path.write_bytes(json.dumps({"text": "fine"}).encode() + b'\n{"text": "caf\xe9"}\n')


def _parquet_of_ints(path: Path) -> None:
    pq.write_table(pa.table({"text": [1, 2, 3]}), path)


@pytest.mark.parametrize("how", ["given", "trained"])
@pytest.mark.parametrize("name,write,expected", [
    ("bad.jsonl", _bad_jsonl, "bad.jsonl:2: not UTF-8 (byte 0xe9 at column 14); save the file as UTF-8"),
    ("text.parquet", lambda p: p.write_text("plain text, renamed\n"), "text.parquet: not a readable Parquet file ("),
    ("ints.parquet", _parquet_of_ints, "ints.parquet: column 'text' holds int64, not strings; "
                                       "pick the text column with --column"),
])
def test_a_bad_input_file_is_named_and_leaves_no_temporary_files(tmp_path, texts, tokenizer, how, name, write,
                                                                 expected):
    """Given a tokenizer, the bad file fails in a worker process; training, in this one."""
    write(texts / name)
    out = tmp_path / "out"
    flags = ["--tokenizer", str(tokenizer)] if how == "given" else ["--vocab-size", "300"]
    [line] = _cli(str(texts), "--out", str(out), *flags, "--workers", "2", cwd=tmp_path)
    assert expected in line, line
    if how == "given":  # finished shards are kept for the rerun; no half-written one is
        assert not [p.name for p in out.iterdir() if ".tmp-" in p.name]
    else:  # it failed before anything was written: no empty directory either
        assert not out.exists()


def test_a_rerun_with_another_vocab_size_trains_again(tmp_path, texts):
    out = tmp_path / "out"
    args = ["prepare-data", str(texts), "--out", str(out), "--workers", "1"]
    assert main([*args, "--vocab-size", "300"]) == 0
    assert json.loads((out / "meta.json").read_text())["vocab_size"] == 300
    assert main([*args, "--vocab-size", "1000"]) == 0  # more than these documents can fill: they give 346
    meta = json.loads((out / "meta.json").read_text())
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    assert 300 < meta["vocab_size"] == tok.get_vocab_size(with_added_tokens=True)
    for i, doc in enumerate(DOCS):
        assert _decode(out, f"0000{i}-doc{i}.bin") == [doc]
    done = _snapshot(out)
    assert main([*args, "--vocab-size", "1000"]) == 0  # the same request again: nothing is redone
    assert main(args) == 0  # no tokenizer flag: the kept one is used
    again = _snapshot(out)
    assert {k: v for k, v in again.items() if k != "meta.json"} == {k: v for k, v in done.items() if k != "meta.json"}


def test_workers_are_capped_at_the_number_of_input_files(tmp_path, texts, monkeypatch):
    sizes: list[int] = []

    class Recording(prepare.ProcessPoolExecutor):
        def __init__(self, max_workers: int) -> None:
            sizes.append(max_workers)
            super().__init__(max_workers=max_workers)

    monkeypatch.setattr(prepare, "ProcessPoolExecutor", Recording)
    assert main(["prepare-data", str(texts / "doc0.txt"), "--out", str(tmp_path / "out"), "--vocab-size", "300",
                 "--workers", "40"]) == 0
    assert sizes == [1]
    assert _decode(tmp_path / "out", "00000-doc0.bin") == [DOCS[0]]


_PEAK_SCRIPT = r"""
import random, resource, sys
from pathlib import Path
from tokenizers import Tokenizer
from raytrain_ckpt.cli import prepare
tmp, n = Path(sys.argv[1]), int(sys.argv[2])
rng = random.Random(0)
words = ["".join(rng.choice("abcdefghij") for _ in range(rng.randint(1, 8))) for _ in range(2000)]
(tmp / "small.txt").write_text(" ".join(rng.choice(words) for _ in range(20000)))
(tmp / "tok.json").write_bytes(prepare._train_tokenizer([tmp / "small.txt"], 400, "text", "text"))
with open(tmp / "big.txt", "w") as f:  # one document of n characters
    while f.tell() < n:
        f.write(" ".join(rng.choice(words) for _ in range(10000)) + "\n")
job = prepare._Job(str(tmp / "big.txt"), str(tmp / "big.bin"), str(tmp / "tok.json"), "x", "uint16", 0, "text", "text")
Tokenizer.from_file(job.tokenizer).encode_batch(["warm up"])
import numpy
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
prepare._tokenize_file(job)
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024)
"""


def test_memory_is_bounded_by_a_constant_not_by_the_largest_document(tmp_path: Path) -> None:
    """One 12 MiB document: tokenized whole it raised the peak by ~2.4 GB (about 200 bytes per
    character); in pieces of CHUNK_CHARS the peak stays at a few hundred MB whatever its size."""
    size = 12 << 20
    proc = subprocess.run([sys.executable, "-c", _PEAK_SCRIPT, str(tmp_path), str(size)], capture_output=True,
                          text=True, timeout=600, env={**os.environ, "PYTHONPATH": str(Path.cwd())})
    assert proc.returncode == 0, proc.stderr[-2000:]
    growth = int(proc.stdout.split()[-1])
    assert growth < 800 << 20, f"peak RSS grew by {growth >> 20} MiB for a {size >> 20} MiB document"


def test_a_long_document_tokenizes_in_pieces_as_it_does_whole(tmp_path: Path, monkeypatch) -> None:
    """Pieces are cut where a word starts, so a byte-level BPE gives the same ids, and the
    separator still follows the document once."""
    import numpy as np
    from tokenizers import Tokenizer

    from raytrain_ckpt.cli import prepare

    newline = "\n"
    text = "".join(f"word{i % 97}{'  ' if i % 7 == 0 else ' '}{newline if i % 13 == 0 else ''}" for i in range(3000))
    src = tmp_path / "doc.txt"
    src.write_text(text)
    tok_file = tmp_path / "tok.json"
    tok_file.write_bytes(prepare._train_tokenizer([src], 300, "text", "text"))
    tok = Tokenizer.from_file(str(tok_file))
    monkeypatch.setattr(prepare, "CHUNK_CHARS", 101)
    job = prepare._Job(str(src), str(tmp_path / "doc.bin"), str(tok_file), "x", "uint16", 0, "text", "text")
    assert prepare._write_shard(job, tok, tmp_path / "doc.bin") == len(tok.encode(text).ids) + 1
    assert np.fromfile(tmp_path / "doc.bin", dtype=np.uint16).tolist() == [*tok.encode(text).ids, 0]
    pieces = list(prepare._pieces(src, "text", "text"))
    assert len(pieces) > 50 and all(len(p) <= 101 for p, _ in pieces) and [e for _, e in pieces].count(True) == 1
