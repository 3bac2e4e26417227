"""Plugin API 2.0: the 1.x example migrated as the 2.0 page and migration said for a backend that wraps and
builds the optimizer in one call (docs/strategy-plugins.md at a0fa65f): keep ``setup``, add ``env=None`` to
its signature, declare ``api_version = "2.0"``; the helpers from their 0.2 home. Nothing else changed: the
override never binds ``self.env`` and applies no module feature (those came in 2.1)."""

import torch

import unison
from unison.contract.strategy import canonical, dcp_load, dcp_save


class MyStrategy(unison.Strategy):
    api_version = "2.0"  # the plugin API it is written against (unison.contract.API_VERSION)

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
            state_dict=unison.StateDictDeclaration(
                unison.StateDictKind.FULL,
                "DCP, keys = module parameter names",
                reshardable=True,
                canonical_export="module.state_dict() on every rank",
            ),
            refuses={unison.Feature.TRAINING_STEP: "why, and what to use instead"},
            replica_init=unison.ReplicaInit.TRAINER,  # the trainer broadcasts rank 0's weights
        )

    def setup(self, module, make_optimizer, *, env=None, precision, settings):
        # An engine that wraps and builds the optimizer in one call keeps its own setup (API 2.0).
        self.module = module.to(env.device)
        self.model = torch.nn.parallel.DistributedDataParallel(self.module)
        self.optimizer = make_optimizer(self.module.parameters())

    def no_sync(self):  # DeferredGradSync: the trainer-owned interface
        return self.model.no_sync()

    def clip_grad_norm(self, max_norm):  # the global pre-clip norm (DDP's gradients are synced)
        return torch.nn.utils.clip_grad_norm_(self.module.parameters(), max_norm or float("inf"))

    def full_state_dict(self):
        return canonical(self.module.state_dict())  # fp32, CPU, the module's own names

    def save_state(self, directory):
        dcp_save(self.module, self.optimizer, directory)  # the layout every torch strategy shares

    def load_state(self, directory):
        dcp_load(self.module, self.optimizer, directory)


@unison.hookimpl
def unison_strategies():
    return [unison.StrategySpec(name="compat_2_0", factory=MyStrategy, description="written for plugin API 2.0")]
