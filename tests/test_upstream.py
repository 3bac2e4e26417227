"""Non-public upstream APIs stay behind the adapters, pinned, and work on the installed versions.

The adapters: ``core/_upstream/`` (package ``unison._upstream``), one module per upstream library, shared
by the core, the strategies, the plugins and the suite.
"""

from __future__ import annotations

import ast
import datetime
import importlib.metadata
import inspect
import multiprocessing
import os
import warnings
from pathlib import Path

import pytest
import torch

import unison
from unison import _upstream as adapters
from unison._upstream import deepspeed as ds_adapter
from unison._upstream import fairscale as fairscale_adapter
from unison._upstream import torch as torch_adapter
from unison.launch.torchrun import spawn

from helpers import regression_data

ROOT = Path(__file__).resolve().parents[1]
ADAPTERS = ROOT / "core" / "_upstream"

#: Names that start with an underscore yet are documented public API: ``os._exit`` (exit without
#: cleanup, the documented way out of a forked or stalled process) and namedtuple's ``_fields``.
DOCUMENTED_PUBLIC = {"os._exit", "_fields"}


def own_private_names(paths: list[Path]) -> set[str]:
    """The ``_names`` unison's own code defines (``self._x = ...``, ``def``, ``class``, assignments)."""
    names: set[str] = set()
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
    return {n for n in names if n.startswith("_")}


def private_uses(path: Path, own: set[str]) -> list[str]:
    """Every reach into a non-public name of another object or module in ``path``.

    ``x._name``; ``self._name`` / ``cls._name`` when unison's own code never defines
    ``_name`` (an upstream base class's internals); ``getattr(x, "_name")`` and
    friends; ``from pkg._private import ...`` of a non-unison package.
    """
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            on_self = isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")
            if ast.unparse(node) in DOCUMENTED_PUBLIC:
                continue
            if not on_self or node.attr not in own:
                found.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "hasattr", "setattr", "delattr")
            and len(node.args) > 1
            and isinstance(node.args[1], ast.Constant)
            and str(node.args[1].value).startswith("_")
            and not str(node.args[1].value).startswith("__")
            and node.args[1].value not in DOCUMENTED_PUBLIC
        ):
            found.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
        elif (
            isinstance(node, ast.ImportFrom)
            and node.level == 0  # a relative import is unison's own module
            and node.module
            and not node.module.startswith("unison")
        ):
            names = [node.module, *(a.name for a in node.names)]
            if any(part.startswith("_") and not part.startswith("__") for n in names for part in n.split(".")):
                found.append(f"{path.name}:{node.lineno}: from {node.module} import ...")
    return found


#: Every module of the project outside the adapters.
PROJECT_FILES = [
    p
    for top in ("core", "strategies", "plugins", "conformance_tests")
    for p in (ROOT / top).rglob("*.py")
    if ADAPTERS not in p.parents
]
ADAPTER_FILES = sorted(ADAPTERS.glob("*.py"))
OWN = own_private_names(PROJECT_FILES)


def _uses(paths: list[Path]) -> list[tuple[str, str, str]]:
    """``(repository path, what, "file:line: what")`` for every private use in ``paths``."""
    out = []
    for path in paths:
        for use in private_uses(path, OWN):
            out.append((path.relative_to(ROOT).as_posix(), use.split(": ", 1)[1], use))
    return out


def test_no_module_reaches_a_private_upstream_name_outside_the_adapters():
    assert len(PROJECT_FILES) >= 150
    uses = [use for _rel, _what, use in _uses(PROJECT_FILES)]
    assert not uses, "move these behind unison._upstream (one adapter module per upstream):\n" + "\n".join(uses)


def test_the_scan_ignores_relative_imports_and_documented_public_names(tmp_path):
    module = tmp_path / "m.py"
    module.write_text(
        "import os\nfrom ._base import thing\nfrom torch._utils import x\n"
        "os._exit(1)\ngetattr(f, '__name__')\ngetattr(g, '_private')\n"
    )
    found = sorted(use.split(": ", 1)[1] for use in private_uses(module, set()))
    assert found == ["from torch._utils import ...", "getattr(g, '_private')"]


def test_the_scan_finds_private_uses():
    """The adapters are where the private names are, so the scan must find them there."""
    joined = "\n".join(use for path in ADAPTER_FILES for use in private_uses(path, OWN))
    for name in (
        "_exec_schedule",
        "_compute_loss",
        "_hp_mapping",
        "_dp_group",
        "_unscale_grads_",
        "_lazy_init_scale_growth_tracker",
        "_scale",
        "_flatten_dense_tensors",
        "_grad_hooks",
        "_set_pg_timeout",
        "_dump_nccl_trace",
        "_failures",
        "_worker_info",
        "_shutdown_workers",
    ):
        assert name in joined, name


def test_every_private_use_has_its_reason_beside_it():
    for path in ADAPTER_FILES:
        lines = path.read_text().splitlines()
        for use in private_uses(path, OWN):
            line = int(use.split(":")[1])
            assert any("PRIVATE" in text for text in lines[max(0, line - 7) : line]), f"no reason beside {use}"


@pytest.mark.parametrize(
    ("adapter", "distribution"),
    [(torch_adapter, "torch"), (ds_adapter, "deepspeed"), (fairscale_adapter, "fairscale")],
)
def test_adapters_are_pinned_to_the_installed_version(adapter, distribution):
    installed = importlib.metadata.version(distribution).split("+")[0]
    assert installed == adapter.VERIFIED_VERSION, (
        f"{adapter.__name__} was verified against {distribution} {adapter.VERIFIED_VERSION} but {installed} is "
        "installed: re-verify its private APIs, then update VERIFIED_VERSION"
    )


def test_an_unverified_version_warns_once():
    warn_if_unverified = adapters.warn_if_unverified
    with pytest.warns(RuntimeWarning, match="verified against torch 0.0.1"):
        warn_if_unverified("torch", "0.0.1", "test adapter")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warn_if_unverified("torch", "0.0.1", "test adapter")  # once per adapter


# --------------------------------------------------------------------------- #
# torch: process groups, launching, loader workers, tensor flattening
# --------------------------------------------------------------------------- #
def test_core_flatten_and_unflatten_round_trip():
    tensors = [torch.randn(3, 4), torch.randn(5), torch.randn(2, 2, 2)]
    flat = torch_adapter.flatten_dense_tensors(tensors)
    assert flat.shape == (12 + 5 + 8,)
    assert torch.equal(flat, torch.cat([t.reshape(-1) for t in tensors]))
    back = torch_adapter.unflatten_dense_tensors(flat, tensors)
    assert all(torch.equal(a, b) for a, b in zip(tensors, back))


class WorkerSeen(torch.utils.data.IterableDataset):
    """Yields, in a loader worker, whether the worker is visible with and without the adapter's block."""

    def __iter__(self):
        seen = torch.utils.data.get_worker_info() is not None
        with torch_adapter.hidden_loader_worker():
            hidden = torch.utils.data.get_worker_info() is None
        yield torch.tensor([seen, hidden, torch.utils.data.get_worker_info() is not None])


def test_hidden_loader_worker_hides_the_worker_then_restores_it():
    (batch,) = list(torch.utils.data.DataLoader(WorkerSeen(), batch_size=None, num_workers=1))
    assert batch.tolist() == [True, True, True]


def test_shutdown_loader_workers_stops_the_workers():
    loader = torch.utils.data.DataLoader(list(range(64)), batch_size=4, num_workers=2)
    iterator = iter(loader)
    next(iterator)
    before = multiprocessing.active_children()
    assert len(before) >= 2
    torch_adapter.shutdown_loader_workers(iterator)
    assert not any(p.is_alive() for p in before)
    torch_adapter.shutdown_loader_workers(iter(torch.utils.data.DataLoader([1, 2])))  # no workers: nothing to do


def test_torchrun_records_failures_where_the_adapter_reads_them():
    from torch.distributed.elastic.multiprocessing import api

    # The subprocess context (what torchrun uses) keeps its failures in the attribute the adapter reads.
    assert "self._failures" in inspect.getsource(api.SubprocessContext)
    holder = type("Context", (), {"_failures": {0: "failure"}})()
    assert torch_adapter.torchrun_worker_failures(holder) == {0: "failure"}
    assert torch_adapter.torchrun_worker_failures(object()) == {}  # a context that keeps none


def test_nccl_flight_recorder_is_absent_on_a_cpu_build():
    if torch.cuda.is_available():
        pytest.skip("a CUDA build has the recorder")
    assert torch_adapter.nccl_flight_recorder_dump() is None


def test_eager_random_ops_compiles_random_ops_onto_eager_generator_and_restores_the_config(monkeypatch):
    import torch._inductor.config as inductor_config

    before = inductor_config.fallback_random
    with torch_adapter.eager_random_ops():
        assert inductor_config.fallback_random is True
    assert inductor_config.fallback_random == before
    # The flight recorder's reader and the group registry are read in tests/test_trace_collectives.py (a
    # real gloo world); gone, each warns and records nothing.
    monkeypatch.delattr(torch._C._distributed_c10d, "_dump_fr_trace_json")
    with pytest.warns(RuntimeWarning, match="_dump_fr_trace_json"):
        assert torch_adapter.flight_recorder_json() is None
    monkeypatch.delattr(torch.distributed.distributed_c10d, "_world")
    with pytest.warns(RuntimeWarning, match="pg_names"):
        assert torch_adapter.process_group_names() == {}


def test_profiler_enabled_is_true_only_while_a_profiler_records(monkeypatch):
    from torch.profiler import ProfilerActivity, profile

    assert torch_adapter.profiler_enabled() is False
    with profile(activities=[ProfilerActivity.CPU]):
        assert torch_adapter.profiler_enabled() is True
    with torch.autograd.profiler.profile():
        assert torch_adapter.profiler_enabled() is True
    assert torch_adapter.profiler_enabled() is False
    monkeypatch.delattr(torch.autograd, "_profiler_enabled")
    with pytest.warns(RuntimeWarning, match="_profiler_enabled"):
        assert torch_adapter.profiler_enabled() is True  # marks are entered whether or not one records


def test_a_missing_private_name_warns_and_falls_back(monkeypatch):
    tensors = [torch.randn(2, 3), torch.randn(4)]
    monkeypatch.delattr(torch._utils, "_flatten_dense_tensors")
    monkeypatch.delattr(torch._utils, "_unflatten_dense_tensors")
    with pytest.warns(RuntimeWarning, match="_flatten_dense_tensors"):
        flat = torch_adapter.flatten_dense_tensors(tensors)
    with pytest.warns(RuntimeWarning, match="_unflatten_dense_tensors"):
        back = torch_adapter.unflatten_dense_tensors(flat, tensors)
    assert all(torch.equal(a, b) for a, b in zip(tensors, back))
    monkeypatch.delattr(torch.distributed.distributed_c10d, "_set_pg_timeout")
    with pytest.warns(RuntimeWarning, match="collectives keep the rendezvous timeout"):
        torch_adapter.set_default_group_timeout(datetime.timedelta(seconds=5))


# --------------------------------------------------------------------------- #
# torch
# --------------------------------------------------------------------------- #
class FirstLayerOnly(torch_adapter.FlagReducingGradScaler):
    """Unscales and checks only the first parameter group; records the flags it was given."""

    def __init__(self) -> None:
        super().__init__("cpu", init_scale=1024.0)
        self.flags: list[float] = []

    def unscale_target(self, optimizer):
        return type("Shard", (), {"param_groups": optimizer.param_groups[:1]})()

    def combine_found_inf(self, per_device, found_inf):
        self.flags.extend(float(f) for f in per_device.values())
        return per_device


def _two_groups():
    first, second = torch.nn.Linear(4, 4), torch.nn.Linear(4, 1)
    opt = torch.optim.SGD([{"params": first.parameters()}, {"params": second.parameters()}], lr=0.1)
    return first, second, opt


def test_grad_scaler_override_points_narrow_and_see_the_overflow_check():
    first, second, opt = _two_groups()
    scaler = FirstLayerOnly()
    scaler.scale(second(first(torch.randn(8, 4))).pow(2).mean()).backward()
    scaled_second = second.weight.grad.clone()
    scaler.unscale_(opt)
    assert scaler.flags == [0.0]
    # The first group was unscaled, the second was left alone.
    assert torch.equal(second.weight.grad, scaled_second)
    # An overflow outside the checked group is not seen; inside it, the step is skipped.
    second.weight.grad.fill_(float("inf"))
    before = first.weight.detach().clone()
    scaler.step(opt)
    assert not torch.equal(first.weight, before)
    scaler.update()
    opt.zero_grad()
    scaler.scale(second(first(torch.randn(8, 4))).pow(2).mean()).backward()
    first.weight.grad.fill_(float("inf"))
    before = first.weight.detach().clone()
    scaler.step(opt)
    assert scaler.flags[-1] == 1.0 and torch.equal(first.weight, before)


def test_ensure_scale_lets_a_rank_that_scaled_no_loss_unscale():
    first, second, opt = _two_groups()
    for p in [*first.parameters(), *second.parameters()]:
        p.grad = torch.ones_like(p)  # gradients that arrived from another stage
    with pytest.raises(AssertionError):
        torch.amp.GradScaler("cpu").unscale_(opt)  # the scale does not exist yet
    scaler = torch_adapter.FlagReducingGradScaler("cpu", init_scale=4.0)
    scaler.ensure_scale(opt)
    scaler.unscale_(opt)
    assert torch.equal(first.weight.grad, torch.full_like(first.weight, 0.25))


# --------------------------------------------------------------------------- #
# DeepSpeed
# --------------------------------------------------------------------------- #
def test_train_schedule_without_step_is_train_schedule_minus_optimizer_step():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from deepspeed.runtime.pipe import schedule

    for stage_id in (0, 1):
        full = [list(cmds) for cmds in schedule.TrainSchedule(micro_batches=4, stages=2, stage_id=stage_id).steps()]
        cut = [list(cmds) for cmds in ds_adapter.train_schedule_without_step(4, 2, stage_id).steps()]
        assert sum(isinstance(c, schedule.OptimizerStep) for cmds in full for c in cmds) == 1
        kept = [[repr(c) for c in cmds if not isinstance(c, schedule.OptimizerStep)] for cmds in full]
        assert kept == [[repr(c) for c in cmds] for cmds in cut]
        assert any(isinstance(c, schedule.ReduceGrads) for cmds in cut for c in cmds)


def upstream_world() -> dict[str, object]:
    """In a real world of 1: fairscale's ShardedDataParallel hooks, and zero2/zero3 layouts after one step."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from deepspeed.utils import safe_get_full_fp32_param
    from fairscale.nn.data_parallel import ShardedDataParallel
    from fairscale.optim import OSS

    out: dict[str, object] = {}
    module = torch.nn.Linear(4, 1)
    sdp = ShardedDataParallel(module, OSS(module.parameters(), optim=torch.optim.SGD, lr=0.1))
    sdp(torch.randn(2, 4)).sum().backward()
    out["sdp/hooks_before"] = len(sdp._grad_hooks)
    fairscale_adapter.remove_grad_hooks(sdp)
    out["sdp/hooks_after"] = len(sdp._grad_hooks)

    class Inspect:
        @unison.hookimpl
        def unison_on_after_optimizer_step(self, trainer):
            strategy, stage = trainer.strategy, trainer.strategy.stage
            masters = ds_adapter.fp32_partitions(strategy.engine.optimizer, stage)
            params = dict(strategy.module.named_parameters())
            frozen, trained = params["0.weight"], {n: p for n, p in params.items() if p.requires_grad}
            out[f"zero{stage}/masters_numel"] = sum(m.numel() for m in masters)
            out[f"zero{stage}/trained_numel"] = sum(p.numel() for p in trained.values())
            if stage == 2:
                out["zero2/frozen_linked"] = ds_adapter.is_linked(frozen)
                exact, covered = [], 0
                for name, p in trained.items():
                    piece = ds_adapter.fragment(p)
                    assert ds_adapter.is_linked(p) and piece is not None and piece.param_numel == p.numel()
                    master = masters[piece.group_index].narrow(0, piece.partition_start, piece.partition_numel)
                    exact.append(torch.equal(master, safe_get_full_fp32_param(p).flatten()))
                    covered += piece.partition_numel
                    group = ds_adapter.fragment_group(p)
                    assert torch.distributed.get_world_size(group=group) == 1, name
                out["zero2/fragments_are_the_masters"] = all(exact)
                out["zero2/fragments_numel"] = covered
            else:
                out["zero3/partitioned"] = all(ds_adapter.is_partitioned(p) for p in params.values())
                out["zero3/partition_covers_param"] = all(
                    ds_adapter.local_partition(p).numel() >= p.ds_numel for p in params.values()
                )
                out["zero3/group_size"] = torch.distributed.get_world_size(
                    group=ds_adapter.partition_group(params["2.weight"])
                )
                kept = [ds_adapter.kept_whole(p) for p in params.values()]
                out["zero3/kept_whole_is_bool"] = all(isinstance(k, bool) for k in kept)

    for stage in (2, 3):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
        model[0].weight.requires_grad_(False)
        trainer = unison.Trainer(strategy=f"zero{stage}", max_steps=1, global_batch_size=8, callbacks=[Inspect()])
        trainer.fit(
            model,
            regression_data(16),
            loss_fn=torch.nn.functional.mse_loss,
            optimizer=lambda params: torch.optim.AdamW(params, lr=1e-2),
        )
    return out


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_adapters_read_real_engines():
    (out,) = spawn(upstream_world, 1, timeout=220)
    assert out["sdp/hooks_before"] == 2 and out["sdp/hooks_after"] == 0
    assert out["zero2/frozen_linked"] is False
    assert out["zero2/fragments_are_the_masters"] is True
    # Every trained element has its place in the (alignment-padded) fp32 partition, the frozen ones none.
    assert out["zero2/fragments_numel"] == out["zero2/trained_numel"] == 16 + 16 + 1  # 0.bias, 2.weight, 2.bias
    assert out["zero2/trained_numel"] <= out["zero2/masters_numel"] < out["zero2/trained_numel"] + 16
    assert out["zero3/partitioned"] is True and out["zero3/partition_covers_param"] is True
    assert out["zero3/group_size"] == 1 and out["zero3/kept_whole_is_bool"] is True
    assert out["zero3/masters_numel"] >= out["zero3/trained_numel"]
