"""Canonical weights out of a checkpoint, without the model or a process group.

Every built-in strategy stores the model in torch.distributed.checkpoint
(DCP) format under the model's own parameter names (``state/``, keys
``model.<name>``), whatever its sharding; DeepSpeed strategies write that copy
beside their own files. :func:`canonical_state` reads those entries into
plain CPU tensors (floating point in fp32, the canonical form) and
:func:`export_safetensors` writes them as a safetensors file that
``safetensors.torch.load_file`` reads straight into the user's plain
``nn.Module`` with ``load_state_dict``.

The checkpoint is verified against its manifest first: DCP's metadata file is
a pickle, and it is only opened once its sha256 matches.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch

from unison.manifest import verify
from unison.storage import LocalStorage

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

    from unison.manifest import Manifest

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
