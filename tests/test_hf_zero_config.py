"""HfZeroConfig in place of transformers' HfDeepSpeedConfig: with it alive, transformers' own `from_pretrained` builds
the model under zero.Init (no deepspeed package involved: its `import deepspeed` is ours), each weight partitioned
as it loads, and the model trains as the same weights loaded plainly. In a fresh process: the config is global."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent("""
    import json, sys, torch
    from transformers import LlamaConfig, LlamaForCausalLM
    import zero
    from zero.integrations.hf_config import HfZeroConfig

    path = sys.argv[1]
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32)
    LlamaForCausalLM(config).save_pretrained(path)
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))

    def train(model, steps=3):
        ds = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.0,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
              "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"},
                                    "offload_optimizer": {"device": "cpu"}, "stage3_param_persistence_threshold": 0}}
        engine, *_ = zero.initialize(model=model, config=ds)
        losses = []
        for _ in range(steps):
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        engine.close()
        return losses

    plain = train(LlamaForCausalLM.from_pretrained(path))
    assert "deepspeed" not in sys.modules
    dschf = HfZeroConfig({"train_micro_batch_size_per_gpu": 2, "zero_optimization": {
        "stage": 3, "offload_param": {"device": "cpu"}}})
    model = LlamaForCausalLM.from_pretrained(path)
    assert sys.modules["deepspeed"].zero.Init is zero.zero.Init  # transformers' `import deepspeed` is ours
    partitioned = [p for p in model.parameters() if hasattr(p, "ds_id")]
    assert partitioned and all(p.ds_status == zero.zero.ZeroParamStatus.NOT_AVAILABLE for p in partitioned)
    print(json.dumps({"plain": plain, "zero_init": train(model)}))
""")


def test_from_pretrained_builds_under_zero_init_and_trains_as_the_plain_load(tmp_path):
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path / "model")], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["zero_init"] == result["plain"], result


RESIZE = textwrap.dedent("""
    import sys, torch
    from transformers import LlamaConfig, LlamaForCausalLM
    import zero
    from zero.integrations.hf_config import HfZeroConfig

    path, mean_resizing = sys.argv[1], sys.argv[2] == "mean"
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32)
    LlamaForCausalLM(config).save_pretrained(path)

    def resized():
        torch.manual_seed(1)  # the rows added are drawn: from the old rows' mean and covariance, or _init_weights'
        model = LlamaForCausalLM.from_pretrained(path)
        model.resize_token_embeddings(80, mean_resizing=mean_resizing)
        return model, torch.rand(4)  # where the random stream is after

    plain, plain_next = resized()
    ds = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
          "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu"}}}
    dschf = HfZeroConfig(ds)
    model, next_draws = resized()  # built on the partitioned old weights' device, its old rows copied in
    engine, *_ = zero.initialize(model=model, config=ds)
    assert torch.equal(next_draws, plain_next)  # from_pretrained under zero.Init drew nothing, as the plain load
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        param = model.get_parameter(name)
        with zero.zero.GatheredParameters([param]):
            weight = param.detach().clone()
        expected = plain.get_parameter(name).detach()
        assert weight.shape == (80, 32) and torch.equal(weight, expected), (name, (weight - expected).abs().max())
        assert weight[64:].abs().max() > 0  # the added rows, as the plain resize drew them
    engine.close()
    print("OK")
""")


@pytest.mark.parametrize("rows", ["mean", "init_weights"])
def test_resized_embeddings_equal_the_plain_resize(tmp_path, rows):
    """transformers' resize_token_embeddings under ZeRO-3 builds the new embedding and head on the old weight's
    device and writes the rows it adds before any GatheredParameters names them: with the old weight gathered for
    the resize (hf_resize.py) they are real, so the pretrained rows and the added ones (drawn from the old rows'
    mean and covariance, or by _init_weights) are the plain resize's, bit for bit (before: zeros)."""
    done = subprocess.run([sys.executable, "-c", RESIZE, str(tmp_path / "model"), rows], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("OK"), done.stderr[-3000:]


TIED = textwrap.dedent("""
    import sys, torch
    from transformers import LlamaConfig, LlamaForCausalLM
    import zero
    from zero.integrations.hf_config import HfZeroConfig

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32,
                         tie_word_embeddings=True)
    weights = {k: v.clone() for k, v in LlamaForCausalLM(config).state_dict().items()}
    for head in ("equal", "different"):
        path = sys.argv[1] + head
        state = {**weights, "lm_head.weight": weights["model.embed_tokens.weight"] + (0 if head == "equal" else 1)}
        LlamaForCausalLM(config).save_pretrained(path, state_dict=state)  # both keys in the file, as a .bin has
        plain = LlamaForCausalLM.from_pretrained(path)
        dschf = HfZeroConfig({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}})
        model = LlamaForCausalLM.from_pretrained(path)
        del dschf
        tied = model.lm_head.weight is model.model.embed_tokens.weight
        assert tied == (plain.lm_head.weight is plain.model.embed_tokens.weight) == (head == "equal"), (head, tied)
        for name in ("model.embed_tokens.weight", "lm_head.weight"):
            param = model.get_parameter(name)
            with zero.zero.GatheredParameters([param]):
                assert torch.equal(param, plain.get_parameter(name)), (head, name)
    print("OK")
""")


def test_a_tied_pair_the_checkpoint_holds_both_of_is_tied_as_the_plain_load_ties_it(tmp_path):
    """transformers ties an embedding and its head that a checkpoint holds both of only where their values are equal
    (torch.equal on the two parameters): under ZeRO-3 it compares the gathered values (hf_tied.py), so the pair is
    tied (equal values), or left apart with transformers' warning (different ones), as the plain load does, and every
    weight is the plain load's (before: NotImplementedError, torch.equal on two meta placeholders; ZeRO-Inference's
    run_model.py --dummy)."""
    done = subprocess.run([sys.executable, "-c", TIED, str(tmp_path / "model_")], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("OK"), done.stderr[-3000:]
