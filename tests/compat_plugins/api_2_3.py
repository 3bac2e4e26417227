"""Plugin API 2.3: an engine-style backend as the 2.3 page told its author (docs/strategy-plugins.md at
08b0842): one call wraps the model and builds the optimizer, so it implements the ``build`` hook of the setup
template (2.3) instead of overriding ``setup``, and it declares how backward and the replicas divide a loss
(``Ownership.loss_normalisation``, 2.3), so ``(loss_sum, num_items)`` losses train on it. It says nothing of
where the step's losses are (2.4): every rank holds its replica's."""

import torch

import unison
from unison.contract import DCP_FULL_STATE, LossDivisor, LossNormalisation, Reduction, ReplicatedStrategy


class MyEngine(ReplicatedStrategy):
    api_version = "2.3"  # the plugin API it is written against (unison.contract.API_VERSION)

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
            loss_normalisation=LossNormalisation(
                divisor=LossDivisor.MICRO_BATCHES,  # backward sees loss / A (the trainer's division)
                replicas=Reduction.MEAN,  # DDP averages the replicas' gradients
                over="the data-parallel replicas",
            ),
        )

    def build(self, module, make_optimizer):  # the setup template's hook (API 2.3): wrap and build in one call
        model = torch.nn.parallel.DistributedDataParallel(module)
        return model, make_optimizer(module.parameters())

    def no_sync(self):  # DeferredGradSync: the trainer-owned interface
        return self.model.no_sync()


@unison.hookimpl
def unison_strategies():
    return [unison.StrategySpec(name="compat_2_3", factory=MyEngine, description="written for plugin API 2.3")]
