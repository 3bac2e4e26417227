"""Shard files for the sharded-source tests: the same regression samples as JSON lines, tar and Parquet.

Sample ``i`` is ``{"x": 8 floats, "y": 1 float}`` drawn from a seeded generator, so every format and
every location (local disk, the test S3 server) holds the same samples; :func:`decode` turns one into
the ``(inputs, targets)`` pair ``loss_fn`` takes.
"""

from __future__ import annotations

import io
import json
import tarfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import IterableDataset


def samples(n: int, seed: int = 7) -> list[dict[str, Any]]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    y = x.sum(1, keepdim=True) * 0.3 + 0.1 * torch.randn(n, 1, generator=g)
    return [{"x": x[i].tolist(), "y": y[i].tolist()} for i in range(n)]


def decode(sample: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """A JSON-lines or Parquet sample -> ``(x, y)`` tensors."""
    return torch.tensor(sample["x"]), torch.tensor(sample["y"])


def decode_tar(sample: dict[str, bytes]) -> tuple[torch.Tensor, torch.Tensor]:
    """A WebDataset tar sample (``.json`` member) -> ``(x, y)`` tensors."""
    return decode(json.loads(sample["json"]))


def write_jsonl(directory: Path, rows: list[dict[str, Any]], shards: int) -> list[Path]:
    """``rows`` split over ``shards`` files ``part-NNN.jsonl``, in order."""
    directory.mkdir(parents=True, exist_ok=True)
    per = -(-len(rows) // shards)
    paths = []
    for s in range(shards):
        path = directory / f"part-{s:03d}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows[s * per : (s + 1) * per]))
        paths.append(path)
    return paths


def write_tar(path: Path, rows: list[dict[str, Any]]) -> Path:
    """One WebDataset tar: sample ``i`` is ``{i:06d}.json`` and ``{i:06d}.cls``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w") as tar:
        for i, row in enumerate(rows):
            for ext, data in (("json", json.dumps(row).encode()), ("cls", str(i).encode())):
                info = tarfile.TarInfo(f"{i:06d}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return path


def write_parquet(path: Path, rows: list[dict[str, Any]], row_group_size: int) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=row_group_size)
    return path


class JsonlStream(IterableDataset):
    """Today's streaming path for the same shards: each pass reads every shard in order, whole.

    What a user writes without a sharded source; the trainer gives every rank the whole stream, so
    at world size D the shards are read D times per pass (the comparison in the amplification tests).
    """

    def __init__(self, urls: list[str]) -> None:
        self.urls = urls

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        import fsspec

        for url in self.urls:
            with fsspec.open(url, "rb") as f:
                for line in f:
                    if line.strip():
                        yield decode(json.loads(line))
