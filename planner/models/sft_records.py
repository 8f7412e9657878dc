"""Fine-tuning records: read from a file a record at a time, and each one checked and classified
into one of the formats TRL 1.16's ``SFTTrainer`` reads.

A record is one example: ``{"text": ...}`` (the field named by ``--text-field``),
``{"messages": [...]}``, or ``{"prompt", "completion"}``, both strings or both lists of
messages. ``FORMATS`` is the one table of them; the CLI help, detection and the tokeniser
read it. Sources (``SOURCES``): JSON lines, a JSON file holding a list of records (parsed a
record at a time, never whole), Parquet (read a row group batch at a time with pyarrow), and
a directory written by ``datasets``' ``save_to_disk`` (memory-mapped Arrow, via
``datasets.load_from_disk``).

Every refusal names the file, where in it (``line N`` of a text file, ``record N`` of a
table, counted from 1) and the field, and ends with the fix. A file holds one format: the
first record decides it, and a later record of another format is refused (TRL reads one
format per data set too; a mix would be trained under the first record's loss rule).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from protrain.plans.errors import ConfigError


@dataclass(frozen=True)
class Format:
    name: str
    fields: tuple[str, ...]  # the fields that identify it ("text" stands for --text-field)
    conversational: bool  # rendered with the chat template
    help: str


FORMATS = {
    f.name: f
    for f in (
        Format("text", ("text",), False, '{"text": "..."} (the field set by --text-field)'),
        Format("messages", ("messages",), True, '{"messages": [{"role", "content"}, ...]}'),
        Format(
            "prompt-completion",
            ("prompt", "completion"),
            False,
            '{"prompt": "...", "completion": "..."}',
        ),
        Format(
            "conversational prompt-completion",
            ("prompt", "completion"),
            True,
            '{"prompt": [messages], "completion": [messages]}',
        ),
    )
}
"""The record formats, as TRL 1.16 reads them (``trl.data_utils.is_conversational``)."""

ROLES = ("system", "user", "assistant", "tool")
"""Message roles a record may use: what chat templates render (TRL's turns)."""

SOURCES = {
    ".jsonl": "JSON lines, one record per line",
    ".ndjson": "JSON lines, one record per line",
    ".json": "a JSON list of records",
    ".parquet": "a Parquet table, one record per row",
    "directory": "a `datasets` save_to_disk directory (needs the datasets package)",
}
"""Where records come from, by file suffix (``directory``: a ``save_to_disk`` folder)."""

_BATCH_ROWS = 1024  # Parquet/Arrow rows converted to Python at a time


@dataclass(frozen=True)
class Record:
    where: str  # "file, line 7" / "file, record 7": the prefix of every message about it
    fields: dict  # the record's fields as read
    format: Format
    done: tuple[int, int]  # (read, total) of the source, in bytes or rows: for a progress bar


def read(path: str, text_field: str = "text") -> Iterator[Record]:
    """Every record of ``path`` in file order, checked and classified (module docstring)."""
    first: Format | None = None
    for where, obj, done in _raw(Path(path)):
        fmt = classify(obj, where, text_field)
        if first is None:
            first = fmt
        elif fmt is not first:
            raise ConfigError(
                f"{where}: a {fmt.name} record in a file of {first.name} records (its first "
                "record's format)",
                hint="keep one format per file: split the file, or convert these records",
            )
        yield Record(where, obj, fmt, done)
    if first is None:
        raise ConfigError(f"{path}: no records", hint="pass a file with at least one record")


def first_object(path: Path):
    """The first record of a JSON-lines file as decoded (None: no record), unchecked: what
    ``protrain train`` looks at to tell chat and instruction data from raw text."""
    for _, obj, _ in _jsonl(Path(path)):
        return obj
    return None


def classify(obj, where: str, text_field: str = "text") -> Format:
    """The format of one record; refuses a record that is none of ``FORMATS`` or is malformed."""
    if not isinstance(obj, dict):
        raise ConfigError(
            f"{where}: the record is a JSON {_kind(obj)}, not an object",
            hint='write one object per record, e.g. {"messages": [...]}',
        )
    if "messages" in obj:
        _messages(obj["messages"], f"{where}, field 'messages'")
        return FORMATS["messages"]
    if "prompt" in obj or "completion" in obj:
        for key in ("prompt", "completion"):
            if key not in obj:
                raise ConfigError(
                    f"{where}: field {key!r} is missing (a prompt/completion record has both)",
                    hint=f"add {key!r} to that record, or drop the record",
                )
        prompt, completion = obj["prompt"], obj["completion"]
        if isinstance(prompt, str) and isinstance(completion, str):
            return FORMATS["prompt-completion"]
        if isinstance(prompt, list) and isinstance(completion, list):
            _messages(prompt, f"{where}, field 'prompt'")
            _messages(completion, f"{where}, field 'completion'")
            return FORMATS["conversational prompt-completion"]
        raise ConfigError(
            f"{where}: field 'prompt' is a {_kind(prompt)} and 'completion' a "
            f"{_kind(completion)}; both must be strings or both lists of messages",
            hint="make both plain text, or both conversational",
        )
    if text_field in obj:
        if not isinstance(obj[text_field], str):
            raise ConfigError(
                f"{where}: field {text_field!r} is a {_kind(obj[text_field])}, not a string",
                hint="put the text in that field as a JSON string",
            )
        _text(obj[text_field], f"{where}, field {text_field!r}")
        return FORMATS["text"]
    keys = ", ".join(sorted(map(str, obj))) or "none"
    raise ConfigError(
        f"{where}: no field of a known format (found: {keys}); expected one of: "
        + "; ".join(f.help for f in FORMATS.values()),
        hint="name the field that holds plain text with --text-field, or convert the records",
    )


def _messages(value, where: str) -> None:
    if not isinstance(value, list) or not value:
        what = "an empty list" if value == [] else f"a {_kind(value)}"
        raise ConfigError(
            f"{where}: {what}, not a list of messages",
            hint='write [{"role": "user", "content": "..."}, ...]',
        )
    for i, m in enumerate(value):
        at = f"{where}[{i}]"
        if not isinstance(m, dict):
            raise ConfigError(
                f"{at}: a {_kind(m)}, not a message", hint='write {"role": ..., "content": ...}'
            )
        role = m.get("role")
        if role not in ROLES:
            import difflib

            near = difflib.get_close_matches(str(role), ROLES, n=1)
            mean = f" (did you mean {near[0]!r}?)" if near else ""
            raise ConfigError(
                f"{at}.role: {role!r} is not a role{mean}; roles are {', '.join(ROLES)}",
                hint="fix the role of that message",
            )
        content = m.get("content")
        if not isinstance(content, str):
            raise ConfigError(
                f"{at}.content: a {_kind(content)}, not a string",
                hint="write the message's text as a JSON string",
            )
        _text(content, f"{at}.content")


def _text(text: str, where: str) -> None:
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ConfigError(
            f"{where}: a lone surrogate {text[e.start]!r} at character {e.start}, which is not "
            "Unicode text",
            hint="fix that record (a surrogate pair, or the character itself, escaped in JSON)",
        ) from None


def _kind(obj) -> str:
    names = {dict: "object", list: "list", str: "string", bool: "boolean", type(None): "null"}
    return names.get(type(obj), "number" if isinstance(obj, (int, float)) else type(obj).__name__)


# ------------------------------------------------------------------ sources


Raw = Iterator[tuple[str, object, tuple[int, int]]]


def _raw(path: Path) -> Raw:
    """(where, decoded record, (read, total)) of every record in ``path``, in file order."""
    if path.is_dir():
        yield from _dataset_dir(path)
        return
    suffix = path.suffix.lower()
    if suffix not in SOURCES:
        raise ConfigError(
            f"{path}: cannot read {suffix or 'a file without a suffix'} as fine-tuning data; "
            "it reads " + "; ".join(f"{k} ({v})" for k, v in SOURCES.items()),
            hint="convert the file to JSON lines (one record per line) and name it .jsonl",
        )
    from .data import regular_file

    regular_file(path, "data file", "save the records to a file and pass that with --data")
    if suffix == ".parquet":
        yield from _parquet(path)
    elif suffix == ".json":
        yield from _json_list(path)
    else:
        yield from _jsonl(path)


def _jsonl(path: Path) -> Raw:
    total, read = path.stat().st_size, 0
    with open(path, "rb") as f:
        for i, raw in enumerate(f, start=1):  # a line at a time: memory bounded by the longest
            read += len(raw)
            if not raw.strip():
                continue
            where = f"{path}, line {i}"
            try:
                obj = json.loads(raw)
            except (ValueError, RecursionError) as e:
                raise ConfigError(
                    f"{where}: not JSON ({e})", hint="fix that line: one JSON object per line"
                ) from None
            yield where, obj, (read, total)


_JSON_READ_BYTES = 1 << 20


def _json_list(path: Path) -> Raw:
    """The elements of a top-level JSON list, decoded one at a time from a sliding window of the
    file (``raw_decode`` on a buffer that grows only while an element is incomplete), so memory
    is bounded by the largest record, not the file."""
    decoder = json.JSONDecoder()
    total, dropped = path.stat().st_size, 0  # dropped: characters consumed before ``buf``
    with open(path, encoding="utf-8", errors="surrogatepass") as f:
        buf, pos, line, n = f.read(_JSON_READ_BYTES), 0, 1, 0
        eof = len(buf) < _JSON_READ_BYTES

        def skip(chars: str) -> None:
            nonlocal pos, line
            while pos < len(buf) and buf[pos] in chars:
                line += buf[pos] == "\n"
                pos += 1

        skip(" \t\r\n\ufeff")
        if buf[pos : pos + 1] != "[":
            raise ConfigError(
                f"{path}, line {line}: a .json data file must hold a JSON list of records",
                hint="write [{...}, {...}], or one object per line in a .jsonl file",
            )
        pos += 1
        while True:
            skip(" \t\r\n")
            if buf[pos : pos + 1] == "]":
                return
            try:
                obj, end = decoder.raw_decode(buf, pos)
            except (ValueError, RecursionError) as e:
                if not eof:  # the element may end past the window: read more, try again
                    more = f.read(_JSON_READ_BYTES)
                    eof = len(more) < _JSON_READ_BYTES
                    dropped += pos
                    buf, pos = buf[pos:] + more, 0
                    continue
                raise ConfigError(
                    f"{path}, record {n + 1} (line {line}): not JSON ({e})",
                    hint="fix that record; the file must be one JSON list of objects",
                ) from None
            if end == len(buf) and not eof:  # a number may go on past the window
                more = f.read(_JSON_READ_BYTES)
                eof = len(more) < _JSON_READ_BYTES
                dropped += pos
                buf, pos = buf[pos:] + more, 0
                continue
            n += 1
            done = min(dropped + end, total)  # characters, about bytes: for progress only
            yield f"{path}, record {n} (line {line})", obj, (done, total)
            line += buf.count("\n", pos, end)
            pos = end
            skip(" \t\r\n")
            if buf[pos : pos + 1] == ",":
                pos += 1
            elif buf[pos : pos + 1] != "]":
                raise ConfigError(
                    f"{path}, record {n} (line {line}): expected ',' or ']' after the record",
                    hint="fix the list: records separated by commas, closed by ]",
                )
            if pos > _JSON_READ_BYTES and not eof:  # drop what was read, keep the window small
                more = f.read(_JSON_READ_BYTES)
                eof = len(more) < _JSON_READ_BYTES
                dropped += pos
                buf, pos = buf[pos:] + more, 0


def _parquet(path: Path) -> Raw:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ConfigError(
            f"{path}: reading Parquet needs the pyarrow package, which is not installed",
            hint='pip install -e ".[sft]"',
        ) from None
    try:
        table = pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises ArrowInvalid (an Exception) on a damaged file
        raise ConfigError(f"{path}: not a Parquet file ({e})", hint="write it again") from None
    n, total = 0, table.metadata.num_rows
    for batch in table.iter_batches(batch_size=_BATCH_ROWS):  # a row group at a time
        for obj in batch.to_pylist():
            n += 1
            yield f"{path}, record {n}", _drop_nulls(obj), (n, total)


def _dataset_dir(path: Path) -> Raw:
    if not (path / "dataset_info.json").is_file() and not (path / "dataset_dict.json").is_file():
        raise ConfigError(
            f"{path} is a directory but not one `datasets` wrote (no dataset_info.json)",
            hint="pass a file, or a directory written by Dataset.save_to_disk",
        )
    if (path / "dataset_dict.json").is_file():
        splits = json.loads((path / "dataset_dict.json").read_text()).get("splits", [])
        raise ConfigError(
            f"{path} holds several splits ({', '.join(splits)}), not one data set",
            hint=f"pass one split's directory, e.g. --data {path / (splits or ['train'])[0]}",
        )
    try:
        import datasets
    except ImportError:
        raise ConfigError(
            f"{path}: reading a save_to_disk directory needs the datasets package, which is "
            "not installed",
            hint='pip install -e ".[sft]"',
        ) from None
    data = datasets.load_from_disk(os.fspath(path))  # memory-mapped Arrow: nothing read yet
    n, total = 0, len(data)
    for batch in data.with_format("arrow").iter(batch_size=_BATCH_ROWS):
        for obj in batch.to_pylist():
            n += 1
            yield f"{path}, record {n}", _drop_nulls(obj), (n, total)


def _drop_nulls(obj: dict) -> dict:
    """A table row without its null columns: a table holds every column in every row, so a row
    of a mixed table has ``None`` where a JSON record would have no key. Message dicts lose
    their null keys the same way (an Arrow struct has every key of every message)."""
    out = {}
    for k, v in obj.items():
        if v is None:
            continue
        if isinstance(v, list) and v and all(isinstance(m, dict) for m in v):
            v = [{mk: mv for mk, mv in m.items() if mv is not None} for m in v]
        out[k] = v
    return out
