"""Writing rows to a file for `Dataset.save_as`: the formats by extension and the CSV writer."""

from __future__ import annotations

import csv
import io
import json

from twinkle.dataset._rows import Row

# save_as: a file extension -> its format (upstream's; others are jsonl)
_FORMATS = {"jsonl": "jsonl", "json": "json", "csv": "csv", "parquet": "parquet", "pq": "parquet"}


def _write_csv(f: io.TextIOBase, rows: list[Row]) -> None:
    """`rows` as CSV into `f`: every column any row has, in first-seen order; a list or dict
    value as its JSON, a missing one empty."""
    columns = list(dict.fromkeys(k for row in rows for k in row))
    writer = csv.writer(f)
    writer.writerow(columns)
    for row in rows:
        values = [row.get(c, "") for c in columns]
        writer.writerow(
            json.dumps(v, ensure_ascii=False) if isinstance(v, list | dict) else v for v in values
        )
