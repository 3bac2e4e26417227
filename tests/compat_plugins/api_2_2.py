"""Plugin API 2.2: an engine-style backend as the 2.2 page told its author (docs/strategy-plugins.md at
4172212): it overrides ``setup`` (one call wraps the model and builds the optimizer), so it applies the module
features itself with ``unison.contract.transforms``; it reads the run's plugins (``Strategy.plugins``, 2.2) for
the model's tensor-parallel plan, which a data-parallel engine only reports."""

import torch

import unison
from unison.contract import DCP_FULL_STATE, ReplicatedStrategy
from unison.contract.tensor_parallel import tensor_parallel_plan
from unison.contract.transforms import checkpoint_blocks, compile_forward, compile_options


class MyEngine(ReplicatedStrategy):
    api_version = "2.2"  # the plugin API it is written against (unison.contract.API_VERSION)

    @property
    def ownership(self):  # frozen, printed by `unison describe mine`
        return unison.Ownership(
            grad_accumulation=unison.GradAccumulation(
                unison.AccumulationOwner.TRAINER, "no_sync() on non-boundary micro-steps"
            ),
            precision={
                "32-true": unison.PrecisionSupport(unison.PrecisionOwner.TRAINER, "fp32"),
                "bf16-mixed": unison.PrecisionSupport(unison.PrecisionOwner.TRAINER, "autocast by the trainer"),
                "bf16-true": unison.PrecisionSupport.unsupported("not wired yet"),
                "16-mixed": unison.PrecisionSupport.unsupported("not wired yet"),
            },
            state_dict=DCP_FULL_STATE,  # ReplicatedStrategy's save_state/load_state write it
            replica_init=unison.ReplicaInit.TRAINER,  # the trainer broadcasts rank 0's weights
        )

    def setup(self, module, make_optimizer, *, env=None, precision, settings):
        # One call wraps and builds the optimizer, so this strategy keeps its own setup (API 2.0) and applies
        # the module features itself, in the template's order (API 2.1).
        self.env = env if env is not None else self.env
        self.precision, self.settings = precision, settings
        self.tp_plan = tensor_parallel_plan(module, self.plugins)  # API 2.2: None for a model no plugin plans
        self.module = module.to(self.env.device)
        if settings.activation_checkpointing is not None:
            checkpoint_blocks(self.module, settings.activation_checkpointing)
        options = compile_options(settings.compile)
        if options is not None:
            compile_forward(self.module, options)
        self.model = torch.nn.parallel.DistributedDataParallel(self.module)
        self.optimizer = make_optimizer(self.module.parameters())

    def no_sync(self):  # DeferredGradSync: the trainer-owned interface
        return self.model.no_sync()


@unison.hookimpl
def unison_strategies():
    return [unison.StrategySpec(name="compat_2_2", factory=MyEngine, description="written for plugin API 2.2")]
