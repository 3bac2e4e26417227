"""Canonical weights out of a checkpoint, without the model or a process group.

Every built-in strategy stores the model in torch.distributed.checkpoint
(DCP) format under the model's own parameter names (``state/``, keys
``model.<name>``), whatever its sharding; DeepSpeed strategies write that copy
beside their own files. :func:`canonical_state` reads those entries into
plain CPU tensors (floating point in fp32, the canonical form) and
:func:`export_safetensors` writes them as a safetensors file that
``safetensors.torch.load_file`` reads straight into the user's plain
``nn.Module`` with ``load_state_dict``. :func:`export_hf` loads them into a
freshly built Hugging Face model and writes it with transformers' own
``save_pretrained`` (``config.json``, safetensors shards and
``model.safetensors.index.json`` when sharded), the layout
``AutoModelForCausalLM.from_pretrained`` reads.

The checkpoint is verified against its manifest first: DCP's metadata file is
a pickle, and it is only opened once its sha256 matches.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from unison.checkpointing.manifest import verify
from unison.checkpointing.storage import LocalStorage

_PREFIX = "model."


def canonical_state(path: str | Path, storage: LocalStorage | None = None) -> dict[str, torch.Tensor]:
    """The model's full state from the checkpoint at ``path`` (verified first)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    path = Path(path)
    storage = storage or LocalStorage()
    verify(storage, path)
    state_dir = storage.localize(path / "state")  # object storage: the verified files, downloaded
    reader = dcp.FileSystemReader(str(state_dir))
    metadata = reader.read_metadata()
    wanted = {
        key: torch.empty(md.size, dtype=md.properties.dtype)
        for key, md in metadata.state_dict_metadata.items()
        if key.startswith(_PREFIX) and isinstance(md, TensorStorageMetadata)
    }
    if not wanted:
        raise ValueError(f"{state_dir} holds no model tensors (keys '{_PREFIX}*')")
    with warnings.catch_warnings():
        # DCP warns that it runs without a process group: that is the intent here.
        warnings.filterwarnings("ignore", message=".*torch.distributed.*")
        dcp.load(wanted, storage_reader=dcp.FileSystemReader(str(state_dir)), no_dist=True)
    return {key[len(_PREFIX) :]: (t.float() if t.is_floating_point() else t).contiguous() for key, t in wanted.items()}


def export_safetensors(
    path: str | Path, out: str | Path, storage: LocalStorage | None = None
) -> dict[str, torch.Tensor]:
    """Write the canonical weights of the checkpoint at ``path`` to ``out`` (safetensors); returns them."""
    from safetensors.torch import save_file

    from unison.checkpointing.manifest import Manifest

    storage = storage or LocalStorage()
    state = canonical_state(path, storage)
    manifest = Manifest.read(storage, Path(path))
    save_file(
        state,
        str(out),
        metadata={
            "unison_step": str(manifest.step),
            "unison_strategy": manifest.strategy,
            "unison_run": manifest.run,
            "format": "pt",
        },
    )
    return state


def export_hf(
    path: str | Path,
    out: str | Path,
    build_model: Callable[[], Any],
    storage: LocalStorage | None = None,
    max_shard_size: int | str = "5GB",
) -> dict[str, torch.Tensor]:
    """Write the checkpoint at ``path`` as a Hugging Face ``save_pretrained`` directory ``out``; returns the weights.

    ``build_model`` builds the run's model (the config's model factory); it
    must be a transformers ``PreTrainedModel``. The canonical weights are
    loaded into it strictly (every key, every shape), then ``save_pretrained``
    writes ``config.json`` and safetensors files of at most ``max_shard_size``
    each, with ``model.safetensors.index.json`` when there is more than one.
    Raises :class:`ValueError` when the model is not a transformers model or
    its parameters do not match the checkpoint.
    """
    storage = storage or LocalStorage()
    model = build_model()
    if not callable(getattr(model, "save_pretrained", None)) or not hasattr(model, "config"):
        raise ValueError(
            f"the run's model is a {type(model).__name__}, not a transformers PreTrainedModel "
            "(no save_pretrained); export it with --format safetensors"
        )
    state = canonical_state(path, storage)
    expected = model.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    wrong = sorted(k for k in set(expected) & set(state) if tuple(expected[k].shape) != tuple(state[k].shape))
    if missing or unexpected or wrong:
        problems = [
            f"{label}: {', '.join(keys[:5])}{' ...' if len(keys) > 5 else ''}"
            for label, keys in (("missing", missing), ("unexpected", unexpected), ("shape differs", wrong))
            if keys
        ]
        raise ValueError(f"the checkpoint at {path} does not fit the run's model ({'; '.join(problems)})")
    model.load_state_dict(state, strict=True)
    model.save_pretrained(str(out), max_shard_size=max_shard_size, safe_serialization=True)
    return state
