"""zero.plan's model source (zero/plan/model_source.py): a Hugging Face config.json priced as the model it states
(its own spellings, no silent defaults, GPT-2's Conv1D blocks counted), as the class a user trains (an encoder's
masked LM, a vision-language model whole, a mixture of experts' top_k priced), --layers/--hidden/--heads applied to
it, --seq-len within its positions, and a model it cannot plan named in one line. The functions are called directly:
the command's machine probe takes seconds a run."""
from __future__ import annotations

import json

import pytest
from torch import nn

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


def language_matmuls(layers: int, hidden: int, inner: int, vocab: int, experts: int = 1, active: int = 1) -> int:
    """A llama-like block's q, k, v, o (as many key/value heads as query heads) and gated MLP (gate, up, down) of
    `active` of its `experts`, and an untied head; the embedding is a lookup."""
    return layers * (4 * hidden * hidden + 3 * hidden * inner * active) + vocab * hidden


def meta_params(auto, path: str) -> int:
    """The parameters of the model transformers builds from the config.json, on meta."""
    import torch
    from transformers import AutoConfig

    with torch.device("meta"):
        return sum(p.numel() for p in auto.from_config(AutoConfig.from_pretrained(path)).parameters())


def test_a_vision_language_models_image_encoder_is_stored_not_priced(tmp_path):
    """Its image encoder runs per image, a count no config states: its parameters are planned (bytes), its
    matmuls are not priced per text token as the language model's are, and the plan says so."""
    from transformers import AutoModelForImageTextToText

    path = write(tmp_path, VISION_LANGUAGE["llava"])
    shape = load_model(path, seq_len=16)
    whole = meta_params(AutoModelForImageTextToText, path)
    assert shape.params == whole
    assert shape.matmul_params == language_matmuls(2, 64, 128, 256)
    language = 2 * (4 * 64 * 64 + 3 * 64 * 128 + 2 * 64) + 2 * 256 * 64 + 64  # blocks with norms, embedding, head
    assert shape.note == (f"its image encoder ({(whole - language) / 1e6:.1f}M parameters) is stored and stepped, "
                          "its compute (per image) not priced")


def test_a_vision_language_config_as_transformers_saves_it_is_read(tmp_path):
    """transformers saves a text_config as its difference from the defaults (llava-1.5-7b's states no width and
    no layer count) and Qwen2-VL's config.json states its language model's sizes at its top: both are planned as
    transformers builds them. mllama is planned whole, not as the causal LM of its language model alone."""
    from transformers import AutoModelForImageTextToText

    text = {"model_type": "llama", "num_hidden_layers": 2, "vocab_size": 256, "max_position_embeddings": 128}
    llava = write(tmp_path, {**VISION_LANGUAGE["llava"], "text_config": text})
    shape = load_model(llava, seq_len=16)
    assert (shape.layers, shape.hidden) == (2, 4096)  # llama's default width, as transformers builds it
    assert shape.params == meta_params(AutoModelForImageTextToText, llava)
    assert load_model(llava, seq_len=16, hidden=128, heads=4).model.config.text_config.hidden_size == 128
    qwen2_vl = {"model_type": "qwen2_vl", **TEXT, "num_key_value_heads": 2,
                "vision_config": {"depth": 1, "embed_dim": 32, "num_heads": 2, "hidden_size": 64, "patch_size": 8}}
    path = write(tmp_path, qwen2_vl)
    shape = load_model(path, seq_len=16)
    assert (shape.layers, shape.hidden, shape.vocab) == (2, 64, 256)
    assert shape.params == meta_params(AutoModelForImageTextToText, path)
    assert load_model(path, seq_len=16, layers=3).layers == 3
    mllama = {"model_type": "mllama", "text_config": {"model_type": "mllama_text_model", **TEXT,
                                                      "cross_attention_layers": [1], "pad_token_id": 0},
              "vision_config": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                                "num_global_layers": 1, "num_attention_heads": 2, "image_size": 32, "patch_size": 8,
                                "max_num_tiles": 4, "intermediate_layers_indices": [0], "vision_output_dim": 64}}
    path = write(tmp_path, mllama)
    shape = load_model(path, seq_len=16)
    assert type(shape.model).__name__ == "MllamaForConditionalGeneration"
    assert shape.params == meta_params(AutoModelForImageTextToText, path)


MIXTRAL_TEXT = {**TEXT, "model_type": "mixtral", "num_local_experts": 4, "num_experts_per_tok": 2}


def test_a_vision_language_mixture_of_experts_prices_its_top_k(tmp_path):
    """The experts a token runs through are the language model's (its text_config's num_experts_per_tok, none at
    the config's top): all 4 experts are stored, 2 priced."""
    path = write(tmp_path, {**VISION_LANGUAGE["llava"], "text_config": MIXTRAL_TEXT})
    shape = load_model(path, seq_len=16)
    assert shape.matmul_params == language_matmuls(2, 64, 128, 256, experts=4, active=2)


class ListedExperts(nn.Module):
    """transformers 4's Mixtral block (and DeepSeek's own code): a router, one module an expert in a ModuleList,
    the block stating top_k. Its class name ends in Experts as transformers 5's stacked experts' do, but holding
    Linear layers it is no such module."""

    def __init__(self, hidden: int = 16, inner: int = 32, experts: int = 4, top_k: int = 2):
        super().__init__()
        self.top_k = top_k
        self.gate = nn.Linear(hidden, experts, bias=False)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(hidden, inner), nn.Linear(inner, hidden))
                                     for _ in range(experts))


def listed_experts_moe() -> nn.Module:
    return nn.Sequential(nn.Embedding(64, 16), ListedExperts(), ListedExperts(), nn.Linear(16, 64, bias=False))


def test_experts_in_a_module_list_price_the_experts_a_token_runs_through():
    """Each expert's Linear layers are stored and stepped; a token runs through top_k of them."""
    shape = load_model("test_plan_model_source:listed_experts_moe")
    router, expert = 16 * 4, 2 * 16 * 32
    assert shape.params == 64 * 16 + 2 * (router + 4 * (expert + 32 + 16)) + 16 * 64
    assert shape.matmul_params == 2 * (router + 2 * expert) + 16 * 64


def test_a_convolution_beside_the_experts_is_no_expert(tmp_path):
    """Jamba's mamba layers hold a 3-D Conv1d weight (channels, 1, kernel): no stacked experts, priced as before
    (not a matmul), while its experts are priced at num_experts_per_tok of num_experts."""
    config = {**TEXT, "model_type": "jamba", "num_experts": 4, "num_experts_per_tok": 2, "expert_layer_period": 1,
              "expert_layer_offset": 0, "attn_layer_period": 2, "attn_layer_offset": 1, "use_mamba_kernels": False}
    shape = load_model(write(tmp_path, config), seq_len=16)
    linear = sum(m.weight.numel() for m in shape.model.modules() if isinstance(m, nn.Linear))
    experts = sum(p.numel() for name, p in shape.model.named_parameters() if ".experts." in name)
    assert experts == 2 * 4 * 3 * 64 * 128
    assert shape.matmul_params == linear + experts * 2 // 4


BERT = {key: value for key, value in TEXT.items() if key != "num_key_value_heads"}
ENCODERS = {
    "bert": {"model_type": "bert", **BERT},
    "roberta": {"model_type": "roberta", **BERT},
    "distilbert": {"model_type": "distilbert", "dim": 64, "hidden_dim": 128, "n_layers": 2, "n_heads": 4,
                   "vocab_size": 256, "max_position_embeddings": 128},
}


@pytest.mark.parametrize("kind", ENCODERS)
def test_an_encoder_is_planned_as_the_masked_lm_it_is_trained_as(tmp_path, kind):
    """BERT, RoBERTa and DistilBERT are encoders trained as masked LMs; transformers also lists BERT's and RoBERTa's
    decoder variant (is_decoder) as a causal LM, which is what a config.json stating is_decoder plans."""
    from transformers import AutoModelForMaskedLM
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    path = write(tmp_path, ENCODERS[kind])
    shape = load_model(path, seq_len=16)
    assert type(shape.model).__name__.endswith("ForMaskedLM")
    assert shape.params == meta_params(AutoModelForMaskedLM, path)
    # q, k, v, o and the two MLP layers a block, the head's transform (h x h) and its decoder tied to the embedding
    assert shape.matmul_params == 2 * (4 * 64 * 64 + 2 * 64 * 128) + 64 * 64 + 256 * 64
    if kind in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        decoder = load_model(write(tmp_path, {**ENCODERS[kind], "is_decoder": True}), seq_len=16)
        assert type(decoder.model).__name__ == MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[kind]  # BertLMHeadModel


def test_an_encoder_decoder_is_refused_not_planned_as_its_decoder(tmp_path):
    """transformers lists BART's decoder alone as its causal LM: planning it would leave out the encoder."""
    config = {"model_type": "bart", "d_model": 64, "encoder_layers": 2, "decoder_layers": 2, "num_hidden_layers": 2,
              "encoder_attention_heads": 4, "decoder_attention_heads": 4, "num_attention_heads": 4,
              "vocab_size": 256}
    assert "model_type 'bart' is an encoder-decoder (transformers' causal LM for it is its decoder alone)" in \
        refused(write(tmp_path, config))
