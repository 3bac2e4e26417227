"""The flat import paths of unison 0.1 still import in 0.2, with their old names, until 0.3 (CHANGELOG 0.2.0).

:data:`OLD_PATHS` is every flat module 0.2 moved into a subpackage, with the module it became and every
name it exported (its ``__all__`` where it had one, else every name it defined without a leading
underscore), read from ``git show 44755e0^:core/<name>.py``, the commit before the move. Three of them
(``unison.data``, ``unison.config``, ``unison.launch``) share their name with the subpackage that took
their place: the package gives the old module's names, each with the warning.

One fresh interpreter imports all 33 paths and executes ``from unison.<old> import <name>`` for every
name (pure imports, no process group): every import of a moved module warns once naming its new module,
every name the new module no longer holds warns naming its home, and the value is the one at that home.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

#: old flat module -> (the module it became, the names it exported).
OLD_PATHS: dict[str, tuple[str, str]] = {
    "strategy": (
        "contract.strategy",
        "AccumulationOwner DeferredGradSync DistEnv EngineAccumulation Feature GradAccumulation GradSync LossFn "
        "OptimizerFactory Ownership PrecisionOwner PrecisionSupport ReplicaInit ScheduleAccumulation "
        "StateDictDeclaration StateDictKind Strategy StrategySpec TrainerSettings WorldSizes canonical "
        "check_contract dcp_load dcp_save model_features required_interface resolve_accelerator",
    ),
    "ownership": (
        "contract.ownership",
        "AccumulationOwner Feature GradAccumulation GradSync Ownership PrecisionOwner PrecisionSupport "
        "ReplicaInit STANDARD_PRECISIONS StateDictDeclaration StateDictKind WorldSizes",
    ),
    "precision": ("contract.precision", "DelegatedPrecision Precision cast_floating"),
    "state": ("contract.state", "canonical dcp_load dcp_save rng_state seed_everything set_rng_state"),
    "env": ("contract.env", "DistEnv device_for resolve_accelerator world_from_env"),
    "settings": ("contract.settings", "TrainerSettings parse_settings"),
    "hookspecs": (
        "plugin.hookspecs",
        "unison_add_cli_commands unison_cluster_environments unison_default_plugins unison_log_metrics "
        "unison_on_after_backward unison_on_after_optimizer_step unison_on_before_optimizer_step "
        "unison_on_exception unison_on_fit_end unison_on_fit_start unison_on_load_checkpoint "
        "unison_on_save_checkpoint unison_on_train_epoch_end unison_on_train_epoch_start "
        "unison_on_train_step_end unison_on_train_step_start unison_on_trainer_init unison_on_validation_end "
        "unison_on_validation_start unison_plugins_from_config unison_precisions unison_strategies "
        "unison_validation_progress",
    ),
    "manager": ("plugin.manager", "BLOCK_ENV DISABLE_AUTOLOAD_ENV ENTRY_POINT_GROUP PLUGINS_ENV PluginManager"),
    "registry": (
        "plugin.registry",
        "NoOptions PrecisionRegistry PrecisionSpec StrategyRegistry StrategySpec missing_modules",
    ),
    "data": (
        "data",
        "BatchPlan CollateFn LoaderOptions StepBatch TrainData check_divisible is_map_style local_slices "
        "probe_batch_size resolve_source stream_global_batches validation_batches validation_slices "
        "validation_stream",
    ),
    "batch": ("data.batch", "batch_size count_tokens map_tensors move_to_device split_batch tensor_leaves"),
    "checkpoint": (
        "checkpointing.checkpointer",
        "CheckpointError Checkpointer Committed CorruptCheckpointError step_dir_name",
    ),
    "checkpoint_cli": ("cli.checkpoint", "checkpoint console export inspect verify_cmd"),
    "export": ("checkpointing.export", "canonical_state export_hf export_safetensors"),
    "manifest": (
        "checkpointing.manifest",
        "CheckpointError CorruptCheckpointError FORMAT FileEntry MANIFEST Manifest RNG_DIR TRAINER_STATE "
        "all_gather barrier broadcast hash_files rank utc_now verify world_size",
    ),
    "safe_io": (
        "checkpointing.safe_io",
        "BACKEND_TORCH_GLOBALS UnsafeStateError check_dcp check_pickles check_torch_file decode_rng dumps "
        "encode_rng loads",
    ),
    "storage": ("checkpointing.storage", "LocalStorage REMOTE_SCHEMES StorageUnavailableError open_storage split_url"),
    "remote_storage": ("checkpointing.remote_storage", "DEFAULT_RETRY_S FsspecStorage RemotePath retry_budget"),
    "lease": ("checkpointing.lease", "DEFAULT_TTL_S Holder LEASE Lease LeaseLostError LeaseWarning lease_ttl"),
    "launch": ("launch", "WorldError check_nproc cluster_launch free_port run_script spawn start_workers"),
    "launch_report": ("launch.report", "summarize_failures watch_torchrun"),
    "lifecycle": (
        "launch.lifecycle",
        "COLLECTIVE_TIMEOUT_S LAUNCHER_ENV PREEMPTED_EXIT_CODE Preempted RENDEZVOUS_TIMEOUT_S RunGuard "
        "STOP_SIGNALS collective_timeout_s drain_collective_threads enable_nccl_flight_recorder exit_code_for "
        "init_process_group record_error report_worker_failure",
    ),
    "watchdog": (
        "launch.watchdog",
        "DEFAULT_STALL_TIMEOUT_S StallDetector StallError Watchdog check_stall_timeout dump_nccl_trace "
        "heartbeat_interval start_watchdog store_client",
    ),
    "worker": ("launch.worker", "main"),
    "cluster": ("launch.cluster", "ClusterEnvironment NodeLaunch expand_hostlist node_launch select_environment"),
    "setup_report": ("launch.setup_report", "SetupReport"),
    "config": (
        "config",
        "APEX_NOT_INSTALLED ClassConfig ConfigErrors FactoryConfig ImportsConfig LoggingConfig LossConfig "
        "MLflowConfig RunConfig StepConfig Trust WandbConfig build_callbacks check_kwargs load_config "
        "optimizer_factory resolve_factory resolve_run scheduler_factory",
    ),
    "config_optim": (
        "config.optim",
        "APEX_NOT_INSTALLED NON_NEGATIVE check_optimizer check_scheduler keyword_problems number_problems "
        "optimizer_factory scheduler_factory",
    ),
    "config_schema": (
        "config.schema",
        "ClassConfig FactoryConfig ImportsConfig LoggingConfig LossConfig MLflowConfig RunConfig StepConfig "
        "WandbConfig known_keys unknown_key_hint",
    ),
    "config_source": (
        "config.source",
        "ConfigErrors Loc Problem Source apply_overrides dotted parse_value read_source toml_lines yaml_lines",
    ),
    "config_trust": ("config.trust", "Trust entry_point_modules is_path is_plugin resolve_factory"),
    "trainer": ("training.trainer", "NonFiniteError Progress StepOutput Trainer TrainerSettings build_strategy"),
    "runs": (
        "training.runs",
        "CHECKPOINTS DEFAULT_ROOT_ENV RUN_DIR_ENV agree check_root choose_for_workers default_root new_version "
        "plan_run prepare versions",
    ),
}

#: The old modules whose name a subpackage took: importing them is importing the package (no warning).
COLLIDING = {"data", "config", "launch"}

REMOVED = "(the old path is removed in unison 0.3)"

# Runs in a fresh interpreter: every old path imported, every old name imported from it, warnings recorded.
_PROBE = r"""
import importlib, json, sys, warnings
paths = json.loads(sys.argv[1])
out = []
for old, names in paths.items():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = importlib.import_module("unison." + old)
    row = {"old": old, "import_warnings": [str(w.message) for w in caught if w.category is DeprecationWarning],
           "module": module.__name__, "spec": getattr(module.__spec__, "name", None), "names": {}}
    for name in names:
        ns = {}
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                exec(f"from unison.{old} import {name} as value", ns)
            except ImportError as exc:
                row["names"][name] = {"error": str(exc)}
                continue
        found = [(str(w.message), w.filename) for w in caught if w.category is DeprecationWarning]
        row["names"][name] = {"warnings": found, "id": id(ns["value"])}
        # Where a warning names a home, the value there must be the same object.
        for message, _ in found:
            if " moved to unison." in message:
                home = message.split(" moved to ")[1].split(";")[0].rpartition(".")[0]
                row["names"][name]["home"] = home
                row["names"][name]["home_id"] = id(getattr(importlib.import_module(home), name))
        new = sys.modules.get("unison." + old)
        row["names"][name]["same_as_module_attr"] = id(getattr(new, name)) == id(ns["value"])
    out.append(row)
# A moved module keeps its own spec after its old path was imported.
moved = ("unison.contract.strategy", "unison.training.trainer")
out.append({"specs": {m: sys.modules[m].__spec__.name for m in moved}})
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def probe() -> dict[str, dict]:
    paths = {old: names.split() for old, (_, names) in OLD_PATHS.items()}
    done = subprocess.run(
        [sys.executable, "-c", _PROBE, json.dumps(paths)], capture_output=True, text=True, timeout=300, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(done.stdout)
    specs = rows.pop()["specs"]
    return {"specs": specs, **{row["old"]: row for row in rows}}


def test_the_table_is_every_old_path_of_the_changelog():
    """33 paths; every ``unison.<flat>`` the CHANGELOG's 0.2.0 entry names as an old path is one of them."""
    from unison import _moved

    assert len(OLD_PATHS) == 33
    assert set(OLD_PATHS) == set(_moved.MODULES)
    text = (ROOT / "CHANGELOG.md").read_text()
    section = text[text.index("## [0.2.0]") : text.index("## [0.1.0]")]
    sentence = section[section.index("The old flat paths") :].split("until 0.3")[0]
    named = set(re.findall(r"`unison\.(\w+)`", sentence))
    assert named and named <= set(OLD_PATHS), named - set(OLD_PATHS)


@pytest.mark.parametrize("old", sorted(OLD_PATHS))
def test_an_old_path_imports_with_every_old_name_and_the_warning_names_the_new_home(probe, old):
    new, names = OLD_PATHS[old]
    row = probe[old]
    if old in COLLIDING:
        # The subpackage that took the name: importing it is not deprecated, its old names are.
        assert row["import_warnings"] == [] and row["module"] == f"unison.{old}"
    else:
        assert row["import_warnings"] == [f"unison.{old} moved to unison.{new}; import it from there {REMOVED}"]
    problems = []
    for name in names.split():
        got = row["names"][name]
        if "error" in got:
            problems.append(f"{name}: {got['error']}")
            continue
        messages = [m for m, _ in got["warnings"]]
        if old in COLLIDING or not got["same_as_module_attr"] or messages:
            # A name the new module does not hold itself: one warning, at the importing line, naming its home.
            if len(messages) != 1 or got["warnings"][0][1] != "<string>":
                problems.append(f"{name}: warnings {got['warnings']}")
                continue
            if "home" in got:
                home = got["home"]
                want = f"unison.{old}.{name} moved to {home}.{name}; import it from {home} {REMOVED}"
                if messages[0] != want or got["home_id"] != got["id"]:
                    problems.append(f"{name}: {messages[0]!r}, the value at {home} is another object")
                if old in COLLIDING and not home.startswith(f"unison.{old}."):
                    problems.append(f"{name}: home {home} is outside unison.{old}")
            elif not messages[0].startswith(f"unison.{old}.{name} is gone: "):
                problems.append(f"{name}: {messages[0]!r}")
    assert problems == []


def test_a_complete_old_path_is_the_new_module_itself_and_the_new_module_keeps_its_spec(probe):
    """Where the new module still holds every old name, the old path is that module object."""
    for old in ("strategy", "state", "hookspecs", "checkpoint", "config_optim"):
        assert probe[old]["module"] == f"unison.{OLD_PATHS[old][0]}"
    # The import system sets the old spec on the module it gets; the new module gets its own back.
    assert probe["specs"] == {
        "unison.contract.strategy": "unison.contract.strategy",
        "unison.training.trainer": "unison.training.trainer",
    }


def test_a_colliding_package_still_gives_its_submodules_and_refuses_unknown_names():
    code = (
        "import warnings; warnings.simplefilter('error')\n"
        "from unison.data import shards, plan\n"
        "from unison.launch import torchrun\n"
        "import unison.config as c\n"
        "try:\n    from unison.data import no_such_name\nexcept ImportError as e:\n    print(e)\n"
        "print(hasattr(c, 'no_such_name'), shards.__name__, plan.__name__, torchrun.__name__)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.splitlines()[0].startswith("cannot import name 'no_such_name' from 'unison.data'")
    assert out.stdout.splitlines()[1] == "False unison.data.shards unison.data.plan unison.launch.torchrun"
