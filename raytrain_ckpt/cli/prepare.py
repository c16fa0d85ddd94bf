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

``--out`` must be new, empty, or an earlier output of this command, recognised by its marker
``.prepare-data.json`` (tokenizer hash, and the vocab size it was trained with) or by its
``meta.json``: a directory holding anything else (a model's ``tokenizer.json``) is refused, so
nothing of the user's is overwritten. A rerun follows its flags: ``--tokenizer`` with other
contents, or ``--vocab-size`` other than the one the kept tokenizer was trained with, replaces
the tokenizer, and the tokenizer hash then redoes every shard.

Mistakes are found before any work where they can be (flags, ``--out``, the tokenizer file);
a bad input file is reported by the worker that reads it, with its line for JSONL, and leaves
no temporary file behind.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import sys
from collections.abc import Iterable, Iterator
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from raytrain_ckpt.data.suffixes import TEXT_SUFFIXES, input_files, open_regular
from raytrain_ckpt.common.locations import is_uri
from raytrain_ckpt.common.logs import setup_logging
from raytrain_ckpt.checkpoint.errors import ExitCode
from raytrain_ckpt.cli.prepare_input import PrepareError, _batches, _jsonl_documents, _parquet_documents

logger = logging.getLogger(__name__)

__all__ = ["PrepareError", "add_parser", "prepare_data", "run"]

TOKENIZER_FILE = "tokenizer.json"
MARKER_FILE = ".prepare-data.json"
SEPARATOR = "<|endoftext|>"
MAX_VOCAB = 1 << 32  # token ids are stored as uint32 at most
_MAX_RECORD_BYTES = 1 << 20
"""The most of a marker or sidecar JSON read: this module writes a few hundred bytes there."""
_INPUT_SUFFIXES = frozenset(TEXT_SUFFIXES - {".json"}) | {".jsonl", ".parquet"}
CHUNK_CHARS = 1 << 18
"""Longest piece of a document the tokenizer is given at once: a longer document is read and
tokenized in pieces cut before a whitespace that starts a word (where a byte-level BPE never
merges across), so memory is bounded by this, not by the largest document (the tokenizer's
encodings take about 200 bytes per character)."""
_TMP = ".tmp-"


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


# --- checks before any work -----------------------------------------------------------------

def _check_flags(tokenizer: Path | None, vocab_size: int | None, workers: int) -> None:
    if tokenizer is not None and vocab_size is not None:
        raise PrepareError("--tokenizer and --vocab-size: give one; --tokenizer uses that tokenizer, --vocab-size "
                           "trains a new one on the input")
    if vocab_size is not None and vocab_size < 257:
        raise PrepareError(f"--vocab-size {vocab_size}: a byte-level BPE needs at least 257 (256 bytes + separator)")
    if vocab_size is not None and vocab_size > MAX_VOCAB:
        raise PrepareError(f"--vocab-size {vocab_size}: too large, token ids are stored as uint32; "
                           f"give at most {MAX_VOCAB}")
    if workers < 1:
        raise PrepareError(f"--workers {workers}: must be >= 1 (the number of parallel processes)")


def _expand(path: Path, flag: str) -> Path:
    """``path`` with a leading ``~`` expanded: ``--out=~/x`` reaches us unexpanded, and a literal
    ``~`` directory in the working directory is never what was meant."""
    from raytrain_ckpt.common.locations import home_problem

    problem = home_problem(path)
    if problem is not None:
        raise PrepareError(f"{flag} {path}: {problem}")
    return path.expanduser()


def _read_json(path: Path) -> Any:
    """The JSON in ``path``, or None when it is missing or not JSON (judged as not ours)."""
    try:
        with open_regular(path) as f:  # a FIFO planted in --out is judged, never read (it would block)
            return json.loads(f.read(_MAX_RECORD_BYTES).decode("utf-8"))
    except (OSError, ValueError, RecursionError):  # (ValueError: not UTF-8, not JSON, not a regular file)
        return None


def _is_ours(out: Path) -> bool:
    """Whether ``out`` was written by prepare-data: its marker, or (before markers) its ``meta.json``."""
    from raytrain_ckpt.data.tokens import META_FILE

    marker, meta = _read_json(out / MARKER_FILE), _read_json(out / META_FILE)
    if isinstance(marker, dict) and "tokenizer_sha256" in marker:
        return True
    return isinstance(meta, dict) and {"tokenizer_sha256", "vocab_size", "shards"} <= meta.keys()


def _check_out(out: Path) -> None:
    """Refuse an ``--out`` that cannot be written, or that holds files prepare-data did not write."""
    from raytrain_ckpt.control.preflight import writable_dir_problem

    problem = writable_dir_problem(out)
    if problem is not None:
        raise PrepareError(f"--out {out}: {problem}; give a directory to write the shards into")
    if not out.is_dir():
        return
    try:
        names = sorted(os.listdir(out))
    except OSError as exc:
        raise PrepareError(f"--out {out}: cannot be listed ({exc.strerror}); give a directory you can read") from None
    if names and not _is_ours(out):
        shown = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
        raise PrepareError(f"--out {out}: holds files prepare-data did not write ({shown}); "
                           "give a new or empty directory, so that nothing in it is overwritten")


def _input_files(inputs: list[Path]) -> list[Path]:
    files: list[Path] = []
    for path in inputs:
        if not path.exists():
            raise PrepareError(f"{path}: no such file or directory")
        if path.is_file():
            files.append(path)
        else:
            try:
                files += input_files(path, _INPUT_SUFFIXES)
            except ValueError as exc:
                raise PrepareError(str(exc)) from None
    if not files:
        raise PrepareError(f"no input files with a suffix in {sorted(_INPUT_SUFFIXES)} under {[str(p) for p in inputs]}")
    for f in files:
        if not os.access(f, os.R_OK):
            raise PrepareError(f"{f}: not readable (no read permission); fix its permissions or leave it out")
    return files


def _load_tokenizer(path: Path, what: str, fix: str) -> Any:
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(str(path))
    except Exception as exc:  # tokenizers raises a bare Exception for every unreadable or malformed file
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise PrepareError(f"{what}: not a Hugging Face tokenizers file ({reason}); {fix}") from None


# --- reading inputs ----------------------------------------------------------------------------

def _pieces(path: Path, field: str, column: str) -> Iterator[tuple[str, bool]]:
    """The documents of one input file (the whole file, a JSONL field per line, or a Parquet column
    per row) as pieces of at most about CHUNK_CHARS characters: ``(text, ends its document)``."""
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".parquet"):
        docs = _jsonl_documents(path, field) if suffix == ".jsonl" else _parquet_documents(path, column)
        for doc in docs:
            yield from _cut([doc])
        return
    with open(path, encoding="utf-8", errors="replace") as f:  # read in chunks: a text file is one document
        yield from _cut(iter(lambda: f.read(CHUNK_CHARS), ""))


def _cut(chunks: Iterable[str]) -> Iterator[tuple[str, bool]]:
    """One document given as ``chunks`` of text, re-cut into pieces of at most CHUNK_CHARS characters
    at word starts (a piece is longer only when no word starts in it)."""
    carry = ""
    for chunk in chunks:
        text = carry + chunk
        while len(text) > CHUNK_CHARS:
            at = _cut_point(text, CHUNK_CHARS)
            yield text[:at], False
            text = text[at:]
        carry = text
    yield carry, True


def _cut_point(text: str, limit: int) -> int:
    """The last index <= ``limit`` of a whitespace character followed by a non-whitespace one (a
    word start: byte-level pre-tokenizers split there, so the pieces tokenize as the whole), or
    ``limit`` when the text has none there."""
    end = limit
    while end > 0:
        at = max(text.rfind(" ", 0, end), text.rfind("\n", 0, end), text.rfind("\t", 0, end))
        if at <= 0:
            break
        if not text[at + 1].isspace():
            return at
        end = at
    return limit


def _documents(path: Path, field: str, column: str) -> Iterator[str]:
    """The pieces of one input file's documents, for training a tokenizer (which needs no boundaries)."""
    return (piece for piece, _ in _pieces(path, field, column))


def _record(job: _Job) -> dict[str, Any]:
    st = os.stat(job.source)
    return {"source": job.source, "size": st.st_size, "mtime_ns": st.st_mtime_ns,
            "tokenizer_sha256": job.tokenizer_sha256, "dtype": job.dtype, "separator_id": job.separator_id}


def _tokenize_file(job: _Job) -> tuple[str, int, bool]:
    """Write one shard (in a worker process); returns (shard name, tokens, skipped)."""
    from tokenizers import Tokenizer

    shard, sidecar = Path(job.shard), Path(job.shard + ".json")
    try:
        record = _record(job)
        done = _read_json(sidecar) if shard.is_file() else None  # a torn sidecar only means: redo the shard
        if isinstance(done, dict) and isinstance(done.get("tokens"), int) and \
                {k: done.get(k) for k in record} == record:
            return shard.name, done["tokens"], True
        count = _write_shard(job, Tokenizer.from_file(job.tokenizer), shard)
        _write_atomic(sidecar, json.dumps({**record, "tokens": count}).encode())
    except OSError as exc:
        raise PrepareError(f"{exc.filename or job.source}: {exc.strerror or exc}; check that the input is readable "
                           "and --out has free space, then rerun (finished shards are kept)") from None
    return shard.name, count, False


def _write_shard(job: _Job, tok: Any, shard: Path) -> int:
    """Tokenize ``job.source`` into ``shard`` through a temporary file that no failure leaves behind."""
    import numpy as np  # not at the top: the CLI builds its parser from this module and must start fast

    tmp = shard.with_name(shard.name + f"{_TMP}{os.getpid()}")
    count = 0
    try:
        with open(tmp, "wb") as f:
            for batch in _batches(_pieces(Path(job.source), job.field, job.column)):
                encodings = tok.encode_batch([text for text, _ in batch], add_special_tokens=False)
                for enc, (_, last) in zip(encodings, batch):
                    ids = [*enc.ids, job.separator_id] if last and job.separator_id is not None else enc.ids
                    np.asarray(ids, dtype=job.dtype).tofile(f)
                    count += len(ids)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, shard)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return count


def _write_atomic(path: Path, data: bytes) -> None:
    """Write ``path`` under a temporary name and rename it, so a reader sees the old file or the new one."""
    from raytrain_ckpt.checkpoint.storage.posix import replace_file

    replace_file(path, data)


# --- the tokenizer ---------------------------------------------------------------------------------

def _train_tokenizer(files: list[Path], vocab_size: int, field: str, column: str) -> bytes:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[SEPARATOR],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator((doc for f in files for doc in _documents(f, field, column)), trainer=trainer)
    return tok.to_str(pretty=True).encode()  # pretty, as Tokenizer.save writes it


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _trained_vocab(out: Path, saved: bytes) -> int | None:
    """The --vocab-size the kept tokenizer was trained with (None: given, or unknown)."""
    from raytrain_ckpt.data.tokens import META_FILE

    marker = _read_json(out / MARKER_FILE)
    if isinstance(marker, dict) and marker.get("tokenizer_sha256") == _sha256(saved):
        return marker.get("trained_vocab_size")
    meta = _read_json(out / META_FILE)  # an output from before markers: its vocab size is the best guess
    if isinstance(meta, dict) and meta.get("tokenizer_sha256") == _sha256(saved):
        return meta.get("vocab_size")
    return None


def _tokenizer(out: Path, files: list[Path], tokenizer: Path | None, vocab_size: int | None,
               field: str, column: str) -> Path:
    """The tokenizer file the shards are written with: given, kept from an earlier run, or trained now."""
    saved = out / TOKENIZER_FILE
    kept = saved.read_bytes() if saved.is_file() else None
    if tokenizer is not None:
        # A copy beside the shards keeps them self-describing (decode, hash check) wherever they move.
        data, trained = tokenizer.read_bytes(), None
    elif vocab_size is not None:
        if kept is not None and _trained_vocab(out, kept) == vocab_size:
            return saved
        if kept is not None:
            logger.info("%s was not trained with --vocab-size %d: training a new one (every shard is redone)",
                        saved, vocab_size)
        logger.info("training a byte-level BPE tokenizer (vocab %d) on %d file(s)", vocab_size, len(files))
        data, trained = _train_tokenizer(files, vocab_size, field, column), vocab_size
    elif kept is not None:
        return saved  # an earlier run made it: keep it, so its shards stay valid
    else:
        raise PrepareError("give --tokenizer PATH/tokenizer.json, or --vocab-size N to train a byte-level BPE")
    _save_tokenizer(out, data, kept, trained)
    return saved


def _save_tokenizer(out: Path, data: bytes, kept: bytes | None, trained: int | None) -> None:
    """Record ``data`` in the marker, then make it ``tokenizer.json``.

    The marker first: once it names the new hash, a crash before the rename cannot pass the old
    tokenizer off as the one trained with this vocab size. A given tokenizer that is already there
    keeps its record (the vocab size it was trained with, if it was)."""
    digest = _sha256(data)
    old = _read_json(out / MARKER_FILE)
    same = isinstance(old, dict) and old.get("tokenizer_sha256") == digest
    new = {"written_by": "raytrain-ckpt prepare-data", "tokenizer_sha256": digest, "trained_vocab_size": trained}
    if not (same and trained is None) and new != old:
        _write_atomic(out / MARKER_FILE, json.dumps(new).encode())
    if data != kept:
        _write_atomic(out / TOKENIZER_FILE, data)


# --- the run -------------------------------------------------------------------------------------

def prepare_data(inputs: list[Path], out: Path | str, *, tokenizer: Path | None = None, vocab_size: int | None = None,
                 field: str = "text", column: str = "text", workers: int = 1, progress: bool = True) -> dict[str, Any]:
    """Tokenize ``inputs`` into shards under ``out``; returns the metadata written to ``meta.json``.

    Raises:
        PrepareError: For bad flags, an ``--out`` that cannot be written or belongs to something
            else, a missing or malformed tokenizer, missing inputs, or an input that cannot be read
            (a JSONL line that is not UTF-8 or JSON or lacks the field, a file that is not Parquet).
    """
    if is_uri(out):  # as a Path, s3://b/x would be a local folder named "s3:"; nothing writes to a store here
        raise PrepareError(f"--out {out}: must be a local directory (data.path reads token shards from a local or "
                           "shared file system, not an object store); give a path such as data/tokens")
    _check_flags(tokenizer, vocab_size, workers)
    out = _expand(Path(out), "--out")
    tokenizer = None if tokenizer is None else _expand(tokenizer, "--tokenizer")
    inputs = [_expand(p, "input") for p in inputs]
    _check_out(out)
    if tokenizer is not None:
        if not tokenizer.is_file():
            raise PrepareError(f"--tokenizer {tokenizer}: no such file; give a Hugging Face tokenizer.json")
        _load_tokenizer(tokenizer, f"--tokenizer {tokenizer}",
                        "give the tokenizer.json a Hugging Face tokenizer saves (Tokenizer.save)")
    files = _input_files(inputs)
    made = _missing_dirs(out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        _remove_empty(made)
        raise PrepareError(f"--out {out}: cannot be created ({exc.strerror}); give a directory you can write") from None
    try:
        return _prepare(files, out, tokenizer, vocab_size, field, column, workers, progress)
    except BaseException:
        _remove_empty(made)
        raise


def _missing_dirs(out: Path) -> list[Path]:
    """The directories ``out.mkdir(parents=True)`` is about to create, deepest first."""
    missing = []
    while not out.exists() and out != out.parent:
        missing.append(out)
        out = out.parent
    return missing


def _remove_empty(dirs: list[Path]) -> None:
    """Remove the directories this run created if it failed before writing anything into them."""
    for d in dirs:
        try:
            d.rmdir()
        except FileNotFoundError:  # mkdir failed before making it
            continue
        except OSError:  # not empty: the tokenizer or finished shards are there, kept for the rerun
            return


def _prepare(files: list[Path], out: Path, tokenizer: Path | None, vocab_size: int | None, field: str,
             column: str, workers: int, progress: bool) -> dict[str, Any]:
    from raytrain_ckpt.data.tokens import META_FILE  # data.tokens imports torch: not for `--help` or `validate`

    try:
        tok_path = _tokenizer(out, files, tokenizer, vocab_size, field, column)
    except OSError as exc:
        raise PrepareError(f"{exc.filename or out / TOKENIZER_FILE}: {exc.strerror or exc}; check that the inputs "
                           "are readable and --out has free space, then rerun") from None
    tok = _load_tokenizer(tok_path, str(tok_path), f"delete {out} (or give another --out) and rerun to start fresh")
    vocab = tok.get_vocab_size(with_added_tokens=True)
    dtype = "uint16" if vocab <= 1 << 16 else "uint32"
    digest = _sha256(tok_path.read_bytes())
    jobs = [_Job(str(f.resolve()), str(out / f"{i:05d}-{f.stem}.bin"), str(tok_path), digest, dtype,
                 tok.token_to_id(SEPARATOR), field, column) for i, f in enumerate(files)]
    shards = _run_jobs(jobs, workers, progress)
    meta = {"tokenizer_sha256": digest, "tokenizer": TOKENIZER_FILE, "vocab_size": vocab, "dtype": dtype,
            "separator_id": jobs[0].separator_id,
            "num_tokens": sum(shards.values()), "shards": dict(sorted(shards.items()))}
    try:
        _write_atomic(out / META_FILE, json.dumps(meta, indent=1).encode())
    except OSError as exc:
        raise PrepareError(f"{out / META_FILE}: cannot be written ({exc.strerror}); free space and rerun "
                           "(the shards are kept)") from None
    return meta


def _run_jobs(jobs: list[_Job], workers: int, progress: bool) -> dict[str, int]:
    from concurrent.futures.process import BrokenProcessPool

    from tqdm import tqdm

    # More processes than files, or than CPUs, only cost memory and start-up time.
    workers = min(workers, len(jobs), os.cpu_count() or 1)
    shards: dict[str, int] = {}
    skipped = 0
    pool = ProcessPoolExecutor(max_workers=workers)
    try:
        with tqdm(total=len(jobs), unit="file", desc="prepare-data", disable=not progress) as bar:
            for fut in as_completed([pool.submit(_tokenize_file, job) for job in jobs]):
                name, count, was_done = fut.result()
                shards[name] = count
                skipped += was_done
                bar.update(1)
    except BrokenProcessPool:
        raise PrepareError(f"a worker process died (killed, or out of memory); rerun, with fewer --workers than "
                           f"{workers} if memory is short (finished shards are kept)") from None
    finally:
        pool.shutdown(wait=True, cancel_futures=True)  # after an error, report it without tokenizing the rest
        _remove_temporaries(jobs)
    if skipped:
        logger.info("%d of %d shard(s) were already written with this tokenizer: kept", skipped, len(jobs))
    return shards


def _remove_temporaries(jobs: list[_Job]) -> None:
    """Remove the temporary files of these shards that a killed worker (this run's or an earlier
    one's) left behind; a worker that fails removes its own. Runs once no worker is left."""
    prefixes = tuple(Path(job.shard).name + ext + _TMP for job in jobs for ext in ("", ".json"))
    out = Path(jobs[0].shard).parent
    for name in os.listdir(out):
        if name.startswith(prefixes):
            (out / name).unlink(missing_ok=True)


# --- command line -----------------------------------------------------------------------------

def add_parser(sub: Any) -> None:
    """Add ``prepare-data`` to the CLI's subparsers."""
    p = sub.add_parser("prepare-data", help="tokenize text / JSONL / Parquet files into shards for data.source=tokens")
    p.add_argument("inputs", nargs="+", type=Path, help="files or directories (.txt .md ... .jsonl .parquet)")
    p.add_argument("--out", required=True, help="output directory (local): data.path of the job")
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
        return ExitCode.USAGE
    print(f"{meta['num_tokens']} tokens in {len(meta['shards'])} shard(s) ({meta['dtype']}, vocab {meta['vocab_size']}) "
          f"in {args.out}; use data.source=tokens, data.path={args.out}, data.dtype={meta['dtype']}, "
          f"model vocab_size >= {meta['vocab_size']}")
    return ExitCode.OK
