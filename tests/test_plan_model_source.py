"""zero.plan's model source (zero/plan/model_source.py): a Hugging Face config.json priced as the model it states
(its own spellings, no silent defaults, GPT-2's Conv1D blocks counted), --layers/--hidden/--heads applied to it,
--seq-len within its positions, and a model it cannot plan named in one line. The functions are called directly:
the command's machine probe takes seconds a run."""
from __future__ import annotations

import json

import pytest

from zero.plan.model_source import PlanInputError, load_model

from models import one_thread  # noqa: F401  (autouse fixture)

GPT2 = {"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 2, "vocab_size": 256, "n_positions": 64}
LLAMA = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 256, "max_position_embeddings": 128}


def write(tmp_path, config: dict) -> str:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    return str(path)


def refused(spec: str, **flags) -> str:
    """The PlanInputError's message, checked to be one line (the command prints it as `zero.plan: ...`)."""
    with pytest.raises(PlanInputError) as info:
        load_model(spec, **flags)
    message = str(info.value)
    assert "\n" not in message, message
    return message


def gpt2_matmuls(layers: int, hidden: int, vocab: int) -> int:
    """A GPT-2 block's Conv1D weights: qkv (h x 3h), attention out (h x h), MLP in (h x 4h) and out (4h x h);
    the head is tied to the token embedding (h x vocab), counted once."""
    return layers * 12 * hidden * hidden + vocab * hidden


def test_gpt2s_conv1d_blocks_are_matmuls(tmp_path):
    """transformers' GPT-2 is built of Conv1D (a linear layer storing its weight (in, out)), not nn.Linear:
    counting nn.Linear only priced its head alone (38.6M of gpt2's 123.5M)."""
    shape = load_model(write(tmp_path, GPT2))
    assert shape.matmul_params == gpt2_matmuls(2, 64, 256)
    # the rest: position embeddings, each block's two layer norms and four biases, the final layer norm
    assert shape.params - shape.matmul_params == 64 * 64 + 2 * (2 * 2 * 64 + 3 * 64 + 64 + 4 * 64 + 64) + 2 * 64


@pytest.mark.parametrize("config, message", [
    ({"model_type": "t5", "d_model": 64, "num_layers": 2, "num_heads": 2, "vocab_size": 256},
     "model_type 't5' is not a causal LM"),
    ({**LLAMA, "hidden_size": -256}, "hidden_size = -256: expected a positive integer"),
    ({**LLAMA, "num_hidden_layers": 0}, "num_hidden_layers = 0: expected a positive integer"),
    ({**LLAMA, "intermediate_size": -5}, "transformers cannot build a causal LM from it: RuntimeError: "),
    ({**LLAMA, "model_type": "notamodel"}, "model_type 'notamodel' is not one this transformers knows"),
])
def test_a_config_the_planner_cannot_build_is_named_in_one_line(tmp_path, config, message):
    assert message in refused(write(tmp_path, config))


@pytest.mark.parametrize("spec, message", [
    (":nope", "model factory ':nope': ValueError: Empty module name"),
    ("torch.nn:Linear", "called with no arguments, it raised TypeError: "),
])
def test_a_factory_that_cannot_be_called_is_named_in_one_line(spec, message):
    assert message in refused(spec)


def test_transformers_reason_is_kept_on_the_line(tmp_path):
    """transformers' validation error says which check failed on its first line and why on the next."""
    message = refused(write(tmp_path, {**LLAMA, "hidden_size": 100, "num_attention_heads": 3}))
    assert "The hidden size (100) is not a multiple of the number of attention heads (3)" in message


@pytest.mark.parametrize("drop, add, message", [
    ("num_hidden_layers", {}, "has no 'num_hidden_layers'; transformers would take its default, 32"),
    ("num_hidden_layers", {"n_layer": 4}, "has no 'num_hidden_layers'; it states 'n_layer', which llama does not"),
    ("num_attention_heads", {}, "has no 'num_attention_heads'"),
    ("vocab_size", {}, "has no 'vocab_size'"),
])
def test_a_size_the_file_does_not_state_is_named(tmp_path, drop, add, message):
    """transformers fills a missing size with its default; the planner would price another model silently."""
    config = {key: value for key, value in LLAMA.items() if key != drop}
    assert message in refused(write(tmp_path, {**config, **add}))


def test_gpt2s_own_spellings_count_as_stated(tmp_path):
    config = {key: value for key, value in GPT2.items() if key != "n_layer"}
    assert "has no 'num_hidden_layers' (or 'n_layer')" in refused(write(tmp_path, config))
    shape = load_model(write(tmp_path, {**config, "num_hidden_layers": 3}))  # the class's own name counts too
    assert shape.layers == 3


@pytest.mark.parametrize("spec, seq_len, message", [
    ("gpt2", 0, "--seq-len 0: tokens a sequence, at least 1"),
    ("gpt2", -5, "--seq-len -5"),
    ("gpt2", 65, "states n_positions = 64"),
    ("llama", 129, "states max_position_embeddings = 128"),
    ("stage3_models:own_gpt", 0, "--seq-len 0"),
])
def test_seq_len_is_within_the_models_positions(tmp_path, spec, seq_len, message):
    spec = write(tmp_path, {"gpt2": GPT2, "llama": LLAMA}[spec]) if ":" not in spec else spec
    assert message in refused(spec, seq_len=seq_len)


def test_seq_len_up_to_the_positions_plans(tmp_path):
    assert load_model(write(tmp_path, GPT2), seq_len=64).seq_len == 64
    assert load_model(write(tmp_path, GPT2)).seq_len == 64  # not given: the main job's 128, or the positions
    unstated = {key: value for key, value in LLAMA.items() if key != "max_position_embeddings"}
    assert load_model(write(tmp_path, unstated), seq_len=4096).seq_len == 4096  # a limit the file does not state


def test_size_flags_override_a_config_json(tmp_path):
    """--layers, --hidden and --heads replace the file's sizes under its own spellings, as they do a preset's."""
    shape = load_model(write(tmp_path, GPT2), layers=3, hidden=128, heads=4)
    assert (shape.layers, shape.hidden) == (3, 128)
    assert shape.matmul_params == gpt2_matmuls(3, 128, 256)
    assert shape.model.config.n_head == 4
    llama = load_model(write(tmp_path, {**LLAMA, "head_dim": 16}), hidden=128)  # head_dim was hidden / heads
    assert llama.model.config.head_dim == 32 and llama.hidden == 128
    assert "--layers 0" in refused(write(tmp_path, GPT2), layers=0)
    assert "not a multiple of the number of attention heads (3)" in refused(write(tmp_path, LLAMA), heads=3)
    assert "--layers 2: model factory" in refused("stage3_models:own_gpt", layers=2)


TEXT = {k: v for k, v in LLAMA.items() if k != "model_type"}
VISION_LANGUAGE = {
    "llava": {"model_type": "llava", "text_config": {"model_type": "llama", **TEXT},
              "vision_config": {"model_type": "clip_vision_model", "hidden_size": 32, "intermediate_size": 64,
                                "num_hidden_layers": 2, "num_attention_heads": 2, "image_size": 32, "patch_size": 8,
                                "projection_dim": 32}},
    "gemma3": {"model_type": "gemma3", "mm_tokens_per_image": 16,
               "text_config": {"model_type": "gemma3_text", "head_dim": 16, **TEXT},
               "vision_config": {"model_type": "siglip_vision_model", "hidden_size": 32, "intermediate_size": 64,
                                 "num_hidden_layers": 2, "num_attention_heads": 2, "image_size": 32, "patch_size": 8}},
}


@pytest.mark.parametrize("kind", VISION_LANGUAGE)
def test_a_vision_language_model_is_planned_whole_with_its_language_models_sizes(tmp_path, kind):
    """A vision-language config.json states its sizes under text_config (llava is no causal LM to transformers,
    gemma3 is, with no sizes at its top): the whole model is planned (the image encoder's parameters too), with
    the language model's layers, width and vocabulary, and --layers applied there."""
    import torch
    from transformers import AutoConfig, AutoModelForImageTextToText

    path = write(tmp_path, VISION_LANGUAGE[kind])
    shape = load_model(path, seq_len=16)
    with torch.device("meta"):
        whole = AutoModelForImageTextToText.from_config(AutoConfig.from_pretrained(path))
    assert shape.params == sum(p.numel() for p in whole.parameters())
    assert (shape.layers, shape.hidden, shape.vocab) == (2, 64, 256)
    deeper = load_model(path, seq_len=16, layers=3)
    assert deeper.layers == 3 and deeper.params > shape.params
    assert "max_position_embeddings = 128" in refused(path, seq_len=129)


def test_a_mixture_of_experts_prices_the_experts_a_token_runs_through(tmp_path):
    """Mixtral's experts are two stacked 3-D weights (experts x out x in), not Linear layers: every expert's
    parameters are stored and stepped, a token's matmuls run through num_experts_per_tok of them."""
    config = {**LLAMA, "model_type": "mixtral", "num_local_experts": 4, "num_experts_per_tok": 2}
    shape = load_model(write(tmp_path, config), seq_len=16)
    hidden, inner, experts, layers = 64, 128, 4, 2
    attention = 4 * hidden * hidden  # q, k, v, o (as many key/value heads as query heads)
    experts_stored = experts * 3 * hidden * inner  # gate and up stacked, then down
    assert shape.params == layers * (attention + experts_stored + experts * hidden + 2 * hidden) + 2 * 256 * hidden \
        + hidden
    assert shape.matmul_params == layers * (attention + experts_stored * 2 // experts) + 256 * hidden
