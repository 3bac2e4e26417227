"""Serialising unison's own checkpoint files so that loading them runs no code.

``torch.load`` unpickles, and a pickle can call any importable function. Every
file unison itself writes into a checkpoint (the trainer state, each rank's
RNG state) is therefore restricted to what ``torch.load(weights_only=True)``
accepts: tensors, numbers, strings, ``None``, and lists, tuples and dicts of
those. :func:`dumps` checks this when *saving*, so a plugin that stores an
arbitrary object fails at once with its name instead of producing a checkpoint
that cannot be resumed; :func:`loads` never accepts anything else.

RNG states are converted to that vocabulary (Python's and numpy's Mersenne
Twister states become int64 tensors).
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any

import numpy as np
import torch

from unison.errors import UnisonError


class UnsafeStateError(UnisonError):
    """State handed to the checkpointer that could not be loaded back without unpickling code."""


def dumps(obj: Any, what: str) -> bytes:
    """``torch.save`` bytes of ``obj``; refuses anything ``weights_only`` loading would refuse."""
    buffer = io.BytesIO()
    try:
        torch.save(obj, buffer)
    except (pickle.PicklingError, AttributeError, TypeError) as exc:
        raise UnsafeStateError(f"{what} cannot be saved: {exc}") from None
    buffer.seek(0)
    unsafe = torch.serialization.get_unsafe_globals_in_checkpoint(buffer)
    if unsafe:
        raise UnsafeStateError(
            f"{what} holds objects that a safe load cannot rebuild ({', '.join(sorted(unsafe))}); "
            "checkpoint state must be tensors, numbers, strings, None, and lists, tuples or dicts of those "
            "(convert other objects, e.g. with .tolist() or torch.as_tensor, in unison_on_save_checkpoint)"
        )
    return buffer.getvalue()


def loads(data: bytes, where: str) -> Any:
    """Load bytes written by :func:`dumps` with ``weights_only=True`` (no code runs)."""
    try:
        return torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as exc:
        raise UnsafeStateError(
            f"{where} is not a plain-data checkpoint file; refusing to unpickle it ({exc})"
        ) from None


# --------------------------------------------------------------------------- #
# RNG states in plain data.
# --------------------------------------------------------------------------- #
def encode_rng(state: dict[str, Any]) -> dict[str, Any]:
    """The dict of :func:`unison.contract.state.rng_state` as tensors and numbers only."""
    version, internal, gauss = state["python"]
    kind, keys, pos, has_gauss, cached = state["numpy"]
    out: dict[str, Any] = {
        "python": {
            "version": int(version),
            "state": torch.tensor(internal, dtype=torch.int64),
            "gauss": None if gauss is None else float(gauss),
        },
        "numpy": {
            "kind": str(kind),
            "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
        "torch": state["torch"].clone(),
    }
    if "cuda" in state:
        out["cuda"] = [t.clone() for t in state["cuda"]]
    return out


def decode_rng(data: dict[str, Any]) -> dict[str, Any]:
    """Inverse of :func:`encode_rng`: the dict :func:`unison.contract.state.set_rng_state` takes."""
    py, npy = data["python"], data["numpy"]
    state: dict[str, Any] = {
        "python": (py["version"], tuple(int(v) for v in py["state"].tolist()), py["gauss"]),
        "numpy": (
            npy["kind"],
            npy["keys"].numpy().astype(np.uint32),
            npy["pos"],
            npy["has_gauss"],
            npy["cached_gaussian"],
        ),
        "torch": data["torch"],
    }
    if "cuda" in data:
        state["cuda"] = data["cuda"]
    return state


# --------------------------------------------------------------------------- #
# Files written by backends in formats that unpickle on load.
# --------------------------------------------------------------------------- #
#: Modules whose classes a DCP ``.metadata`` pickle may name: DCP's own
#: dataclasses and enums, nothing that runs code when built.
_DCP_MODULES = (
    "torch.distributed.checkpoint.metadata",
    "torch.distributed.checkpoint.filesystem",
    "torch.distributed.checkpoint.planner",
    "torch.distributed.checkpoint._extension",
)
_DCP_GLOBALS = {
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("collections", "OrderedDict"),
    ("pathlib", "PosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PurePosixPath"),
    ("copyreg", "_reconstructor"),
    ("builtins", "object"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
}
#: Globals beyond ``weights_only``'s own that DeepSpeed's checkpoint files name
#: (measured): an enum, a dataclass and the loss scaler's attribute holder.
BACKEND_TORCH_GLOBALS: set[str] = {
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.runtime.zero.config.ZeroStageEnum",
    "deepspeed.utils.tensor_fragment.fragment_address",
}


class _RestrictedUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module.startswith(_DCP_MODULES) or (module, name) in _DCP_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(
            getattr(torch, name, None), (torch.dtype, torch.memory_format, torch.layout)
        ):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"global {module}.{name} is not allowed")


def check_dcp(directory: Path, storage: Any) -> list[tuple[str, str]]:
    """Problems that would make loading the DCP checkpoint in ``directory`` run code (empty: safe).

    DCP unpickles its ``.metadata`` and every non-tensor entry (optimizer
    hyper-parameters, ...) with plain pickle. The metadata is unpickled here
    with an allow-list of DCP's own classes, and each non-tensor entry it
    points to is checked against ``weights_only``'s allow-list, all without
    running anything. Returned as ``(file relative to directory, problem)``.
    """
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata

    try:
        metadata = _RestrictedUnpickler(io.BytesIO(storage.read_bytes(directory / ".metadata"))).load()
    except Exception as exc:  # any failure to parse under the allow-list is a refusal
        return [(".metadata", f"refused to unpickle: {exc}")]
    if not isinstance(metadata, Metadata):
        return [(".metadata", f"holds a {type(metadata).__name__}, not DCP metadata")]
    problems = []
    blobs = {fqn for fqn, md in metadata.state_dict_metadata.items() if isinstance(md, BytesStorageMetadata)}
    for index, info in (metadata.storage_data or {}).items():
        if index.fqn not in blobs:
            continue  # tensors: DCP loads them with weights_only=True
        if info.transform_descriptors:
            problems.append((info.relative_path, f"entry {index.fqn} is transformed; cannot check it"))
            continue
        with storage.open_read(directory / info.relative_path) as f:
            f.seek(info.offset)
            blob = io.BytesIO(f.read(info.length))
        try:
            unsafe = torch.serialization.get_unsafe_globals_in_checkpoint(blob)
        except Exception as exc:
            unsafe = [f"unreadable ({exc})"]
        if unsafe:
            problems.append((info.relative_path, f"entry {index.fqn} would unpickle {', '.join(unsafe)}"))
    return problems


def check_torch_file(path: Path, storage: Any, allowed: set[str] = BACKEND_TORCH_GLOBALS) -> str | None:
    """Why loading the ``torch.save`` file at ``path`` with ``weights_only=False`` could run code, or ``None``."""
    try:
        with storage.open_read(path) as f:
            unsafe = torch.serialization.get_unsafe_globals_in_checkpoint(f)
    except Exception as exc:
        return f"not a readable torch file ({exc})"
    bad = sorted(g for g in unsafe if g not in allowed and not any(g.startswith(a + ".") for a in allowed))
    return f"would unpickle {', '.join(bad)}" if bad else None


#: First bytes of a torch.save file (a zip archive) and of a raw pickle.
_ZIP_MAGIC = b"PK\x03\x04"
_PICKLE_MAGIC = b"\x80"


def check_pickles(directory: Path, files: list[str], storage: Any, own: set[str]) -> list[tuple[str, str]]:
    """Files of a checkpoint whose loading could run code: ``[(file, problem)]``, empty when none.

    ``files`` are relative to ``directory``; ``own`` are unison's files (read
    with ``weights_only=True``; held to its allow-list with no additions).
    DCP checkpoints are checked through their metadata (:func:`check_dcp`),
    other ``torch.save`` files against ``weights_only`` plus
    :data:`BACKEND_TORCH_GLOBALS`, and any other raw pickle is refused.
    """
    problems = []
    for name in files:
        path = directory / name
        if name.endswith(".distcp"):
            continue  # checked through its .metadata
        if Path(name).name == ".metadata":
            parent = Path(name).parent
            problems += [((parent / f).as_posix(), p) for f, p in check_dcp(directory / parent, storage)]
            continue
        with storage.open_read(path) as f:
            head = f.read(4)
        if head == _ZIP_MAGIC:
            problem = check_torch_file(path, storage, set() if name in own else BACKEND_TORCH_GLOBALS)
            if problem:
                problems.append((name, problem))
        elif head[:1] == _PICKLE_MAGIC:
            problems.append((name, "a raw pickle that no unison loader reads; refusing it"))
    return problems
