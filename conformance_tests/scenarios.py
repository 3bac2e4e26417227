"""The scenario catalogue: what "trains identically" means, one scenario at a time.

Each :class:`~unison.conformance.spec.Scenario` (:mod:`unison.conformance.spec`) fixes a tiny
model (:mod:`unison.conformance.models`), a dataset (:mod:`unison.conformance.data`), an
optimizer, the trainer settings and the runs to execute and compare; this module is the table. It is
past 400 lines because it is one table: a reader sees every scenario, with why it exists, in one place.
"""

from __future__ import annotations

from collections.abc import Sequence

from unison.conformance.data import BACKOFF_STEPS, Sizing
from unison.conformance.spec import BF16_MIXED, FP16_MIXED, FP32, Run, Scenario

RESUME_AT = 3


def _resume_runs(at: int = RESUME_AT) -> tuple[Run, ...]:
    """Uninterrupted, interrupted at step ``at`` and resumed, for both backends."""
    return (
        Run("full", "reference"),
        Run("part", "reference", max_steps=at, save=True),
        Run("resumed", "reference", resume_from="part", truth="full"),
        Run("full", "strategy", twin="full"),
        Run("part", "strategy", max_steps=at, save=True, twin="part"),
        Run("resumed", "strategy", resume_from="part", truth="full", twin="resumed", same_as=("full",)),
    )


def _clip_runs() -> tuple[Run, ...]:
    return (
        Run("main", "reference"),
        # The control: without clipping the reference must end elsewhere,
        # or "clipping" clipped nothing (the pre-clip norm alone cannot tell).
        Run("unclipped", "reference", overrides=(("grad_clip_norm", None),)),
        Run("main", "strategy", twin="main"),
    )


#: The id of a precision scenario's fp32 control run (a reference run of the same scenario in
#: ``32-true``): how far the reference moves from it is the effect the scenario exists to see
#: (:mod:`unison.conformance.sensitivity`).
PRECISION_CONTROL = "fp32"


def _precision_runs() -> tuple[Run, ...]:
    return (
        Run("main", "reference"),
        Run(PRECISION_CONTROL, "reference", overrides=(("precision", FP32),)),
        Run("main", "strategy", twin="main"),
    )


def _feature_runs(option: str, value: object) -> tuple[Run, ...]:
    """The reference without the module feature, the strategy with it (the feature changes no number)."""
    return (Run("main", "reference"), Run("main", "strategy", twin="main", overrides=((option, value),)))


def _feature_rng_scenario(name: str, description: str, feature: tuple[str, object]) -> Scenario:
    """The Dropout model trained by the strategy with ``feature`` (option, value) and without: equal, so the
    feature preserved the RNG stream; compared with the strategy's own run (masks depend on the world size)."""
    return Scenario(
        name,
        description,
        model="dropout_blocks",
        optimizer="sgd",
        accumulate_grad_batches=2,
        # Other masks change the first step's gradients: three steps show it (a recompute without the RNG
        # state: 180x the tolerance after six), at half the cost of every strategy's six.
        max_steps=3,
        runs=(
            Run("off", "reference"),
            Run("off", "strategy"),
            Run("on", "strategy", overrides=(feature,), same_as=("off",)),
        ),
    )


#: The token scenarios' reference runs: at accumulation 1 (the whole global batch in one micro-batch), and the
#: control trained on each micro-batch slice's own token mean.
FULL_BATCH, SLICE_MEAN = "full_batch", "slice_mean"


def _token_runs() -> tuple[Run, ...]:
    """The strategy against the reference at the same split, and against the reference's full-batch run."""
    return (
        Run("main", "reference"),
        Run(FULL_BATCH, "reference", overrides=(("accumulate_grad_batches", 1),)),
        Run(SLICE_MEAN, "reference", loss="token_slice_mean"),
        Run("main", "strategy", twin="main"),
    )


def _token_scenario(name: str, description: str, **kw: object) -> Scenario:
    return Scenario(
        name,
        description,
        optimizer="sgd",
        accumulate_grad_batches=2,
        max_steps=4,
        control=(SLICE_MEAN, "training each micro-batch slice's own token mean"),
        full_batch=FULL_BATCH,
        runs=_token_runs(),
        **kw,  # type: ignore[arg-type]
    )


#: The step a ``fresh_resume`` run saves at (of 6).
FRESH_RESUME_AT = 3


SCENARIOS: tuple[Scenario, ...] = (
    Scenario(
        "plain",
        "MLP, fp32, one micro-batch per step, SGD with momentum",
        model="mlp",
        optimizer="sgd",
    ),
    Scenario(
        "validation",
        "val/loss every 2 steps on 17 samples, 3 per replica per batch: a short last chunk split unevenly over "
        "the replicas (3+2 at world 2, 2+1+1+1 at 4), its losses rising along it; the per-sample mean over all "
        "replicas at every validation",
        model="mlp",
        optimizer="sgd",
        val_every=2,
    ),
    Scenario(
        "accumulation",
        "MLP, 4 micro-batches per optimizer step: gradients synchronised as the strategy declares (at the "
        "boundary only, or at every micro-step)",
        model="mlp",
        optimizer="sgd",
        accumulate_grad_batches=4,
        same_sync_as="plain",
    ),
    Scenario(
        "training_step",
        "dict batches trained with training_step(model, batch), accumulation 2",
        model="mlp",
        optimizer="sgd",
        accumulate_grad_batches=2,
        data="dict",
        form="training_step",
    ),
    Scenario(
        "clipping",
        "MLP, clip by global norm at a value half the steps exceed (clipped) and half stay under (left "
        "unchanged: the coefficient is capped at 1), accumulation 2",
        model="mlp",
        optimizer="sgd",
        accumulate_grad_batches=2,
        # The reference's pre-clip norms at micro-batch 8 (world 1 and 2): 2.63, 2.66, 1.68, 2.36, 1.02,
        # 1.56, 1.85, 2.39 (unclipped: median 1.87); at micro-batch 16 (world 4): 1.85, 1.50, 1.34,
        # 1.62, 1.24, 1.99, 0.93, 1.56 unclipped (median 1.53).
        grad_clip_norm=2.0,
        grad_clip_norm_at=((8, 2.0), (16, 1.5)),
        max_steps=8,
        premises=("straddles_clip",),
        runs=_clip_runs(),
    ),
    Scenario(
        "tied_weights",
        "tied weights (one matrix under two names) clipped by global norm: the tie counted once",
        model="tied",
        optimizer="sgd",
        accumulate_grad_batches=2,
        grad_clip_norm=0.05,
        premises=("clips",),
        runs=_clip_runs(),
    ),
    Scenario(
        "lr_scheduler",
        "two parameter groups (lr, weight decay) under a StepLR schedule",
        model="groups",
        optimizer="adamw_groups",
        scheduler="step",
        accumulate_grad_batches=2,
    ),
    Scenario(
        "transformer_block",
        "one transformer block (causal self-attention + MLP, LayerNorm, residuals; split by tensor parallel, "
        "cut by a pipeline), SGD with momentum, clipping at 1.0, accumulation 2",
        model="block",
        # SGD, not Adam: the key projection's bias gets a zero gradient in exact arithmetic (softmax ignores a
        # shift shared by every key), so its gradient is rounding noise, which Adam's normalised update turns
        # into lr-sized steps whose sign depends on the summation order (measured: 2.3e-3 apart).
        optimizer="sgd",
        accumulate_grad_batches=2,
        grad_clip_norm=1.0,
    ),
    Scenario(
        "buffers",
        "BatchNorm buffers (running statistics, step counter) that change at every step, accumulation 2; "
        "compared at every checkpoint and at the end",
        model="batchnorm",
        optimizer="sgd",
        accumulate_grad_batches=2,
        checkpoint_every=2,
        premises=("buffers_change",),
    ),
    Scenario(
        "frozen",
        "first layer frozen, clipping on, accumulation 2, weight decay 2.0 (a frozen parameter decayed moves)",
        model="frozen",
        optimizer="adamw_decay",
        accumulate_grad_batches=2,
        grad_clip_norm=1.0,
    ),
    Scenario(
        "replica_init",
        "every rank but 0 starts from perturbed weights: replicas must still train like the reference "
        "(whoever the declaration says makes them equal)",
        model="mlp",
        optimizer="sgd",
        accumulate_grad_batches=2,
        runs=(Run("main", "reference"), Run("main", "strategy", twin="main", perturb="weights")),
    ),
    Scenario(
        "replica_init_buffers",
        "every rank but 0 starts from perturbed buffers (running statistics, step counter)",
        model="batchnorm",
        optimizer="sgd",
        accumulate_grad_batches=2,
        runs=(Run("main", "reference"), Run("main", "strategy", twin="main", perturb="buffers")),
    ),
    Scenario(
        "bf16_mixed",
        "bf16 autocast (or the engine's bf16), accumulation 2; targets near 128, where bf16 rounds every "
        "prediction to a whole number, so training in bf16 ends far (> 10x the tolerance) from its fp32 control run",
        # SGD, not Adam: Adam's first update is lr * sign(g), so a gradient
        # element near zero whose sign bf16 rounding flips (summation order
        # differs with the number of ranks) moves by 2 * lr and the
        # comparison measures the sign of noise, not the backend. SGD's update
        # is proportional to the gradient, so bf16 rounding stays bf16-sized.
        model="offset",
        data="offset",
        precision=BF16_MIXED,
        optimizer="sgd",
        accumulate_grad_batches=2,
        runs=_precision_runs(),
    ),
    Scenario(
        "fp16_overflow",
        "fp16 with loss scaling; one sample's inputs overflow fp16 in the forward: that step is skipped "
        "and the scheduler does not advance",
        model="mlp",
        precision=FP16_MIXED,
        optimizer="sgd",
        scheduler="warmup",
        accumulate_grad_batches=2,
        data="overflow",
        shuffle=False,
        premises=("overflow",),
        runs=_precision_runs(),
    ),
    Scenario(
        "compile",
        "the strategy trains with compile=True (torch.compile, inductor), the reference without; accumulation 2: "
        "the same numbers at the fp32 tolerances, and frames compiled on every rank",
        model="mlp",
        optimizer="sgd",
        accumulate_grad_batches=2,
        probe="compile",
        runs=_feature_runs("compile", True),
    ),
    Scenario(
        "activation_checkpointing",
        'the strategy trains with activation_checkpointing="full" (every block recomputed in backward), the '
        "reference without; accumulation 2: the same numbers, and the recomputed forwards' FLOPs on the ranks",
        model="blocks",
        optimizer="sgd",
        accumulate_grad_batches=2,
        probe="activation_checkpointing",
        runs=_feature_runs("activation_checkpointing", "full"),
    ),
    _feature_rng_scenario(
        "activation_checkpointing_rng",
        'a Dropout model trained by the strategy with activation_checkpointing="full" and without, accumulation '
        "2: equal (the recomputed forward restores the RNG state, so it draws the masks the forward drew); "
        "compared with the strategy's own run, since dropout masks depend on the world size",
        ("activation_checkpointing", "full"),
    ),
    _feature_rng_scenario(
        "compile_rng",
        "the Dropout model trained by the strategy with compile=True and without, accumulation 2: equal (the "
        "suite compiles with inductor's fallback_random, so compiled dropout draws from the generator eager "
        "dropout draws from: a compile path that draws from it, or reseeds it, is seen); compared with the "
        "strategy's own run, since dropout masks depend on the world size",
        ("compile", True),
    ),
    Scenario(
        "resume",
        "save at step 3, resume to step 6: equals the uninterrupted run, buffers included (frozen layer, "
        "changing BatchNorm buffers, warmup)",
        model="frozen_batchnorm",
        optimizer="adamw",
        scheduler="warmup",
        accumulate_grad_batches=2,
        runs=_resume_runs(),
    ),
    Scenario(
        "resume_sgd",
        "save at step 3, resume to step 6 with SGD momentum under StepLR: the momentum buffers and the schedule "
        "are restored",
        model="mlp",
        optimizer="sgd",
        scheduler="step",
        accumulate_grad_batches=2,
        runs=_resume_runs(),
    ),
    Scenario(
        "resume_rmsprop",
        "save at step 3, resume to step 6 with RMSprop and momentum (per-parameter state other than Adam's), warmup",
        model="mlp",
        optimizer="rmsprop",
        scheduler="warmup",
        accumulate_grad_batches=2,
        runs=_resume_runs(),
    ),
    Scenario(
        "cross_resume",
        "a checkpoint of the strategy resumes under single, and a checkpoint of single under the strategy "
        "(parameter groups, StepLR; a world-size change, so declared reshardable)",
        model="groups",
        optimizer="adamw_groups",
        scheduler="step",
        accumulate_grad_batches=2,
        requires_reshardable=True,
        runs=(
            Run("full", "reference"),
            Run("part", "reference", max_steps=RESUME_AT, save=True),
            Run("resumed", "reference", resume_from="part", truth="full"),
            Run("part", "strategy", max_steps=RESUME_AT, save=True, twin="part"),
            # A reference-backend run from the strategy's checkpoint: it runs
            # after the strategy's world has written that checkpoint.
            Run("from_strategy", "reference", resume_from="strategy:part", truth="full"),
            Run("from_single", "strategy", resume_from="reference:part", truth="full", twin="resumed"),
        ),
    ),
    Scenario(
        "reshard",
        "save at the main world size, resume at another world size with the same strategy and with single "
        "(declared reshardable; changing buffers)",
        model="batchnorm",
        optimizer="adamw",
        scheduler="step",
        accumulate_grad_batches=2,
        requires_reshardable=True,
        runs=(
            Run("full", "reference"),
            Run("part", "reference", max_steps=RESUME_AT, save=True),
            Run("resumed", "reference", resume_from="part", truth="full"),
            Run("part", "strategy", max_steps=RESUME_AT, save=True, twin="part"),
            Run("resumed", "strategy", world="alt", resume_from="part", truth="full", twin="resumed"),
            # The same checkpoint in one process under single: a world-size
            # change every reshardable format must survive, and the check that
            # remains when the strategy itself cannot run at the other world
            # size (a 2-stage pipeline needs 2 ranks).
            Run("single_from_strategy", "reference", resume_from="strategy:part", truth="full"),
        ),
    ),
    Scenario(
        "unsupported_precision",
        "every precision declared unsupported raises a ConfigurationError naming it when the Trainer is "
        "built (before any process group); every precision declared supported is accepted",
        kind="declarations",
        runs=(),
    ),
    Scenario(
        "resume_adagrad",
        "save at step 3, resume to step 6 with Adagrad in two parameter groups (state created in its "
        "constructor: a sum of squared gradients from initial_accumulator_value, a step count read by lr_decay), "
        "warmup",
        model="groups",
        optimizer="adagrad_groups",
        scheduler="warmup",
        accumulate_grad_batches=2,
        runs=_resume_runs(),
    ),
    Scenario(
        "resume_fp16",
        f"fp16 with loss scaling: {BACKOFF_STEPS} forced overflows back the scale off from 2**16 to "
        f"2**{16 - BACKOFF_STEPS}, one step trains, save, resume to step 8; ordinary gradients here overflow at "
        "2**16, so a resume that loses the scaler's state skips steps the uninterrupted run takes",
        model="mlp",
        precision=FP16_MIXED,
        optimizer="sgd",
        accumulate_grad_batches=2,
        data="backoff",
        shuffle=False,
        max_steps=BACKOFF_STEPS + 4,
        runs=_resume_runs(at=BACKOFF_STEPS + 1),
    ),
    _token_scenario(
        "token_loss",
        "a token-level loss on padded sequences of valid length 2..12 of 12 (labels -100 on padding) as the "
        "pair (loss_sum, num_items) from loss_fn, accumulation 2: the global batch's summed loss over its "
        "global token count, equal to the reference at the same split and at accumulation 1; its control "
        "(each slice's own token mean) ends far from it",
        model="token_lm",
        data="tokens",
        loss="token",
    ),
    _token_scenario(
        "token_loss_hf",
        "the Hugging Face path: a LlamaForCausalLM (local config) on dict batches with labels, neither loss_fn "
        "nor training_step, accumulation 2: the model's own loss normalised by the step's global count of "
        "labels != -100, equal to the reference at the same split and at accumulation 1",
        model="llama",
        data="token_dicts",
        form="huggingface",
    ),
    Scenario(
        "default_plugins",
        "a Dropout model trained with the Trainer's default callbacks, loggers and progress display on, and "
        "with all of them off: equal bit for bit (no plugin draws from, reseeds or restores the training RNG)",
        model="dropout",
        optimizer="sgd",
        accumulate_grad_batches=2,
        runs=(
            Run("on", "reference", defaults=True),
            Run("off", "reference", overrides=(("throughput", False),), exact_as=("on",)),
            Run("on", "strategy", defaults=True),
            Run("off", "strategy", overrides=(("throughput", False),), exact_as=("on",)),
        ),
    ),
    Scenario(
        "fresh_resume",
        f"a Dropout model saved at step {FRESH_RESUME_AT} and resumed to step 6 in new processes (a new world): "
        "equal to the uninterrupted run, and bit for bit to the same checkpoint resumed in the process that "
        "wrote it (the RNG states travel in the checkpoint; nothing a process caches may change them)",
        model="dropout",
        optimizer="sgd",
        scheduler="step",
        accumulate_grad_batches=2,
        runs=(
            Run("full", "reference"),
            Run("part", "reference", max_steps=FRESH_RESUME_AT, save=True),
            Run("resumed", "reference", resume_from="part", truth="full", exact_as=("full",)),
            Run("full", "strategy"),
            Run("part", "strategy", max_steps=FRESH_RESUME_AT, save=True),
            Run("resumed_here", "strategy", resume_from="part", same_as=("full",)),
            Run(
                "resumed",
                "strategy",
                world="fresh",
                resume_from="part",
                same_as=("full",),
                exact_as=("resumed_here",),
            ),
        ),
    ),
)


SCENARIOS_BY_NAME: dict[str, Scenario] = {s.name: s for s in SCENARIOS}


def select(names: Sequence[str] | None, sizing: Sizing | None = None) -> tuple[Scenario, ...]:
    """The scenarios named (all when ``names`` is empty), in catalogue order; as they run at
    ``sizing`` when given (:meth:`Scenario.sized`)."""
    if sizing is not None:
        return tuple(s.sized(sizing) for s in select(names))
    if not names:
        return SCENARIOS
    unknown = [n for n in names if n not in SCENARIOS_BY_NAME]
    if unknown:
        raise KeyError(f"unknown scenario(s) {unknown}; known: {sorted(SCENARIOS_BY_NAME)}")
    wanted = set(names)
    # Dependencies come along: a scenario comparing its sync pattern with
    # another needs that one's runs.
    for n in list(wanted):
        dep = SCENARIOS_BY_NAME[n].same_sync_as
        if dep:
            wanted.add(dep)
    return tuple(s for s in SCENARIOS if s.name in wanted)
