"""Every private part of Lightning, accelerate and transformers the package relies on is still
there.

Each record of the ``REACHES`` in ``torch/_proxy.py`` (Lightning), ``torch/accelerate.py`` and
``torch/transformers.py`` has a probe here that exercises it as the package does; a probe that
fails names the record, the installed version and the one it was checked against.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

pytest.importorskip("lightning")
pytest.importorskip("accelerate")
transformers = pytest.importorskip("transformers")

from accelerate.state import AcceleratorState, GradientState  # noqa: E402

from gradient_accumulator._reaches import Reach, moved  # noqa: E402
from gradient_accumulator.torch import _proxy  # noqa: E402
from gradient_accumulator.torch import accelerate as ga_accelerate  # noqa: E402
from gradient_accumulator.torch import transformers as ga_transformers  # noqa: E402
from gradient_accumulator.torch.optimizer import (  # noqa: E402
    GradientAccumulateOptimizer,
    unwrap_optimizer,
)


@pytest.fixture(autouse=True)
def _fresh_accelerate_state():
    # accelerate's state is process-wide: every test starts and ends without it.
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def _wrapper() -> tuple[GradientAccumulateOptimizer, nn.Parameter]:
    w = nn.Parameter(torch.zeros(2))
    return GradientAccumulateOptimizer(torch.optim.SGD([w], lr=0.1), 2), w


class _Strategy:
    lightning_module = None


def _lightning_proxy() -> tuple:
    from lightning.pytorch.core.optimizer import LightningOptimizer

    opt, w = _wrapper()
    strategy = _Strategy()
    return LightningOptimizer._to_lightning_optimizer(opt, strategy), opt, strategy, w


def _lightning_subclass() -> None:
    proxy, opt, _, _ = _lightning_proxy()
    assert isinstance(proxy, GradientAccumulateOptimizer), "the proxy is no longer a subclass"
    assert _proxy.is_lightning_proxy(type(proxy)), "the proxy class is not recognised"
    assert unwrap_optimizer(proxy) is opt


def _lightning_attributes() -> None:
    proxy, opt, strategy, w = _lightning_proxy()
    assert vars(proxy)["_optimizer"] is opt
    assert proxy._strategy.lightning_module is None
    assert callable(proxy._on_before_step) and callable(proxy._on_after_step)
    w.grad = torch.ones(2)
    proxy.step()  # a micro-step: forwarded to the real wrapper
    assert opt.micro_step == 1 and proxy.micro_step == 1


def _accelerate_steps() -> None:
    import accelerate

    accelerate.Accelerator(cpu=True, gradient_accumulation_steps=3)
    kwargs = GradientState._shared_state["plugin_kwargs"]
    assert int(kwargs["num_steps"]) == 3
    opt, w = _wrapper()
    w.grad = torch.ones(2)
    with pytest.raises(ValueError, match="over 3 steps"):
        opt.step()


def _accelerate_prepared() -> None:
    import accelerate

    opt, _ = _wrapper()
    assert accelerate.Accelerator(cpu=True).prepare(opt) is opt


def _accelerated_optimizer() -> None:
    import accelerate
    from accelerate.optimizer import AcceleratedOptimizer

    accelerate.Accelerator(cpu=True)
    opt, _ = _wrapper()
    proxy = AcceleratedOptimizer(opt, device_placement=False)
    assert vars(proxy)["optimizer"] is opt and unwrap_optimizer(proxy) is opt


def _causal_names() -> None:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    assert MODEL_FOR_CAUSAL_LM_MAPPING_NAMES["gpt2"] == "GPT2LMHeadModel"


def _loss_mapping() -> None:
    from transformers.loss.loss_utils import LOSS_MAPPING, ForCausalLMLoss

    assert LOSS_MAPPING["ForCausalLM"] is ForCausalLMLoss


def _loss_function() -> None:
    from transformers.loss.loss_utils import ForCausalLMLoss

    config = transformers.GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=16, n_positions=8)
    model = transformers.GPT2ForSequenceClassification(config)
    model.loss_function = ForCausalLMLoss
    assert vars(model).get("_loss_function") is ForCausalLMLoss
    assert ga_transformers.is_causal_lm(model)


REACHES = _proxy.REACHES + ga_accelerate.REACHES + ga_transformers.REACHES
PROBES: dict[str, Callable[[], None]] = dict(
    zip(
        [r.target for r in REACHES],
        [
            _lightning_subclass,
            _lightning_attributes,
            _accelerate_steps,
            _accelerate_prepared,
            _accelerated_optimizer,
            _causal_names,
            _loss_mapping,
            _loss_function,
        ],
    )
)


def test_every_reach_has_a_probe():
    assert len(PROBES) == len(REACHES)
    libraries = [r.library for r in REACHES]
    assert libraries == ["lightning"] * 2 + ["accelerate"] * 3 + ["transformers"] * 3


@pytest.mark.parametrize("reach", REACHES, ids=lambda r: r.target.split(" ")[0])
def test_reach_is_where_it_was(reach: Reach):
    try:
        PROBES[reach.target]()
    except Exception as e:  # whatever the upgrade broke, name the reach
        pytest.fail(moved(reach, f"{type(e).__name__}: {e}"), pytrace=False)
