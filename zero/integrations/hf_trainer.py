"""ZeroTrainer: the Hugging Face `Trainer`, training with zero-tiering's engine where it would use DeepSpeed.

    from zero.integrations import ZeroTrainer, ZeroTrainingArguments   # instead of Trainer, TrainingArguments

    args = ZeroTrainingArguments(output_dir="out", deepspeed="ds_config.json", ...)   # the same arguments
    trainer = ZeroTrainer(model=model, args=args, train_dataset=train_dataset)       # the same call
    trainer.train()                     # resume_from_checkpoint=True / "out/checkpoint-N" as usual
    trainer.save_model()                # out/model.safetensors + config.json: from_pretrained("out") loads it

`ZeroTrainingArguments` is `TrainingArguments` whose `deepspeed=` (a ds_config.json path or a dict) goes to
our engine instead of DeepSpeed; plain `TrainingArguments` (without `deepspeed=`) plus
`ZeroTrainer(..., zero_config="ds_config.json")` is the same. Neither DeepSpeed nor accelerate's DeepSpeed
plugin is involved: accelerate runs as for a plain CPU/DDP Trainer and never wraps the model.

What it mirrors of the Trainer's DeepSpeed integration (transformers.integrations.deepspeed and accelerate's
DeepSpeed wrappers):

- "auto" values are filled from the TrainingArguments by zero.config's rules (`TrainingArgs`, the Trainer's
  own: batch sizes, accumulation, clipping, Adam hyperparameters, precision, warmup and total steps, the
  hidden-size bucket sizes), once `train()` knows the number of steps; a value that cannot be filled, or a
  written one that disagrees with the arguments, is a ConfigError naming the key (at construction already
  when `max_steps` is set).
- The engine is built by `zero.initialize` in `create_optimizer()`: with the config's optimizer section over
  the Trainer's weight-decay / no-decay parameter groups (as the plain Trainer's AdamW has them), else over
  the Trainer's own optimizer (`optim`, `optimizers=`), whose hyperparameters it takes over. The LR
  scheduler is the config's, else the Trainer's own (`lr_scheduler_type`, or `optimizers=`) built on the
  engine's optimizer; the engine steps it after each optimizer step.
- `training_step` runs the forward through the engine, then `engine.backward` and `engine.step` every micro-batch;
  with gradient accumulation it keeps a step's micro-batches and runs them together at the last, unit-major
  (`engine.unit_major_step`: each unit gathered once a step each way), where the loss is the Trainer's own
  `compute_loss` normalized by the step's item count (loss_items.py; a model taking its own mean, as BERT's masked
  LM, and a subclass's own loss, such as DPO's pairing of a batch's rows, run micro-batch by micro-batch). Gradient
  accumulation and clipping are the engine's (its config's, filled from the arguments), and the Trainer's
  `optimizer` / `lr_scheduler` are views whose `step()` does nothing, as accelerate's DeepSpeedOptimizerWrapper /
  DeepSpeedSchedulerWrapper are. Logged `grad_norm` is the engine's (before clipping) and `learning_rate` the one
  the step used.
- Checkpoints: each `checkpoint-N/` holds the engine's checkpoint (`global_stepN/`, `latest`: parameters,
  fp32 masters and Adam moments wherever they live, scheduler, counters) beside what the Trainer writes
  there (trainer_state.json, rng_state.pth, the consolidated weights); `resume_from_checkpoint` loads it
  whole into the new engine, and the Trainer restores its RNG and data position itself: the resumed run is
  the uninterrupted one.
- `save_model` writes the consolidated weights as `model.safetensors` streamed unit by unit (peak memory one
  unit: `zero.integrations.weights`), plus the model's config.json (and generation_config.json), the
  tokenizer and training_args.bin, as `save_pretrained` does.

Trainers built on the Trainer (TRL's SFTTrainer, DPOTrainer) train the same way through `zero_trainer(cls)`
(derived_trainers.py), which puts ZeroTrainer between cls and Trainer in the method order; a `ref_model` it is
given is partitioned into the tiers (`zero.init_inference`) before cls prepares it.

Trainer internals this relies on (private names, as in transformers 5.x): `_wrap_model` (the engine is the
wrapped model, so accelerate never prepares it), `_move_model_to_device` (the engine places the parameters),
`_save_optimizer_and_scheduler` / `_load_optimizer_and_scheduler` / `_load_from_checkpoint` /
`_load_best_model` (where DeepSpeed's checkpoint is saved and loaded), `_clip_grad_norm` / `_get_grad_norm`
(the engine clips), `_prepare_inputs`, and the attributes `model_accepts_loss_kwargs`, `compute_loss_func`,
`loss_is_scaled_for_ga`, `current_gradient_accumulation_steps`, `is_in_train`, `state.max_steps` and
`accelerator.gradient_state.sync_gradients`.
"""
from __future__ import annotations

import contextlib
import copy
import json
import os
import random
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedModel, Trainer, TrainingArguments
from transformers.utils import logging

from ..accumulation.probe import StackedLossRefused
from ..checkpoint.format import LATEST
from ..config import ConfigError, TrainingArgs, load_config, read_json
from ..config.auto import resolve_auto
from ..engine import ZeroEngine
from .engine_views import EngineOptimizer, EngineScheduler
from ..initialize import initialize
from ..optim.lr_schedules import WarmupSchedule
from .loss_items import items_read
from .peft_save import save_adapters
from .save_on_signal import SaveOnSignal
from .weights import save_safetensors

logger = logging.get_logger(__name__)

TRAINING_ARGS_NAME = "training_args.bin"
"""Where the Trainer saves its arguments beside a model (transformers.trainer.TRAINING_ARGS_NAME)."""

METRIC_SCHEDULERS = ("reduce_lr_on_plateau", "greedy")
"""lr_scheduler_type values the Trainer steps with evaluation metrics, which the engine does not have."""


@dataclass
class ZeroTrainingArguments(TrainingArguments):
    """`TrainingArguments` whose `deepspeed=` config trains with zero-tiering's engine (`ZeroTrainer`) instead
    of DeepSpeed: a user's `TrainingArguments(deepspeed="ds_config.json", ...)` changes only its name. The
    config moves to `zero_config` (and `deepspeed` becomes None, so neither transformers nor accelerate looks
    for DeepSpeed)."""

    zero_config: dict | str | None = field(
        default=None,
        metadata={"help": "A DeepSpeed-format config (ds_config.json path or dict) for zero-tiering's engine. "
                          "`deepspeed=` is the same argument under the Trainer's name."},
    )

    save_on_signal: bool = field(
        default=False,
        metadata={"help": "On SIGTERM or SIGUSR1 (a scheduler's warning), save checkpoint-N in output_dir at the next "
                          "step end and stop training; train(resume_from_checkpoint=True) continues from it."},
    )

    _VALID_DICT_FIELDS = [*TrainingArguments._VALID_DICT_FIELDS, "zero_config"]

    def __post_init__(self):
        if self.deepspeed is not None:
            if self.zero_config is not None:
                raise ValueError("ZeroTrainingArguments: give the config once, as deepspeed= or as zero_config=")
            self.zero_config, self.deepspeed = self.deepspeed, None
        super().__post_init__()

    @property
    def place_model_on_device(self) -> bool:
        """The engine places the parameters (in their tiers); the Trainer must not move the model first."""
        return False


class ZeroTrainer(Trainer):
    """`transformers.Trainer` training with zero-tiering's engine; see the module docstring.

    `zero_config`: a DeepSpeed-format config (path or dict), needed unless `args` is a ZeroTrainingArguments
    with one. `zero_weights`: a safetensors checkpoint (a save_pretrained directory) a model built on the meta
    device takes, unit by unit straight into the tiers (zero.initialize's `weights`). Everything else is the
    Trainer's. After training, `trainer.engine` is the ZeroEngine;
    `close()` frees its buffers and nvme files (under stage 3 the model then holds no weights: save first).
    """

    def __init__(self, model: nn.Module | None = None, args: TrainingArguments | None = None, *rest: Any,
                 zero_config: str | os.PathLike | Mapping | None = None,
                 zero_weights: str | os.PathLike | None = None, **kwargs: Any):
        if args is not None and getattr(args, "deepspeed", None):
            raise ValueError(
                "TrainingArguments(deepspeed=...) hands the config to DeepSpeed through accelerate; to train with "
                "zero-tiering use zero.integrations.ZeroTrainingArguments(deepspeed=...) (the same arguments), "
                "or TrainingArguments without deepspeed= and ZeroTrainer(..., zero_config=...)")
        if args is not None and args.save_only_model and args.load_best_model_at_end:
            raise ValueError("save_only_model=True with load_best_model_at_end=True: the best model is loaded from "
                             "its checkpoint-N's engine checkpoint, which save_only_model leaves out (as transformers "
                             "refuses it with DeepSpeed): drop one")
        if zero_config is None and zero_weights is None:  # a zero_trainer(cls) class keeps them past cls's __init__
            zero_config, zero_weights = getattr(self, "_zero_arguments", (None, None))
        from_args = getattr(args, "zero_config", None)
        if zero_config is not None and from_args is not None:
            raise ValueError("ZeroTrainer: the config is given twice (zero_config= and args.zero_config): keep one")
        source = zero_config if zero_config is not None else from_args
        if source is None:
            raise ValueError("ZeroTrainer needs a DeepSpeed-format config: ZeroTrainingArguments(deepspeed="
                             "'ds_config.json', ...) or ZeroTrainer(..., zero_config='ds_config.json')")
        if isinstance(source, str) and source.lstrip().startswith("{"):
            source = json.loads(source)  # a JSON string, as the command line gives dict arguments
        self.zero_config = source
        self.zero_weights = zero_weights
        self.engine: ZeroEngine | None = None
        self._micro_batches: list[dict[str, Any]] = []
        """This optimizer step's micro-batches so far, with accumulation: they run together at its last one."""
        super().__init__(model, args, *rest, **kwargs)
        # The engine reduces each micro-batch's gradients itself: the Trainer's no_sync (DDP's) is not for it (every
        # transformers version asks the accelerator for it; newer ones first read sync_each_batch).
        self.accelerator.no_sync = lambda model: contextlib.nullcontext()
        if getattr(self.args, "save_on_signal", False):
            self.add_callback(SaveOnSignal(self))
        if self.args.max_steps > 0:  # every fact "auto" needs is known: report a bad config now, not in train()
            self._resolved_config(self.args.max_steps)

    # -- the config --------------------------------------------------------------------------------------------

    def _training_args(self, num_training_steps: int | None) -> TrainingArgs:
        """The facts "auto" is filled from, by the Trainer's rules (trainer_config_process / _finalize)."""
        a = self.args
        steps = num_training_steps if num_training_steps and num_training_steps > 0 else None
        return TrainingArgs(
            per_device_train_batch_size=a.per_device_train_batch_size,
            gradient_accumulation_steps=a.gradient_accumulation_steps,
            max_grad_norm=a.max_grad_norm, learning_rate=a.learning_rate, adam_beta1=a.adam_beta1,
            adam_beta2=a.adam_beta2, adam_epsilon=a.adam_epsilon, weight_decay=a.weight_decay,
            # DeepSpeed rejects 0 warmup steps, so the Trainer fills at least 1
            warmup_steps=max(1, a.get_warmup_steps(steps)) if steps is not None else None,
            num_training_steps=steps,
            fp16=bool(a.fp16 or getattr(a, "fp16_full_eval", False)),
            bf16=bool(a.bf16 or getattr(a, "bf16_full_eval", False)),
            zero3_save_16bit_model=True,  # save_model always writes the consolidated weights
        )

    def _resolved_config(self, num_training_steps: int | None, *, schedule: bool = True) -> dict:
        """The config with every "auto" filled (a dict for zero.initialize), without its scheduler unless
        `schedule`. Raises ConfigError (an UnresolvedAutoError for an "auto" the arguments cannot fill) naming
        the key."""
        args = self._training_args(num_training_steps)
        hidden = hidden_size(self.model)
        world = max(1, self.args.world_size)
        raw = _read_json(self.zero_config)
        if not schedule:
            raw.pop("scheduler", None)
        load_config(self.zero_config if schedule else copy.deepcopy(raw), world_size=world, hidden_size=hidden,
                    args=args)  # validates, names keys
        resolve_auto(raw, world_size=world, hidden_size=hidden, args=args)
        return raw

    # -- building the engine (where the Trainer creates its optimizer) ----------------------------------------

    def create_optimizer(self, model: nn.Module | None = None):
        """Builds the engine (once per model) and returns the Trainer's view of its optimizer."""
        if self.engine is None or self.engine.module is not self.model:
            self._build_engine(self.state.max_steps)
        return self.optimizer

    def create_optimizer_and_scheduler(self, num_training_steps: int) -> None:
        if self.engine is None or self.engine.module is not self.model:
            self._build_engine(num_training_steps)
        self.create_scheduler(num_training_steps)

    def create_scheduler(self, num_training_steps: int, optimizer=None):
        """The engine steps its scheduler: the Trainer's is a view of it whose step() does nothing. A later train()
        makes the engine's scheduler anew where the Trainer or the config made it (the Trainer unsets what it
        made), over the optimizer as training left it, as the plain Trainer does."""
        if self.engine is None:
            return super().create_scheduler(num_training_steps, optimizer)
        if self.lr_scheduler is None:
            self._renew_scheduler(num_training_steps)
        if not isinstance(self.lr_scheduler, EngineScheduler):
            self.lr_scheduler = EngineScheduler(self.engine)
        return self.lr_scheduler

    def _build_engine(self, num_training_steps: int | None, *, schedule: bool = True) -> None:
        """`schedule` False: without the LR scheduler the Trainer or the config makes (an evaluation before
        train(), which makes it once the steps are known)."""
        if self.engine is not None:  # a new model (model_init): the old engine's state goes with it
            self.close()
        config = self._resolved_config(num_training_steps, schedule=schedule)
        model = self.model
        optimizer, scheduler, groups = self.optimizer, self.lr_scheduler, None
        saved_scheduler = scheduler
        if "optimizer" in config:  # the config's Adam, over the plain Trainer's decay / no-decay groups
            groups = self._param_groups(model)
        elif optimizer is None:  # the Trainer's own (args.optim), its hyperparameters taken over
            optimizer = super().create_optimizer()
        if scheduler is not None and "scheduler" in _read_json(self.zero_config):
            raise ConfigError("scheduler", "both the config and the Trainer's optimizers= give an LR scheduler: "
                                           "keep one")
        if scheduler is None and schedule and "scheduler" not in config:  # the Trainer's, on the engine's optimizer
            if not num_training_steps or num_training_steps <= 0:
                raise ValueError("the Trainer's LR scheduler needs the number of training steps: build the engine "
                                 "in train() or create_optimizer_and_scheduler(num_training_steps)")
            scheduler = lambda zero_optimizer: self._trainer_scheduler(num_training_steps, zero_optimizer)  # noqa: E731
        with preserved_rng():  # building the engine draws nothing from the run's random streams
            engine, _, _, _ = initialize(model=model, model_parameters=groups, optimizer=optimizer,
                                         lr_scheduler=scheduler, config=config, weights=self.zero_weights)
        if engine.device.type != self.args.device.type:
            engine.close()
            raise ValueError(f"the engine computes on {engine.device} but the Trainer puts batches on "
                             f"{self.args.device} (use_cpu=True on a machine with CUDA): make them agree")
        self.engine = engine
        self.optimizer = EngineOptimizer(engine)
        self.lr_scheduler = EngineScheduler(engine)
        self._created_lr_scheduler = saved_scheduler is None  # the Trainer makes it anew at a later train()

    def _renew_scheduler(self, num_training_steps: int) -> None:
        engine = self.engine
        old = engine.lr_scheduler
        if isinstance(old, WarmupSchedule):  # it starts from the groups' rates: put back those it started from
            for group, lr in zip(engine.optimizer.param_groups, old.base_lrs):
                group["lr"] = lr
        config = self._resolved_config(num_training_steps)
        if "scheduler" in config:
            engine.lr_scheduler = WarmupSchedule(
                engine.optimizer, load_config(config, world_size=max(1, self.args.world_size)).scheduler)
        else:
            engine.lr_scheduler = self._trainer_scheduler(num_training_steps, engine.optimizer)
        self._created_lr_scheduler = True

    def _param_groups(self, model: nn.Module) -> list[dict]:
        """The Trainer's groups (Trainer.create_optimizer): weight decay except on biases and norms."""
        decay = set(self.get_decay_parameter_names(model))
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        groups = [{"params": [p for n, p in named if n in decay]},
                  {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0}]
        return [g for g in groups if g["params"]]

    def _trainer_scheduler(self, num_training_steps: int, optimizer):
        if str(getattr(self.args.lr_scheduler_type, "value", self.args.lr_scheduler_type)) in METRIC_SCHEDULERS:
            raise ValueError(f"lr_scheduler_type={self.args.lr_scheduler_type!r} steps on evaluation metrics, "
                             "which the engine's step does not have: use another type or a config scheduler")
        saved = self.lr_scheduler
        self.lr_scheduler = None
        try:
            return super().create_scheduler(num_training_steps=num_training_steps, optimizer=optimizer)
        finally:
            self.lr_scheduler = saved
            self._created_lr_scheduler = False

    def _wrap_model(self, model: nn.Module, training: bool = True, dataloader=None) -> nn.Module:
        """The engine is the wrapped model (so accelerate neither moves nor wraps it). An evaluation or predict()
        before train() builds it, as the Trainer builds DeepSpeed's there: the weights are in the tiers (on meta or
        under zero.Init they are nowhere else); train() then makes the LR scheduler."""
        if self.engine is None and not training and model is self.model:
            self._build_engine(None, schedule=False)
        if self.engine is not None and (model is self.engine or model is self.engine.module):
            return self.engine
        return super()._wrap_model(model, training, dataloader)

    def _move_model_to_device(self, model: nn.Module, device: torch.device) -> None:
        """Nothing: the engine puts every parameter in its tier (the whole model may not fit the device)."""

    # -- one micro-batch ------------------------------------------------------------------------------------

    def training_step(self, model: nn.Module, inputs: dict[str, Any], num_items_in_batch: Any = None) -> torch.Tensor:
        """With gradient accumulation, the step's micro-batches are kept until its last one and then run through
        each unit at once (engine.unit_major_step: the loss is `compute_loss` on the step's batch, returned at
        the last micro-batch, 0 at the others); where the schedule cannot run them, and without accumulation,
        each is a forward through the engine, engine.backward and engine.step (the optimizer runs at the
        boundary, with the engine's clipping). Returns the loss as the Trainer logs it."""
        engine = self.engine
        if engine is None:
            raise RuntimeError("ZeroTrainer.training_step runs inside train(), once the engine is built")
        model.train()
        inputs = self._prepare_inputs(inputs)
        accumulation = engine.gradient_accumulation_steps()
        if accumulation == 1 or not self.is_in_train or not self._stacked_loss_adds_up(num_items_in_batch):
            return self._micro_batch_step(model, inputs, num_items_in_batch, check_boundary=self.is_in_train)
        pending = self._micro_batches
        pending.append(inputs)
        del inputs
        boundary = len(pending) == accumulation
        if boundary != self.accelerator.gradient_state.sync_gradients:
            self._micro_batches = []
            raise self._boundary_error(boundary)
        if not boundary:
            return torch.zeros((), device=engine.device)
        self._micro_batches = []
        if isinstance(self.lr_scheduler, EngineScheduler):
            self.lr_scheduler.last_lrs = engine.get_lr()  # what this step runs at, for the log

        def step_loss(batch: dict[str, Any]) -> torch.Tensor:
            with self.compute_loss_context_manager(), items_read(self.model, self) as read:
                loss = self.compute_loss(model, batch, num_items_in_batch=num_items_in_batch)
            if not read():
                raise StackedLossRefused(f"{type(self.model).__name__}'s loss does not read num_items_in_batch (a "
                                         "mean of its own), so the Trainer adds up the micro-batches' means")
            return loss

        loss = engine.unit_major_step(pending, step_loss)
        if loss is not None:
            return loss
        return sum(self._micro_batch_step(model, batch, num_items_in_batch, check_boundary=False) for batch in pending)

    def _stacked_loss_adds_up(self, num_items_in_batch: Any) -> bool:
        """Whether the loss is the Trainer's own (the model's, or its label smoothing) normalized by the step's item
        count, so that the step's micro-batches stacked into one batch give the sum of their losses (loss_items.py:
        whether the model's loss reads the count shows in the probe's forward); a subclass's compute_loss may pair
        or weigh a batch's rows (TRL's DPO halves it into chosen and rejected) and a compute_loss_func is the
        user's."""
        return (type(self).compute_loss is Trainer.compute_loss and getattr(self, "compute_loss_func", None) is None
                and self._loss_scaled_for_ga(num_items_in_batch))

    def _loss_scaled_for_ga(self, num_items_in_batch: Any) -> bool:
        """The Trainer's rule: whether the loss is already a share of the accumulated batch (normalized by its
        items), or a micro-batch's mean the Trainer divides by the accumulation steps."""
        scaled = getattr(self, "loss_is_scaled_for_ga", None)
        if scaled is not None:
            return scaled
        return (getattr(self, "model_accepts_loss_kwargs", False) and num_items_in_batch is not None
                ) or getattr(self, "compute_loss_func", None) is not None

    def _micro_batch_step(self, model: nn.Module, inputs: dict[str, Any], num_items_in_batch: Any, *,
                          check_boundary: bool) -> torch.Tensor:
        engine = self.engine
        with self.compute_loss_context_manager():
            loss = self.compute_loss(model, inputs, num_items_in_batch=num_items_in_batch)
        del inputs
        scaled_for_ga = self._loss_scaled_for_ga(num_items_in_batch)
        accumulation = engine.gradient_accumulation_steps()
        boundary = engine.is_gradient_accumulation_boundary()
        if check_boundary and boundary != self.accelerator.gradient_state.sync_gradients:
            raise self._boundary_error(boundary)
        if scaled_for_ga:
            # Already a share of the accumulated batch (DeepSpeed's scale_wrt_gas=False): the engine divides
            # by the accumulation steps, so it gets the loss times them.
            engine.backward(loss * accumulation)
            reported = loss
        else:
            engine.backward(loss)
            reported = loss / getattr(self, "current_gradient_accumulation_steps", accumulation)
        if boundary and isinstance(self.lr_scheduler, EngineScheduler):
            self.lr_scheduler.last_lrs = engine.get_lr()  # what this step runs at, for the log
        engine.step()
        return reported.detach()

    def _boundary_error(self, boundary: bool) -> RuntimeError:
        engine = self.engine
        return RuntimeError(
            f"the Trainer {'ends' if not boundary else 'does not end'} an optimizer step at this micro-batch "
            f"but the engine (gradient_accumulation_steps {engine.gradient_accumulation_steps()}, micro step "
            f"{engine.micro_steps + len(self._micro_batches)}) {'does' if boundary else 'does not'}: an epoch's "
            "batches must be a multiple of gradient_accumulation_steps (set max_steps, dataloader_drop_last or the "
            "dataset size)")

    def _clip_grad_norm(self, model: nn.Module):
        """The engine clipped in its step: the norm before clipping, as clip_grad_norm_ returns it."""
        if self.engine is None:
            return super()._clip_grad_norm(model)
        return self.engine.get_global_grad_norm()

    def _get_grad_norm(self, model: nn.Module, grad_norm=None):
        if self.engine is None:
            return super()._get_grad_norm(model, grad_norm=grad_norm)
        return grad_norm if grad_norm is not None else self.engine.get_global_grad_norm()

    # -- checkpoints ------------------------------------------------------------------------------------------

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        """The engine's whole training state (every rank writes its part) into checkpoint-N/; a PEFT model's without
        its frozen base (as the Trainer saves DeepSpeed's: the resume builds the same base)."""
        if self.engine is None:
            return super()._save_optimizer_and_scheduler(output_dir)
        self.engine.save_checkpoint(output_dir, exclude_frozen_parameters=_is_peft(self.model))

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: nn.Module | None = None) -> None:
        """Nothing before the engine exists: `_load_optimizer_and_scheduler` loads the engine's checkpoint,
        weights included, once it is built."""
        _check_engine_checkpoint(resume_from_checkpoint)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None:
            return
        if self.engine is None:
            return super()._load_optimizer_and_scheduler(checkpoint)
        _check_engine_checkpoint(checkpoint)
        with preserved_rng():  # the Trainer restores its RNG from rng_state.pth where it wants it
            self.engine.load_checkpoint(checkpoint)

    def _load_best_model(self) -> None:
        if self.engine is None:
            return super()._load_best_model()
        best = self.state.best_model_checkpoint
        logger.info(f"Loading best model from {best} (score: {self.state.best_metric}).")
        _check_engine_checkpoint(best)
        with preserved_rng():
            self.engine.load_checkpoint(best)

    # -- saving the model -------------------------------------------------------------------------------------

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Consolidated weights as `model.safetensors` (streamed unit by unit, every rank gathering, the main
        process writing), the config (and generation config) for `from_pretrained`, the tokenizer and the
        training arguments."""
        if self.engine is None:
            return super().save_model(output_dir, _internal_call)
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        write = self.args.should_save
        if _is_peft(self.model):
            self._save_adapters(output_dir, write)
        else:
            save_safetensors(self.engine, output_dir, write=write)
        if write:
            logger.info(f"Saving model checkpoint to {output_dir}")
            if isinstance(self.model, PreTrainedModel) and not _is_peft(self.model):  # as save_pretrained writes them
                self.model.config.dtype = str(self.engine.compute_dtype).split(".")[1]
                self.model.config.architectures = [type(self.model).__name__]
                self.model.config.save_pretrained(output_dir)
                if self.model.can_generate() and getattr(self.model, "generation_config", None) is not None:
                    self.model.generation_config.save_pretrained(output_dir)
            if self.processing_class is not None:
                self.processing_class.save_pretrained(output_dir)
            elif getattr(self.data_collator, "tokenizer", None) is not None:
                self.data_collator.tokenizer.save_pretrained(output_dir)
            torch.save(self.args, os.path.join(output_dir, TRAINING_ARGS_NAME))
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=getattr(self.args, "hub_revision", None))

    def _save_adapters(self, output_dir: str, write: bool) -> None:
        """A PEFT model's adapters alone, as PEFT's own `save_pretrained` writes them (every adapter, and the
        embedding weights it saves beside them): what it saves gathered (every rank), the rest of the frozen base
        left where it rests (peft_save.py)."""
        save_adapters(self.engine, self.model, output_dir, write=write)

    # -- the end ----------------------------------------------------------------------------------------------

    def close(self) -> None:
        """Free the engine's buffers and nvme files (and a reference model's, zero_trainer's). Under stage 3 the
        model holds no weights afterwards."""
        reference = getattr(self, "reference_engine", None)
        if reference is not None:
            self.reference_engine = None
            reference.close()
        if self.engine is not None:
            engine, self.engine = self.engine, None
            self.optimizer = self.lr_scheduler = None
            self.model_wrapped = self.model
            engine.close()

    def end(self) -> None:
        self.close()
        super().end()


def hidden_size(model: nn.Module | None) -> int | None:
    """The model's hidden size as the Trainer's DeepSpeed integration finds it (for the "auto" bucket sizes)."""
    config = getattr(model, "config", None)
    for source in (config, getattr(config, "text_config", None)):
        if source is None:
            continue
        if isinstance(getattr(source, "hidden_size", None), int):
            return source.hidden_size
        if getattr(source, "hidden_sizes", None):
            return max(source.hidden_sizes)
    return None


@contextlib.contextmanager
def preserved_rng() -> Iterator[None]:
    """Python's, numpy's, torch's and CUDA's random states as they were on entry, restored on exit: what
    runs inside (building the engine, loading its checkpoint, which restores the RNG states it saved) leaves
    the Trainer's random streams alone; the Trainer restores them from rng_state.pth itself."""
    import numpy as np

    states = (random.getstate(), np.random.get_state(), torch.get_rng_state(),
              torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None)
    try:
        yield
    finally:
        random.setstate(states[0])
        np.random.set_state(states[1])
        torch.set_rng_state(states[2])
        if states[3] is not None:
            torch.cuda.set_rng_state_all(states[3])


def _read_json(source: str | os.PathLike | Mapping) -> dict:
    return copy.deepcopy(dict(source)) if isinstance(source, Mapping) else read_json(source)


def _is_peft(model: nn.Module) -> bool:
    """A PEFT model (its adapters are what a save writes)."""
    return getattr(model, "peft_config", None) is not None and callable(getattr(model, "save_pretrained", None))


def _check_engine_checkpoint(path: str | None) -> None:
    if path is None or not os.path.isfile(os.path.join(path, LATEST)):
        raise ValueError(f"{path!r} holds no zero-tiering checkpoint (no `{LATEST}` file): resume_from_checkpoint "
                         "takes a checkpoint-N folder a ZeroTrainer saved (save_only_model=False)")
