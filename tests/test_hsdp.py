"""hsdp (FSDP2 on a replicate x shard mesh) against the single-process reference, on a real 4-rank gloo world.

One spawned world of 4 ranks (2 replicas x 2 shards, tests/hsdp_worlds.py) runs parity, its own resume,
an fsdp checkpoint resumed under hsdp, collective counts and memory; its step-10 checkpoint is then
resumed here under single (one process) and under zero3 (a world of 2).
"""

from __future__ import annotations

import pytest
import torch

import unison
from unison.contract.mesh import MeshDim, MeshLayout
from unison.contract.ownership import PrecisionOwner, StateDictKind
from unison.launch.torchrun import spawn

from fsdp_worlds import wide_mlp
from helpers import assert_matches_single, max_abs_diff, train
from hsdp_worlds import hsdp_world, zero3_from

#: Final weights of every composed run against one uninterrupted single run.
TOL = 1e-6
NORM_REL = 1e-6


@pytest.fixture(scope="module")
def reference(single_runs) -> dict:
    return single_runs("fp32")


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> tuple[str, list[dict]]:
    root = str(tmp_path_factory.mktemp("ckpt-hsdp"))
    return root, spawn(hsdp_world, 4, root, timeout=600)


@pytest.mark.distributed
def test_fp32_matches_single_with_accumulation_clipping_and_scheduler(world, reference):
    _, ranks = world
    for rank in ranks:
        # The grad norm over both mesh dimensions: summed over the replicas too it would be sqrt(2) times
        # larger, over one rank's shards alone smaller.
        assert_matches_single(rank["fp32"], reference, tol=TOL, rel=NORM_REL)


@pytest.mark.distributed
def test_resume_equals_uninterrupted(world):
    _, ranks = world
    for rank in ranks:
        assert max_abs_diff(rank["resumed"]["state"], rank["fp32"]["state"]) <= TOL
        assert rank["resumed"]["history"] == rank["fp32"]["history"][10:]
        assert rank["resumed"]["hooks"][1][0] == "load_checkpoint"


@pytest.mark.distributed
def test_fsdp_checkpoint_resumes_under_hsdp(world, reference):
    _, ranks = world
    for rank in ranks:
        assert max_abs_diff(rank["from_fsdp"]["state"], reference["state"]) <= TOL


@pytest.mark.distributed
def test_world_4_checkpoint_resumes_under_single_in_one_process(world, reference):
    root, _ = world
    resumed = train("single", max_steps=20, ckpt_path=f"{root}/hsdp/step-00000010", record=False)
    assert max_abs_diff(resumed["state"], reference["state"]) <= TOL


@pytest.mark.distributed
def test_world_4_checkpoint_resumes_under_zero3_at_world_2(world, reference):
    root, _ = world
    ranks = spawn(zero3_from, 2, f"{root}/hsdp/step-00000010", timeout=300)
    for rank in ranks:
        assert max_abs_diff(rank["state"], reference["state"]) <= TOL


@pytest.mark.distributed
def test_gradient_sync_deferred_on_both_dimensions(world):
    _, ranks = world
    for rank in ranks:
        counts = rank["collectives"]
        # Per optimizer step, one reduce-scatter over 'shard' and one all-reduce over 'replicate' per
        # sharded unit holding parameters (the MLP's three Linear layers), whether the step has one
        # micro-batch or four: no_sync() deferred both.
        assert counts[1] == counts[4], counts
        for step in counts[4]:
            assert step["reduce_scatter"] == 3 and step["all_reduce"] == 3, counts


def _shard_bytes(shapes: list[torch.Size], groups: int, index: int) -> int:
    """fp32 bytes of shard ``index`` of ``groups`` under FSDP2's dim-0 ``torch.chunk`` (leading ranks get the
    larger chunks; a parameter with fewer rows than ranks leaves the last ones empty)."""
    total = 0
    for shape in shapes:
        chunks = torch.empty(shape, device="meta").chunk(groups, dim=0)
        total += chunks[index].numel() * 4 if index < len(chunks) else 0
    return total


@pytest.mark.distributed
def test_memory_per_rank_is_sharded_over_the_shard_dimension_only(world):
    _, ranks = world
    shapes = [p.shape for p in wide_mlp().parameters()]
    full = sum(p.numel() for p in wide_mlp().parameters()) * 4
    for r, rank in enumerate(ranks):
        f = rank["footprint"]
        # Parameters, gradients and AdamW's two moments: 1, 1 and 2 copies of this rank's shard. hsdp's shard
        # index is r % 2 (mesh rows are replicas), fsdp's is r; ddp holds everything.
        expected = {"hsdp": _shard_bytes(shapes, 2, r % 2), "fsdp": _shard_bytes(shapes, 4, r), "ddp": full}
        for name, shard in expected.items():
            assert f[name] == {"parameters": shard, "gradients": shard, "optimizer_state": 2 * shard}, (name, f)
    # The formula: about 1/shard_size of ddp's bytes per rank (2 here), fsdp's 1/world (4).
    assert ranks[1]["footprint"]["hsdp"]["parameters"] == pytest.approx(full / 2, rel=1e-2)
    assert ranks[1]["footprint"]["fsdp"]["parameters"] == pytest.approx(full / 4, rel=1e-2)


# --------------------------------------------------------------------------- #
# Declarations and bad input (no process group)
# --------------------------------------------------------------------------- #


def test_declaration_names_the_mesh():
    ownership = unison.PluginManager().strategies.create("hsdp", {"shard_size": 4}).ownership
    assert ownership.grad_accumulation.owner is unison.AccumulationOwner.TRAINER
    assert ownership.state_dict.kind is StateDictKind.SHARDED and ownership.state_dict.reshardable
    assert ownership.precision["bf16-mixed"].owner is PrecisionOwner.SHARDING_POLICY
    assert ownership.mesh is not None and ownership.mesh.names == ("replicate", "shard")
    assert ownership.mesh.shape(8) == (2, 4) and ownership.mesh.shape(4) == (1, 4)
    assert ownership.to_dict()["mesh"]["shape"] == "replicate=world/4 x shard=4"
    assert unison.PluginManager().strategies.create("fsdp").ownership.mesh is None  # optional


def test_world_size_not_a_multiple_of_the_shard_size_is_refused_before_any_process_group(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "6")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(unison.DeclaredRefusal, match=r"world size 6 is not a multiple of 4: .*shard_size=4") as info:
        unison.Trainer(max_steps=1, strategy="hsdp", strategy_options={"shard_size": 4}, global_batch_size=24)
    assert info.value.feature == "world_size"
    assert not torch.distributed.is_initialized()


def test_shard_size_must_be_positive():
    with pytest.raises(unison.ConfigurationError, match="shard_size"):
        unison.Trainer(max_steps=1, strategy="hsdp", strategy_options={"shard_size": 0})


def test_mesh_layout_refuses_what_cannot_be_built():
    dim = MeshDim("a", None, "nothing", "none")
    with pytest.raises(ValueError, match="at most one"):
        MeshLayout((dim, MeshDim("b", None, "x", "y")))
    with pytest.raises(ValueError, match="distinct"):
        MeshLayout((dim, dim))
    layout = MeshLayout((dim, MeshDim("b", 2, "x", "y")))
    with pytest.raises(ValueError, match="world size 3 is not a multiple of 2"):
        layout.shape(3)
