"""Root parameters used outside the model's forward (zero/params/root_uses.py): a script that computes the input
embeddings itself and passes `inputs_embeds`, that calls the inner model alone and applies the head in its own loss,
or that applies the head again to another layer's hidden states after the model's forward, finds the root unit
gathered where it calls the modules holding it, as DeepSpeed's per-module hooks would have it, and trains as plain
PyTorch does the same, bit for bit (ZeRO-3, parameters and optimizer state offloaded to cpu, accumulation 2,
clipping; the root held and parked). Inference (`zero.init_inference`) serves the same calls.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import zero

from stage3_models import (assert_state_equal, batches, full_state, one_thread, reference_train, stage3_config,
                           tiny_gpt2, tiny_llama, units_held)
from test_inference import PROMPT, inference_config
from test_pretrained import llama_config, on_meta, saved

ACCUM, CLIP = 2, 1.0


@pytest.fixture(autouse=True)
def _one_thread():
    with one_thread():
        yield


def inner(model):
    """The model without its head (a transformers causal LM's base model)."""
    return model.transformer if hasattr(model, "transformer") else model.model


def next_token_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())


def embeds_passed(forward, model, ids):
    """The script embeds the tokens itself and passes `inputs_embeds` to the model's forward."""
    return forward(inputs_embeds=model.get_input_embeddings()(ids), labels=ids).loss


def head_in_the_loss(forward, model, ids):
    """The inner model called alone (embeddings, blocks and final norm outside the model's forward), the head
    applied by the script."""
    return next_token_loss(model.lm_head(inner(model)(input_ids=ids).last_hidden_state), ids)


def head_again(forward, model, ids):
    """The model's own loss, plus the head applied again, outside the forward, to the first block's output."""
    out = forward(input_ids=ids, labels=ids, output_hidden_states=True)
    return out.loss + 0.5 * next_token_loss(model.lm_head(out.hidden_states[1]), ids)


USES = {"inputs_embeds": embeds_passed, "head in the loss": head_in_the_loss, "head again": head_again}


def plain_train(model, data, use) -> list[float]:
    return reference_train(model, data, accum=ACCUM, clip=CLIP, loss=lambda model, ids: use(model, model, ids))


@pytest.mark.parametrize("park", [False, True], ids=["held", "parked"])
@pytest.mark.parametrize("use", list(USES))
@pytest.mark.parametrize("make", [tiny_gpt2, tiny_llama], ids=["gpt2", "llama"])
def test_root_modules_called_outside_the_forward_train_as_plain_pytorch(make, use, park):
    """GPT-2 (its head tied to the embedding: the head's gradient goes through the host) and Llama (untied), three
    steps: the losses and every weight plain PyTorch's bits, nothing left gathered. Parked, the root is parked where
    the model's forward runs its blocks (the script's uses gather it again, in the forward and in the backward)."""
    data = batches(3 * ACCUM)
    reference = make()
    expected = plain_train(reference, data, USES[use])
    engine, *_ = zero.initialize(model=make(), config=stage3_config(
        "cpu", "cpu", accum=ACCUM, clip=CLIP, zero_tiering={"park_root": park}))
    uses, parks = engine.placement._root_uses, []
    park_unit = uses.park
    uses.park = lambda unit: parks.append(unit) or park_unit(unit)
    try:
        assert uses.enabled == park
        losses = []
        for ids in data:
            loss = USES[use](engine, engine.module, ids)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
            assert units_held(engine) == []
        assert losses == expected
        assert bool(parks) == (park and use != "head in the loss")  # (parked in the model's forward and its backward)
        assert_state_equal(full_state(engine), {k: v.detach().clone() for k, v in reference.state_dict().items()})
    finally:
        engine.close()


def test_inference_serves_embeddings_and_the_head_called_by_the_script(tmp_path):
    """zero.init_inference: the embeddings computed by the script and passed as `inputs_embeds`, and the head applied
    to the inner model's output, give the in-memory model's logits."""
    reference = saved(llama_config(), tmp_path / "model")
    engine = zero.init_inference(on_meta(llama_config()), inference_config("cpu", tmp_path),
                                 weights=tmp_path / "model")
    try:
        model = engine.module
        with torch.no_grad():
            expected = reference(PROMPT).logits
            assert torch.equal(engine(inputs_embeds=model.get_input_embeddings()(PROMPT)).logits, expected)
            assert torch.equal(model.lm_head(inner(model)(input_ids=PROMPT).last_hidden_state), expected)
        assert not any(unit.gathered for unit in engine.placement.units)
    finally:
        engine.close()


@pytest.mark.parametrize("park", [False, True], ids=["held", "parked"])
def test_embedding_adapters_in_a_parameter_dict_serve_the_scripts_embeddings(park):
    """PEFT's LoRA on the embedding too (its adapters in ParameterDicts, which the adapter's module reads: never called
    themselves) and on the attention, the head trained as a copy: the script's `get_input_embeddings()(ids)` finds the
    adapters gathered, and the run is plain PyTorch's bits."""
    from test_frozen import lora_on, trainable

    data = batches(2 * ACCUM)
    reference = lora_on(tiny_llama(), everywhere=True)
    expected = plain_train(reference, data, embeds_passed)
    model = lora_on(tiny_llama(), everywhere=True)
    engine, *_ = zero.initialize(model=model, config=stage3_config(
        "cpu", "cpu", accum=ACCUM, clip=CLIP, zero_tiering={"park_root": park}), model_parameters=trainable(model))
    try:
        losses = []
        for ids in data:
            loss = embeds_passed(engine, engine.module, ids)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        assert losses == expected and units_held(engine) == []
        assert_state_equal(full_state(engine), {k: v.detach().clone() for k, v in reference.state_dict().items()})
    finally:
        engine.close()
