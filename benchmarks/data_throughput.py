"""Sharded data: samples/s from local disk against an S3 server on loopback, and read amplification.

``python -m benchmarks.data_throughput`` writes JSON-lines shards, uploads them to a SeaweedFS server
it starts on 127.0.0.1 (the tests' ``tests/s3_server.py``; ``weed`` comes with the ``dev`` extra), and
measures:

* **samples/s**: one pass of world 1 through the trainer's own pieces (its :class:`BatchPlan`, the
  :class:`MicroBatchSampler` given to :meth:`ShardedDataset.follow_plan`, a ``DataLoader`` with 0 and N
  workers, ``default_collate``), reading a :class:`ShardedDataset` from local disk and from the server,
  under the trainer's global permutation, under the shard-order + window shuffle, and with runs of
  ``--chunk`` samples kept together (``shuffle_chunk``); samples/s in the steady state (from the first
  batch on), the seconds to the first batch apart (worker processes starting, each with its S3 client);
* **read amplification**: the bytes the server sent (its Prometheus counter
  ``SeaweedFS_s3_bucket_traffic_sent_bytes_total``) over one pass of every rank of world 1, 2 and 4,
  over the shards' bytes, for the sharded source and for today's iterable path (each rank runs the
  trainer's :class:`StreamMicroBatches` over a stream of the shards). The ranks of a world run one
  after the other in this process: the bytes each reads do not depend on when it reads them.

The shard indexes are built before anything is counted (a one-time read of each shard).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, default_collate

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

import s3_server  # noqa: E402  (the tests' server helper, found through the path above)

from unison.data.plan import BatchPlan  # noqa: E402
from unison.data.shards import ShardedDataset  # noqa: E402
from unison.data.streams import MicroBatchSampler, StreamMicroBatches  # noqa: E402

GLOBAL_BATCH, ACCUMULATE = 64, 2


def shuffles(window: int, chunk: int) -> list[tuple[str, int | None, int]]:
    """``(name, shuffle_window, shuffle_chunk)`` of each order measured."""
    return [("global", None, 1), (f"window {window}", window, 1), (f"window {window}, chunk {chunk}", window, chunk)]


def decode(sample: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.tensor(sample["x"]), torch.tensor(sample["y"])


class Stream(torch.utils.data.IterableDataset):
    """Today's streaming path: every shard read in order, whole."""

    def __init__(self, urls: list[str]) -> None:
        self.urls = urls

    def __iter__(self):
        import fsspec

        for url in self.urls:
            with fsspec.open(url, "rb") as f:
                for line in f:
                    yield decode(json.loads(line))


def write_shards(directory: Path, samples: int, shards: int, dim: int) -> list[Path]:
    g = torch.Generator().manual_seed(0)
    per = samples // shards
    paths = []
    for s in range(shards):
        path = directory / f"part-{s:03d}.jsonl"
        x = torch.randn(per, dim, generator=g)
        with open(path, "w") as f:
            for row in x.tolist():
                f.write(json.dumps({"x": [round(v, 5) for v in row], "y": [sum(row)]}) + "\n")
        paths.append(path)
    return paths


def one_pass(dataset: ShardedDataset, workers: int, world: int = 1, rank: int = 0) -> tuple[float, float]:
    """One pass of rank ``rank`` of ``world`` (the trainer's sampler and loader): samples/s in the steady
    state (from the first batch on) and the seconds to the first batch (worker processes starting, each
    with its own S3 client; once per pass, or once per fit with ``persistent_workers``)."""
    plan = BatchPlan(len(dataset), GLOBAL_BATCH, ACCUMULATE, world, rank, seed=0, order=dataset.epoch_order)
    sampler = MicroBatchSampler(plan, 0, plan.steps_per_epoch)
    dataset.follow_plan(sampler)  # as the trainer does: the dataset reads ahead along the plan
    loader = DataLoader(
        dataset,
        batch_sampler=sampler,
        collate_fn=default_collate,
        num_workers=workers,
        prefetch_factor=4 if workers else None,
    )
    start = time.perf_counter()
    batches = iter(loader)
    next(batches)
    first, count = time.perf_counter(), 0
    for x, _ in batches:
        count += len(x)
    return count / (time.perf_counter() - first), first - start


def stream_pass(urls: list[str], world: int, rank: int, steps: int) -> None:
    """Rank ``rank`` of ``world`` over today's iterable path: the trainer's stream cutter, one pass."""
    stream = StreamMicroBatches(Stream(urls), default_collate, GLOBAL_BATCH, ACCUMULATE, world, rank, 0, steps, None)
    for _ in stream:
        pass


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=16384)
    parser.add_argument("--shards", type=int, default=8)
    parser.add_argument("--dim", type=int, default=64, help="floats per sample (about 9 bytes each as JSON)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--window", type=int, default=1024, help="shuffle_window of the windowed runs")
    parser.add_argument("--chunk", type=int, default=32, help="shuffle_chunk of the chunked runs")
    parser.add_argument("--read-ahead", type=int, default=2 << 20, help="bytes each process reads ahead")
    parser.add_argument("--json", type=Path, help="also write the results here")
    return parser.parse_args(argv)


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Start the server, write and upload the shards, measure; the results as plain data."""
    work = Path(tempfile.mkdtemp(prefix="unison-data-bench-"))
    os.environ["UNISON_DATA_CACHE"] = str(work / "index")
    server = s3_server.start()
    saved = {k: os.environ.get(k) for k in server.env()}
    os.environ.update(server.env())
    results: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()}}
    try:
        paths = write_shards(work, args.samples, args.shards, args.dim)
        fs = server.fs()
        for path in paths:
            fs.put_file(str(path), f"{s3_server.BUCKET}/bench/{path.name}")
        urls = [f"s3://{s3_server.BUCKET}/bench/{p.name}" for p in paths]
        size = sum(p.stat().st_size for p in paths)
        results["dataset"] = {"samples": args.samples, "bytes": size, "shards": args.shards}
        where = {"local": str(work / "part-*.jsonl"), "s3": f"s3://{s3_server.BUCKET}/bench/part-*.jsonl"}
        throughput: list[dict[str, Any]] = []
        for shuffle, window, chunk in shuffles(args.window, args.chunk):
            for workers in (0, args.workers):
                row: dict[str, Any] = {"shuffle": shuffle, "workers": workers}
                for name, pattern in where.items():
                    dataset = ShardedDataset(
                        pattern, decode, shuffle_window=window, shuffle_chunk=chunk, read_ahead=args.read_ahead
                    )
                    row[name], row[f"{name} first batch s"] = one_pass(dataset, workers)
                    if name == "s3":
                        row["requests"] = dataset.stats.requests
                throughput.append(row)
        results["samples_per_s"] = throughput
        amplification: list[dict[str, Any]] = []
        ShardedDataset(where["s3"])  # the index, before counting
        steps = args.samples // GLOBAL_BATCH
        for world in (1, 2, 4):
            before = server.sent_bytes()
            for rank in range(world):
                one_pass(ShardedDataset(where["s3"], decode, read_ahead=args.read_ahead), 0, world, rank)
            sharded = (server.sent_bytes() - before) / size
            before = server.sent_bytes()
            for rank in range(world):
                stream_pass(urls, world, rank, steps)
            iterable = (server.sent_bytes() - before) / size
            amplification.append({"world": world, "sharded": sharded, "iterable": iterable})
        results["read_amplification"] = amplification
    finally:
        server.stop()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    return results


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse(argv)
    results = measure(args)
    data = results["dataset"]
    print(f"dataset: {data['samples']} samples, {data['bytes'] / 1e6:.1f} MB in {data['shards']} JSON-lines shards")
    print("samples/s (world 1, one pass): shuffle, workers, local, s3, s3 / local, s3 requests")
    for row in results["samples_per_s"]:
        ratio = row["s3"] / row["local"]
        print(
            f"  {row['shuffle']:16s} {row['workers']:2d} {row['local']:9.0f} {row['s3']:9.0f} {ratio:6.2f}"
            f" {row['requests']:7d}"
        )
    print("read amplification (server bytes sent / dataset bytes, one pass, all ranks): world, sharded, iterable")
    for row in results["read_amplification"]:
        print(f"  {row['world']} {row['sharded']:6.3f} {row['iterable']:6.3f}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    main()
