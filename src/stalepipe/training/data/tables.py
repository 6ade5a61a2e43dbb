"""Documents from columnar files: Parquet (how FineWeb and most HF datasets ship) and Arrow (what
an HF `datasets` `save_to_disk` directory holds: `data-0000i-of-0000n.arrow` files in Arrow's
streaming IPC format, beside `dataset_info.json` and `state.json`).

One document per row, the text from a named string column (`--text-column`, default `text`),
read a record batch at a time so a large shard never sits in memory whole. pyarrow is an extra
(`pip install 'stalepipe[data]'`); without it a table is one line naming that command.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from stalepipe.errors import DataError
from stalepipe.lazy import require

TABLE_SUFFIXES = (".parquet", ".arrow")
BATCH_ROWS = 1024


def _pyarrow(path: Path) -> Any:
    pyarrow = require("pyarrow", f"reading {path.name}")
    require("pyarrow.ipc", f"reading {path.name}")
    require("pyarrow.parquet", f"reading {path.name}")
    return pyarrow


def _unreadable(path: Path, e: BaseException) -> DataError:
    kind = "Parquet" if path.suffix == ".parquet" else "Arrow"
    reason = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
    return DataError(f"{path} is not a readable {kind} file ({reason})")


def _open(path: Path, column: str) -> Callable[[], Iterator[Any]]:
    """The file's record batches of `column`, as a function, once its schema is checked
    (DataError, one line: unreadable, no such column, not a string column)."""
    pa = _pyarrow(path)
    try:
        if path.suffix == ".parquet":
            table = pa.parquet.ParquetFile(path)
            schema = table.schema_arrow
            reader = lambda: table.iter_batches(batch_size=BATCH_ROWS, columns=[column])  # noqa: E731
        else:
            source = pa.memory_map(str(path))
            try:  # datasets writes the streaming format; the file format is read too
                stream = pa.ipc.open_stream(source)
            except pa.ArrowInvalid:
                stream = pa.ipc.open_file(source)
            schema = stream.schema
            reader = lambda: _arrow_batches(stream)  # noqa: E731
    except (pa.ArrowException, OSError) as e:
        raise _unreadable(path, e) from None
    if column not in schema.names:
        names = schema.names
        shown = ", ".join(names[:8]) + (", ..." if len(names) > 8 else "")
        raise DataError(
            f"{path} has no column {column!r} (its columns: {shown}); pass --text-column NAME"
        )
    kind = schema.field(column).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        raise DataError(
            f"{path}: column {column!r} holds {kind}, not text; pass the name of a string "
            f"column with --text-column"
        )
    return reader


def check_table(path: Path, column: str) -> None:
    """Refuse now (one line) a table the corpus could not read `column` of: before any
    progress bar, and before anything is written."""
    _open(path, column)


def _arrow_batches(stream: Any) -> Iterator[Any]:
    if hasattr(stream, "num_record_batches"):  # the file format
        for i in range(stream.num_record_batches):
            yield stream.get_batch(i)
    else:
        yield from stream


def table_rows(path: Path, name: str, column: str) -> Iterator[tuple[str, str]]:
    """`(name:row, text)` of each row whose `column` holds a non-empty string (rows from 1,
    null cells skipped), a record batch at a time."""
    pa, row = _pyarrow(path), 0
    try:
        for batch in _open(path, column)():
            for text in batch.column(batch.schema.get_field_index(column)).to_pylist():
                row += 1
                if text:
                    yield f"{name}:{row}", text
    except (pa.ArrowException, OSError) as e:
        raise _unreadable(path, e) from None
