"""Tiny Hugging Face models and tokenizers, written with save_pretrained into a directory, for the copied scripts that
load theirs with from_pretrained (a model-name argument may name a local directory). Built from a config and a seed,
with no download; the same transformers version writes the same weights."""
from __future__ import annotations

import os

import torch

WORDS = [f"w{i}" for i in range(59)]
"""The vocabulary's plain words (whitespace-separated tokens)."""


def word_level_tokenizer(specials: list[str], **special_names: str):
    """A fast word-level tokenizer: the special tokens first (ids 0, 1, ...), then WORDS."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(specials + WORDS)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token=special_names["unk_token"]))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, **special_names)


def write_llama(directory: str, seed: int = 0) -> str:
    """A 2-layer Llama (hidden 128, MLP 2048) and its tokenizer (no pad token: the script sets eos), fp32. Each MLP
    matrix has 2**18 elements (1 MiB): DeepSpeed swaps a tensor to NVMe only from its aio block size (1 MiB) up, and
    keeps smaller ones in host memory."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = word_level_tokenizer(["<unk>", "<s>", "</s>"], unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=2048, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    return _save_seeded(directory, LlamaForCausalLM, config, tokenizer, seed)


def write_opt(directory: str, seed: int = 0) -> str:
    """A 2-layer OPT (hidden 128, MLP 2048: matrices of 2**18 elements, as write_llama's) with config.torch_dtype fp32
    (ZeRO-Inference's run_model.py computes in it) and a tokenizer with a pad token (the script pads its prompts)."""
    from transformers import OPTConfig, OPTForCausalLM

    tokenizer = word_level_tokenizer(["<pad>", "</s>", "<unk>"], unk_token="<unk>", bos_token="</s>",
                                     eos_token="</s>", pad_token="<pad>")
    config = OPTConfig(vocab_size=len(tokenizer), hidden_size=128, ffn_dim=2048, num_hidden_layers=2,
                       num_attention_heads=4, max_position_embeddings=64, word_embed_proj_dim=128, pad_token_id=0,
                       bos_token_id=1, eos_token_id=1, torch_dtype="float32")
    return _save_seeded(directory, OPTForCausalLM, config, tokenizer, seed)


def _save_seeded(directory: str, model_class, config, tokenizer, seed: int) -> str:
    """`model_class(config)` drawn from `seed`, in fp32, saved with its tokenizer into `directory`."""
    torch.manual_seed(seed)
    model = model_class(config).float()
    os.makedirs(directory, exist_ok=True)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def write_critic(directory: str, model_dir: str, seed: int = 1) -> str:
    """What DeepSpeed-Chat's step 3 loads as its critic and reward model, a step-2 output: `model_dir`'s files and a
    `pytorch_model.bin` holding a dschat RewardModel's state: the base model (its embeddings grown to a multiple of 8
    rows, as step 3's build grows them) as `rwtranformer.*` and a seeded value head `v_head.weight`."""
    import math
    import shutil

    from transformers import AutoModel, AutoTokenizer

    shutil.copytree(model_dir, directory, dirs_exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(directory)
    torch.manual_seed(seed)
    base = AutoModel.from_pretrained(directory)
    base.resize_token_embeddings(int(8 * math.ceil(len(tokenizer) / 8.0)))
    state = {f"rwtranformer.{k}": v for k, v in base.state_dict().items()}
    state["v_head.weight"] = torch.randn(1, base.config.hidden_size) * 0.02
    torch.save(state, os.path.join(directory, "pytorch_model.bin"))
    return directory


def write_roberta_tokenizer(directory: str) -> str:
    """A RoBERTa-style tokenizer with roberta-base's special ids (<s> 0, <pad> 1, </s> 2, <unk> 3) and a mask token."""
    tokenizer = word_level_tokenizer(["<s>", "<pad>", "</s>", "<unk>", "<mask>"], bos_token="<s>", pad_token="<pad>",
                                     eos_token="</s>", unk_token="<unk>", mask_token="<mask>")
    os.makedirs(directory, exist_ok=True)
    tokenizer.save_pretrained(directory)
    return directory
