"""What ``prepare-data`` reads of a JSONL or Parquet input (its documents, one text field or column
each) and how pieces are batched for the tokenizer; every way an input is malformed is a
``PrepareError`` naming the file (and the line).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

__all__ = ["BATCH_CHARS", "PrepareError"]

_BATCH = 256
BATCH_CHARS = 1 << 20
"""Characters tokenized in one batch (at most _BATCH pieces)."""


class PrepareError(ValueError):
    """A user mistake (a missing input, a field that is not there): one line, exit code 2."""


def _jsonl_documents(path: Path, field: str) -> Iterator[str]:
    # Read as bytes and decode line by line, so that a byte that is not UTF-8 is reported with its line.
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise PrepareError(f"{path}:{lineno}: not UTF-8 (byte 0x{raw[exc.start]:02x} at column "
                                   f"{exc.start + 1}); save the file as UTF-8") from None
            if not line.strip():
                continue
            yield _jsonl_text(line, field, f"{path}:{lineno}")


def _jsonl_text(line: str, field: str, where: str) -> str:
    """The text field of one JSONL line; every way a line can be malformed is a PrepareError naming ``where``."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        raise PrepareError(f"{where}: not JSON ({exc.msg}); each line must be one JSON object") from None
    except ValueError as exc:  # a number of thousands of digits: int() refuses to convert it
        raise PrepareError(f"{where}: holds a number too long to read ({str(exc).split(';')[0]}); "
                           "write it as a string, or drop the line") from None
    except RecursionError:
        raise PrepareError(f"{where}: nested too deep to read (thousands of [ or {{); each line must be one JSON "
                           "object with a text field") from None
    if not isinstance(record, dict) or not isinstance(record.get(field), str):
        raise PrepareError(f"{where}: no string field {field!r}; pick the text field with --field")
    text = record[field]
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:  # an escaped lone surrogate (\ud800): no tokenizer can take it
        raise PrepareError(f"{where}: field {field!r} holds a lone surrogate (\\u{ord(text[exc.start]):04x} at "
                           f"character {exc.start + 1}), half of a character; write the character itself") from None
    return text


def _parquet_documents(path: Path, column: str) -> Iterator[str]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.ParquetFile(path)
        schema = table.schema_arrow
        if column not in schema.names:
            raise PrepareError(f"{path}: no column {column!r} (columns: {schema.names}); pick it with --column")
        kind = schema.field(column).type
        value = kind.value_type if pa.types.is_dictionary(kind) else kind
        is_view = getattr(pa.types, "is_string_view", lambda _: False)  # pyarrow >= 16
        if not (pa.types.is_string(value) or pa.types.is_large_string(value) or is_view(value)):
            raise PrepareError(f"{path}: column {column!r} holds {kind}, not strings; "
                               "pick the text column with --column")
        for batch in table.iter_batches(columns=[column]):
            yield from (text for text in batch.column(0).to_pylist() if text)
    except pa.ArrowException as exc:
        reason = str(exc).splitlines()[0]
        raise PrepareError(f"{path}: not a readable Parquet file ({reason}); "
                           "convert it to Parquet, or give it the suffix of what it holds (.txt, .jsonl)") from None


def _batches(pieces: Iterator[tuple[str, bool]]) -> Iterator[list[tuple[str, bool]]]:
    batch: list[tuple[str, bool]] = []
    chars = 0
    for piece in pieces:
        batch.append(piece)
        chars += len(piece[0])
        if len(batch) == _BATCH or chars >= BATCH_CHARS:
            yield batch
            batch, chars = [], 0
    if batch:
        yield batch


# --- writing shards (in worker processes) --------------------------------------------------------
