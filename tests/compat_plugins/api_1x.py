"""Plugin API 1.x: the strategy-plugin page's example before the setup template (docs/strategy-plugins.md at
5799d89), as written; only the registered name differs. ``setup`` takes no ``env`` and the helpers come from
the 0.1 path ``unison.strategy``. Registration refuses it with the 2.0 migration."""

# my_backend.py
import torch

import unison
from unison.strategy import StrategySpec, canonical, dcp_load, dcp_save


class MyStrategy(unison.Strategy):
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

    def setup(self, module, make_optimizer, *, precision, settings):
        # self.env (rank, world size, device) is bound by the trainer before setup;
        # precision.name / precision.support say how the declared precision is applied.
        self.module = module.to(self.env.device)
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
    return [StrategySpec(name="compat_1x", factory=MyStrategy, description="written for plugin API 1.x")]
