"""Plugin API 2.1: the strategy-plugin page's example of 2.1 (docs/strategy-plugins.md at 705c442), as written;
only the registered name differs. On the setup template, whose ``apply_features`` hook gives it ``compile``
and ``activation_checkpointing``."""

# my_backend.py
import torch

import unison
from unison.contract import DCP_FULL_STATE, ReplicatedStrategy


class MyStrategy(ReplicatedStrategy):
    api_version = "2.1"  # the plugin API it is written against (unison.contract.API_VERSION)

    @property
    def ownership(self):  # frozen, printed by `unison describe mine`
        return unison.Ownership(
            grad_accumulation=unison.GradAccumulation(
                unison.AccumulationOwner.TRAINER, "no_sync() on non-boundary micro-steps"
            ),
            precision={
                "32-true": unison.PrecisionSupport(unison.PrecisionOwner.TRAINER, "fp32"),
                "bf16-mixed": unison.PrecisionSupport.unsupported("not wired yet"),
                "bf16-true": unison.PrecisionSupport.unsupported("not wired yet"),
                "16-mixed": unison.PrecisionSupport.unsupported("not wired yet"),
            },
            state_dict=DCP_FULL_STATE,  # ReplicatedStrategy's save_state/load_state write it
            refuses={unison.Feature.TRAINING_STEP: "why, and what to use instead"},
            replica_init=unison.ReplicaInit.TRAINER,  # the trainer broadcasts rank 0's weights
        )

    def wrap_module(self, module):  # a hook of Strategy.setup; module is on self.env.device already
        return torch.nn.parallel.DistributedDataParallel(module)

    def no_sync(self):  # DeferredGradSync: the trainer-owned interface
        return self.model.no_sync()


@unison.hookimpl
def unison_strategies():
    return [unison.StrategySpec(name="compat_2_1", factory=MyStrategy, description="written for plugin API 2.1")]
