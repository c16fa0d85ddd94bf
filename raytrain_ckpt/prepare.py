"""``raytrain-ckpt prepare-data``: text, JSONL or Parquet files -> token shards for ``data.source: tokens``.

Every input file becomes one shard ``<index>-<stem>.bin`` (a flat array of ``uint16`` token
ids, ``uint32`` when the vocabulary does not fit), each document followed by the separator
id. The tokenizer is a Hugging Face ``tokenizers`` file given with ``--tokenizer``, or a
byte-level BPE trained on the input with ``--vocab-size``; either way it is kept beside the
shards as ``tokenizer.json``.

Files are tokenized in parallel processes. A shard is written under a temporary name and
renamed, then recorded in a sidecar ``<shard>.json`` (source size and mtime, tokenizer hash,
token count): a rerun skips every shard whose record still matches, so an interrupted run
resumes and a finished one is a no-op. ``meta.json`` (tokenizer hash, vocab size, dtype,
token counts) is written last; ``validate`` checks its vocab size against the model's.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import shutil
import sys
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from raytrain_ckpt.data.suffixes import TEXT_SUFFIXES
from raytrain_ckpt.logs import setup_logging

logger = logging.getLogger(__name__)

__all__ = ["PrepareError", "add_parser", "prepare_data", "run"]

EXIT_OK, EXIT_USAGE = 0, 2
TOKENIZER_FILE = "tokenizer.json"
SEPARATOR = "<|endoftext|>"
_INPUT_SUFFIXES = frozenset(TEXT_SUFFIXES - {".json"}) | {".jsonl", ".parquet"}
_BATCH = 256


class PrepareError(ValueError):
    """A user mistake (a missing input, a field that is not there): one line, exit code 2."""


@dataclass(frozen=True)
class _Job:
    source: str
    shard: str
    tokenizer: str
    tokenizer_sha256: str
    dtype: str
    separator_id: int | None
    field: str
    column: str


def _input_files(inputs: list[Path]) -> list[Path]:
    files: list[Path] = []
    for path in inputs:
        if not path.exists():
            raise PrepareError(f"{path}: no such file or directory")
        if path.is_file():
            files.append(path)
        else:
            files += sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in _INPUT_SUFFIXES)
    if not files:
        raise PrepareError(f"no input files with a suffix in {sorted(_INPUT_SUFFIXES)} under {[str(p) for p in inputs]}")
    return files


def _documents(path: Path, field: str, column: str) -> Iterator[str]:
    """The documents of one input file: the whole file, a JSONL field per line, or a Parquet column per row."""
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        with open(path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise PrepareError(f"{path}:{lineno}: not JSON ({exc.msg}); each line must be one JSON object") from None
                if not isinstance(record, dict) or not isinstance(record.get(field), str):
                    raise PrepareError(f"{path}:{lineno}: no string field {field!r}; pick the text field with --field")
                yield record[field]
    elif suffix == ".parquet":
        import pyarrow.parquet as pq

        table = pq.ParquetFile(path)
        if column not in table.schema_arrow.names:
            raise PrepareError(f"{path}: no column {column!r} (columns: {table.schema_arrow.names}); "
                               "pick it with --column")
        for batch in table.iter_batches(columns=[column]):
            yield from (text for text in batch.column(0).to_pylist() if text)
    else:
        yield path.read_text(encoding="utf-8", errors="replace")


def _batches(docs: Iterator[str]) -> Iterator[list[str]]:
    batch: list[str] = []
    for doc in docs:
        batch.append(doc)
        if len(batch) == _BATCH:
            yield batch
            batch = []
    if batch:
        yield batch


def _record(job: _Job) -> dict[str, Any]:
    st = os.stat(job.source)
    return {"source": job.source, "size": st.st_size, "mtime_ns": st.st_mtime_ns,
            "tokenizer_sha256": job.tokenizer_sha256, "dtype": job.dtype, "separator_id": job.separator_id}


def _tokenize_file(job: _Job) -> tuple[str, int, bool]:
    """Write one shard (in a worker process); returns (shard name, tokens, skipped)."""
    import numpy as np  # not at the top: the CLI builds its parser from this module and must start fast
    from tokenizers import Tokenizer

    shard, sidecar = Path(job.shard), Path(job.shard + ".json")
    record = _record(job)
    if shard.is_file() and sidecar.is_file():
        done = json.loads(sidecar.read_text(encoding="utf-8"))
        if {k: done.get(k) for k in record} == record:
            return shard.name, int(done["tokens"]), True
    tok = Tokenizer.from_file(job.tokenizer)
    tmp = shard.with_name(shard.name + f".tmp-{os.getpid()}")
    count = 0
    with open(tmp, "wb") as f:
        for batch in _batches(_documents(Path(job.source), job.field, job.column)):
            for enc in tok.encode_batch(batch, add_special_tokens=False):
                ids = enc.ids if job.separator_id is None else [*enc.ids, job.separator_id]
                np.asarray(ids, dtype=job.dtype).tofile(f)
                count += len(ids)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, shard)
    sidecar.write_text(json.dumps({**record, "tokens": count}), encoding="utf-8")
    return shard.name, count, False


def _train_tokenizer(files: list[Path], vocab_size: int, out: Path, field: str, column: str) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[SEPARATOR],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator((doc for f in files for doc in _documents(f, field, column)), trainer=trainer)
    tok.save(str(out))


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _tokenizer(out: Path, files: list[Path], tokenizer: Path | None, vocab_size: int | None,
               field: str, column: str) -> Path:
    """The tokenizer file the shards are written with: given, kept from an earlier run, or trained now."""
    saved = out / TOKENIZER_FILE
    if tokenizer is not None:
        if not tokenizer.is_file():
            raise PrepareError(f"--tokenizer {tokenizer}: no such file; give a Hugging Face tokenizer.json")
        # A copy beside the shards keeps them self-describing (decode, hash check) wherever they move.
        if not saved.exists() or not saved.samefile(tokenizer):
            shutil.copyfile(tokenizer, saved)
        return saved
    if saved.is_file():
        return saved  # an earlier run trained it: keep it, so its shards stay valid
    if vocab_size is None:
        raise PrepareError("give --tokenizer PATH/tokenizer.json, or --vocab-size N to train a byte-level BPE")
    if vocab_size < 257:
        raise PrepareError(f"--vocab-size {vocab_size}: a byte-level BPE needs at least 257 (256 bytes + separator)")
    logger.info("training a byte-level BPE tokenizer (vocab %d) on %d file(s)", vocab_size, len(files))
    _train_tokenizer(files, vocab_size, saved, field, column)
    return saved


def prepare_data(inputs: list[Path], out: Path, *, tokenizer: Path | None = None, vocab_size: int | None = None,
                 field: str = "text", column: str = "text", workers: int = 1, progress: bool = True) -> dict[str, Any]:
    """Tokenize ``inputs`` into shards under ``out``; returns the metadata written to ``meta.json``.

    Raises:
        PrepareError: For missing inputs or tokenizer, or a record without the text field.
    """
    from tokenizers import Tokenizer

    from raytrain_ckpt.data.tokens import META_FILE  # data.tokens imports torch: not for `--help` or `validate`

    files = _input_files(inputs)
    out.mkdir(parents=True, exist_ok=True)
    tok_path = _tokenizer(out, files, tokenizer, vocab_size, field, column)
    tok = Tokenizer.from_file(str(tok_path))
    vocab = tok.get_vocab_size(with_added_tokens=True)
    dtype = "uint16" if vocab <= 1 << 16 else "uint32"
    digest = _sha256(tok_path)
    jobs = [_Job(str(f.resolve()), str(out / f"{i:05d}-{f.stem}.bin"), str(tok_path), digest, dtype,
                 tok.token_to_id(SEPARATOR), field, column) for i, f in enumerate(files)]
    shards = _run_jobs(jobs, workers, progress)
    meta = {"tokenizer_sha256": digest, "tokenizer": TOKENIZER_FILE, "vocab_size": vocab, "dtype": dtype,
            "separator_id": jobs[0].separator_id,
            "num_tokens": sum(shards.values()), "shards": dict(sorted(shards.items()))}
    tmp = out / (META_FILE + ".tmp")
    tmp.write_text(json.dumps(meta, indent=1), encoding="utf-8")
    os.replace(tmp, out / META_FILE)
    return meta


def _run_jobs(jobs: list[_Job], workers: int, progress: bool) -> dict[str, int]:
    from tqdm import tqdm

    shards: dict[str, int] = {}
    skipped = 0
    with ProcessPoolExecutor(max_workers=max(1, workers)) as pool, \
            tqdm(total=len(jobs), unit="file", desc="prepare-data", disable=not progress) as bar:
        for fut in as_completed([pool.submit(_tokenize_file, job) for job in jobs]):
            name, count, was_done = fut.result()
            shards[name] = count
            skipped += was_done
            bar.update(1)
    if skipped:
        logger.info("%d of %d shard(s) were already written with this tokenizer: kept", skipped, len(jobs))
    return shards


# --- command line -----------------------------------------------------------------------------

def add_parser(sub: Any) -> None:
    """Add ``prepare-data`` to the CLI's subparsers."""
    p = sub.add_parser("prepare-data", help="tokenize text / JSONL / Parquet files into shards for data.source=tokens")
    p.add_argument("inputs", nargs="+", type=Path, help="files or directories (.txt .md ... .jsonl .parquet)")
    p.add_argument("--out", type=Path, required=True, help="output directory: data.path of the job")
    p.add_argument("--tokenizer", type=Path, help="a Hugging Face tokenizer.json to use")
    p.add_argument("--vocab-size", type=int, help="without --tokenizer: train a byte-level BPE of this size")
    p.add_argument("--field", default="text", help="JSONL: the field holding the text (default: text)")
    p.add_argument("--column", default="text", help="Parquet: the column holding the text (default: text)")
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="parallel processes (default: all CPUs)")


def run(args: argparse.Namespace) -> int:
    """Run ``prepare-data``; user mistakes print one line and return 2."""
    setup_logging()
    try:
        meta = prepare_data(args.inputs, args.out, tokenizer=args.tokenizer, vocab_size=args.vocab_size,
                            field=args.field, column=args.column, workers=args.workers,
                            progress=sys.stderr.isatty())
    except PrepareError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    print(f"{meta['num_tokens']} tokens in {len(meta['shards'])} shard(s) ({meta['dtype']}, vocab {meta['vocab_size']}) "
          f"in {args.out}; use data.source=tokens, data.path={args.out}, data.dtype={meta['dtype']}, "
          f"model vocab_size >= {meta['vocab_size']}")
    return EXIT_OK
