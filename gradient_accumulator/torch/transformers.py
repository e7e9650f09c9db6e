"""Hugging Face ``Trainer`` with token-exact accumulation by GradientAccumulateOptimizer.

The Trainer's own accumulation divides each micro-batch's summed loss by the cycle's token count
and sums the gradients in ``.grad`` (in the parameters' dtype). :class:`GradientAccumulationTrainer`
keeps the Trainer's loop — ``gradient_accumulation_steps`` micro-batches per update,
``global_step``, the scheduler and logging once per update, a short last cycle at the epoch's
end — but every micro-batch's loss is the mean over its own target tokens, and its gradient is
folded into the wrapper's fp32 accumulator with weight = its number of target tokens. The update
is the exact token mean of the whole cycle, with the wrapper's clipping::

    from gradient_accumulator.torch.transformers import GradientAccumulationTrainer

    args = TrainingArguments(..., gradient_accumulation_steps=4, max_grad_norm=1.0)
    trainer = GradientAccumulationTrainer(model=model, args=args, train_dataset=ds,
                                          data_collator=collate)
    trainer.train()

The inner optimizer and scheduler are the Trainer's (``optim``, ``lr_scheduler_type``,
``warmup_steps``), or pass ``optimizers=(GradientAccumulateOptimizer(...), scheduler)`` with
``accum_steps == gradient_accumulation_steps``. ``max_grad_norm`` clips the accumulated gradient
(the Trainer's own per-micro-batch clipping is off). Checkpoints hold the wrapper's full state.

Supported: transformers 5.17 and later (the ``[integrations]`` extra). Before 5.19 the Trainer
divides every micro-batch's loss by ``gradient_accumulation_steps`` unconditionally; from 5.19 a
class flag (``loss_is_scaled_for_ga``) turns that off. Which of the two the installed Trainer does
is read from the class at construction, and either way the loss reaches ``backward()``
undivided: the first micro-batch checks it and raises ``RuntimeError`` if the Trainer scaled it
in some other way, before anything is accumulated.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Callable

import torch
import transformers
from packaging.version import Version
from transformers import Trainer
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from gradient_accumulator._reaches import Reach
from gradient_accumulator.torch._options import HOOK_DICTS
from gradient_accumulator.torch.optimizer import GradientAccumulateOptimizer

__all__ = ["GradientAccumulationTrainer", "is_causal_lm", "target_tokens"]

IGNORE_INDEX = -100
# The oldest transformers the integration is tested with (and the [integrations] extra allows).
MIN_TRANSFORMERS = "5.17"

# transformers' internals the package relies on (probed by the integration tests).
REACHES = (
    Reach(
        "transformers",
        "transformers.models.auto.modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",
        "5.23.0",
        "recognising a causal LM, whose labels are shifted by one (is_causal_lm)",
    ),
    Reach(
        "transformers",
        "transformers.loss.loss_utils.LOSS_MAPPING, ForCausalLMLoss",
        "5.23.0",
        "recognising a model given the causal-LM loss by its loss_type (is_causal_lm)",
    ),
    Reach(
        "transformers",
        "PreTrainedModel()._loss_function",
        "5.23.0",
        "recognising a model given the causal-LM loss through model.loss_function = ... "
        "(is_causal_lm)",
    ),
)


def check_transformers_version(version: str) -> None:
    """Refuse a transformers older than :data:`MIN_TRANSFORMERS` (``ImportError``)."""
    if Version(version) < Version(MIN_TRANSFORMERS):
        raise ImportError(
            f"GradientAccumulationTrainer needs transformers>={MIN_TRANSFORMERS}, found "
            f"{version}: its Trainer loop differs (loss scaling, clipping hooks). Upgrade with "
            f"pip install 'transformers>={MIN_TRANSFORMERS}' "
            "(or pip install 'gradient-accumulator[integrations]')"
        )


def _base_model(model: Any) -> Any:
    """The transformers model inside wrappers: DDP's ``module``, PEFT's base model."""
    for _ in range(4):
        if hasattr(model, "get_base_model") and callable(model.get_base_model):
            model = model.get_base_model()
        elif isinstance(getattr(model, "module", None), torch.nn.Module):
            model = model.module
        else:
            break
    return model


def is_causal_lm(model: Any) -> bool:
    """Whether ``model``'s loss predicts ``labels[..., 1:]`` (a causal language model).

    True for transformers' causal-LM classes and any subclass of one (``GPT2LMHeadModel``,
    ``LlamaForCausalLM``, ...), and for any other decoder-only model whose forward uses the
    causal-LM loss function (its ``loss_function`` set to it, or a ``loss_type`` naming it, as
    ``loss_type="ForCausalLM"`` in the config does). False for encoder-decoder models, whose
    labels are the decoder's targets as given.
    """
    from transformers.loss.loss_utils import LOSS_MAPPING, ForCausalLMLoss

    model = _base_model(model)
    config = getattr(model, "config", None)
    if getattr(config, "is_encoder_decoder", False):
        return False
    causal = set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())
    if any(cls.__name__ in causal for cls in type(model).__mro__):
        return True
    loss_fn = vars(model).get("_loss_function")  # set through model.loss_function = ...
    if loss_fn is None:
        loss_type = vars(model).get("loss_type") or getattr(config, "loss_type", None)
        loss_fn = LOSS_MAPPING.get(loss_type) if isinstance(loss_type, str) else None
    return loss_fn is ForCausalLMLoss


def target_tokens(labels: torch.Tensor, shift: bool) -> int:
    """Number of target tokens in ``labels`` (entries other than -100).

    Args:
        labels: the micro-batch's labels.
        shift: True for causal language models, whose loss predicts ``labels[..., 1:]``.
    """
    if shift:
        labels = labels[..., 1:]
    return int((labels != IGNORE_INDEX).sum())


class _TrainerStep(torch.optim.Optimizer):
    """The optimizer the Trainer holds: its ``step()`` folds the cycle's last micro-batch with the
    weight the trainer recorded, and applies a short cycle (epoch end) with its true weight."""

    def __init__(self, wrapper: GradientAccumulateOptimizer) -> None:
        self.wrapper = wrapper
        self.pending_weight: float | None = None
        for name in HOOK_DICTS:
            setattr(self, name, OrderedDict())

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self.wrapper.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.wrapper.param_groups = value

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self.wrapper.state

    @state.setter
    def state(self, value: Any) -> None:
        self.wrapper.state = value

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        return self.wrapper.defaults

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        self.wrapper.defaults = value

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        weight = 1.0 if self.pending_weight is None else self.pending_weight
        self.pending_weight = None
        loss = self.wrapper.step(closure, weight=weight)
        if not self.wrapper.update_applied and self.wrapper.micro_step > 0:
            self.wrapper.flush()  # the epoch's short last cycle
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.wrapper.zero_grad(set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return self.wrapper.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.wrapper.load_state_dict(state_dict)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self.wrapper.add_param_group(param_group)


class GradientAccumulationTrainer(Trainer):
    """``transformers.Trainer`` whose accumulation is exact in the number of target tokens.

    Args:
        *args: ``Trainer``'s arguments.
        shift_labels: whether the loss predicts ``labels[..., 1:]`` (default:
            :func:`is_causal_lm` of the model: its class or a base class is one of
            transformers' causal language models, or its loss function is the causal-LM one).
        weight_fn: ``inputs -> weight`` of a micro-batch, instead of its target-token count
            (e.g. its number of samples for a per-sample mean loss).
        **kwargs: ``Trainer``'s keyword arguments.

    The logged ``loss`` is the loss each update used: its cycle's weighted mean
    ``Σ wᵢ·lossᵢ / Σ wᵢ`` (the cycle's token mean with the default weights), averaged over the
    updates since the last log as the Trainer does; it is formed on the device, with no read of
    the GPU.

    Attributes:
        accumulator: the :class:`GradientAccumulateOptimizer` (after ``create_optimizer``).

    Raises:
        ImportError: with a transformers older than 5.17.
    """

    def __init__(
        self,
        *args: Any,
        shift_labels: bool | None = None,
        weight_fn: Callable[[dict[str, Any]], float] | None = None,
        **kwargs: Any,
    ) -> None:
        check_transformers_version(transformers.__version__)
        super().__init__(*args, **kwargs)
        if shift_labels is None:
            shift_labels = is_causal_lm(self.model)
        self.shift_labels = bool(shift_labels)
        self.weight_fn = weight_fn
        # Each micro-batch's loss is a mean over its own targets, never divided by the number of
        # micro-batches: the wrapper forms the weighted mean. From transformers 5.19 a class flag
        # says so; before it, training_step divides by current_gradient_accumulation_steps
        # whenever no num_items_in_batch is passed, so that divisor is 1 during the step.
        self._trainer_divides = not hasattr(Trainer, "loss_is_scaled_for_ga")
        if not self._trainer_divides:
            self.loss_is_scaled_for_ga = True
        self._loss_checked = False
        self._computed_loss: torch.Tensor | None = None
        # The cycle so far, for the logged loss: Σ weight·loss (on the loss's device) and Σ weight.
        self._cycle_loss: torch.Tensor | None = None
        self._cycle_weight = 0.0
        self.accumulator: GradientAccumulateOptimizer | None = None
        self._trainer_step: _TrainerStep | None = None

    def create_optimizer(self, model: Any = None) -> torch.optim.Optimizer:
        """The Trainer's optimizer wrapped in a GradientAccumulateOptimizer (once)."""
        if self._trainer_step is not None:
            return self.optimizer
        k = self.args.gradient_accumulation_steps
        given = self.optimizer
        if isinstance(given, GradientAccumulateOptimizer):
            if given.accum_steps != k:
                raise ValueError(
                    f"optimizers[0] has accum_steps={given.accum_steps}, but "
                    f"gradient_accumulation_steps={k}; they must agree"
                )
            wrapper = given
        else:
            inner = (
                super().create_optimizer(model)
                if model is not None
                else (super().create_optimizer())
            )
            clip = self.args.max_grad_norm
            wrapper = GradientAccumulateOptimizer(
                inner, k, max_grad_norm=clip if clip and clip > 0 else None
            )
        self.accumulator = wrapper
        self._trainer_step = _TrainerStep(wrapper)
        self.optimizer = self._trainer_step
        return self.optimizer

    def micro_batch_weight(self, inputs: dict[str, Any]) -> float:
        """The micro-batch's weight: ``weight_fn(inputs)``, else its target-token count."""
        if self.weight_fn is not None:
            return float(self.weight_fn(inputs))
        labels = inputs.get("labels")
        if labels is None:
            raise ValueError(
                "the micro-batch has no 'labels' to count target tokens in; pass weight_fn="
            )
        return float(target_tokens(labels, self.shift_labels))

    def training_step(
        self, model: torch.nn.Module, inputs: dict[str, Any], num_items_in_batch: Any = None
    ) -> torch.Tensor:
        """Forward and backward of one micro-batch, then fold it into the accumulators."""
        weight = self.micro_batch_weight(inputs)
        step = self._trainer_step
        if step is None:
            raise RuntimeError("training_step() called before create_optimizer()")
        cycle = getattr(self, "current_gradient_accumulation_steps", 1)
        if self._trainer_divides:
            self.current_gradient_accumulation_steps = 1
        try:
            # num_items_in_batch is not passed on: the loss stays this micro-batch's token mean.
            loss = super().training_step(model, inputs, None)
        finally:
            self.current_gradient_accumulation_steps = cycle
        if not self._loss_checked:
            self._check_loss_unscaled(loss)
        if self.accelerator.sync_gradients:
            step.pending_weight = weight  # the Trainer's optimizer.step() folds it and updates
        else:
            step.wrapper.step(weight=weight)
            step.wrapper.zero_grad()
        return self._logged_loss(loss.detach(), weight, self.accelerator.sync_gradients)

    def _logged_loss(self, loss: torch.Tensor, weight: float, last: bool) -> torch.Tensor:
        """What the Trainer adds to its logged loss for this micro-batch.

        The Trainer sums these values and logs the sum divided by the updates since its last
        log. Each update's share is the loss the update used: the cycle's weighted mean
        ``Σ wᵢ·lossᵢ / Σ wᵢ`` (the token mean of the cycle, with the default weights), given on
        the cycle's last micro-batch; the others give 0. It stays a device tensor: no read of
        the GPU (the weights are host numbers already). A cycle of total weight 0 gives NaN,
        which the Trainer's ``logging_nan_inf_filter`` replaces as it does any NaN loss.
        """
        part = loss.float() * weight
        total = part if self._cycle_loss is None else self._cycle_loss + part
        if not last:
            self._cycle_loss = total
            self._cycle_weight += weight
            return torch.zeros_like(total)
        w, self._cycle_loss, self._cycle_weight = self._cycle_weight + weight, None, 0.0
        return total / w if w > 0 else torch.full_like(total, float("nan"))

    def compute_loss(self, model: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        """``Trainer.compute_loss``, noting the loss for the first micro-batch's check."""
        out = super().compute_loss(model, inputs, *args, **kwargs)
        if not self._loss_checked:
            loss = out[0] if isinstance(out, tuple) else out
            self._computed_loss = loss.detach() if isinstance(loss, torch.Tensor) else None
        return out

    def _check_loss_unscaled(self, loss: torch.Tensor) -> None:
        """The loss ``training_step`` backpropagated must be ``compute_loss``'s, unscaled."""
        computed, self._computed_loss = self._computed_loss, None
        if computed is None:
            return  # compute_loss overridden without calling ours: nothing to compare
        if computed.dim() > 0:
            computed = computed.mean()  # the Trainer's multi-GPU (DataParallel) mean
        if not torch.equal(loss.detach().to(computed.dtype), computed):
            ratio = float(loss.detach()) / float(computed) if float(computed) else float("nan")
            raise RuntimeError(
                f"transformers {transformers.__version__}'s Trainer.training_step scaled the "
                f"micro-batch's loss by {ratio:.6g} before backward(), which "
                "GradientAccumulationTrainer does not know how to undo; nothing was accumulated. "
                f"Supported: transformers>={MIN_TRANSFORMERS} with the Trainer's own "
                "training_step and compute_loss"
            )
        self._loss_checked = True

    def _clip_grad_norm(self, model: torch.nn.Module) -> Any:
        return None  # the wrapper clips the accumulated gradient (max_grad_norm)

    def _get_grad_norm(self, model: torch.nn.Module, grad_norm: Any = None) -> Any:
        return None  # .grad holds one micro-batch only; the wrapper records last_grad_norm
