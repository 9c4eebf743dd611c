"""The cases (which copied DeepSpeedExamples script runs how) and the one way they are run, shared by record.py
(DeepSpeed, to record the fixture) and tests/test_deepspeed_examples.py (zero, to compare with it).

A case runs its script in a fresh directory (the working directory; `{tmp}` in its arguments and config), after its
setup (a tiny Hugging Face model or tokenizer written there), with the loss recorder (loss_recorder/sitecustomize.py)
writing each rank's per-step losses. A case with `resume` runs a second time in the same directory (a checkpoint the
first run saved is loaded: `{exp_dir}` names the experiment directory the first run made).

Other keys of a case: `package` (a directory beside the script that it imports, e.g. DeepSpeed-Chat's dschat; the
zero_imports run gets a rewritten copy of it beside its rewritten script), `tolerance` (per-step loss, absolute; by
default TOLERANCE), `deepspeed_without` (switches DeepSpeed's run leaves out, where it cannot serve them on the
CPU), `record` ("logits": a script that only runs the model, compared by each forward's logits, see
loss_recorder/sitecustomize.py), `loss_csv` (a file of `step,loss` rows the script writes itself, read for rank 0's
losses where the script calls loss.backward() and the recorder never sees the loss) and `zero_launch_limit` (why its
zero_launch run cannot work: the test skips it, with that reason).

Three ways to run a script:
- "deepspeed": the script unchanged, with DeepSpeed (the interpreter of a venv that has it; DS_ACCELERATOR=cpu);
  one rank as a plain process with the rendezvous variables set, two under torchrun (torch.distributed.run) with
  --local_rank=<i> passed as DeepSpeed's launcher passes it (local_rank.py).
- "zero_imports": a copy whose imports say `import zero as deepspeed` / `from zero...`, launched as "deepspeed" is.
- "zero_launch": the script unchanged under `python -m zero.launch --num_gpus N` (its `deepspeed` imports resolve to
  zero; it passes --local_rank=<i> as DeepSpeed's launcher does).
"""
from __future__ import annotations

import csv
import glob
import json
import os
import re
import socket
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
RECORDER = os.path.join(HERE, "loss_recorder")
FIXTURE = os.path.join(HERE, "deepspeed_losses.json")

TOLERANCE = 1e-5
"""Per-step loss, absolute (fp32)."""

BF16_TOLERANCE = 2e-3
"""Per-step loss, absolute, for a case whose model trains in bf16 with a loss computed in fp32 (a case's
`tolerance`): the two engines' bf16 roundings of the same update differ after the first optimizer step."""

CIFAR_ARGS = ["--epochs", "1", "--dtype", "fp32", "--stage", "3", "--deepspeed"]
"""cifar10_deepspeed.py's own switches (run_ds.sh passes --deepspeed): fp32, ZeRO stage 3; its config (in the script)
offloads parameters and optimizer state to the CPU. 96 synthetic images, train_batch_size 16: 6 steps."""

SUPEROFFLOAD_CONFIG = {
    # finetune_llama-8b_1gpu.sh's "zerooffload" config, with fp32 (no bf16 section), a train_batch_size for one rank
    # of --batch_size 2, both offloads on NVMe (the file system under {tmp}) and every parameter partitioned (a
    # persistence threshold of 0: the tiny model's tensors would otherwise all stay resident)
    "train_batch_size": 2,
    "gradient_accumulation_steps": 1,
    "zero_optimization": {
        "stage": 3,
        "overlap_comm": False,
        "reduce_bucket_size": 4e8,
        "sub_group_size": 4e8,
        "stage3_param_persistence_threshold": 0,
        "offload_optimizer": {"device": "nvme", "nvme_path": "{tmp}/nvme", "pin_memory": True},
        "offload_param": {"device": "nvme", "nvme_path": "{tmp}/nvme", "pin_memory": True, "buffer_size": 1e6},
    },
}

DSCHAT_ARGS = ["--data_path", "Dahoas/rm-static", "--data_split", "10,0,0", "--data_output_path", "{tmp}/data_files",
               "--model_name_or_path", "{tmp}/model", "--per_device_train_batch_size", "4",
               "--per_device_eval_batch_size", "4", "--max_seq_len", "32", "--learning_rate", "1e-3",
               "--weight_decay", "0.1", "--num_train_epochs", "1", "--gradient_accumulation_steps", "2",
               "--lr_scheduler_type", "cosine", "--num_warmup_steps", "0", "--seed", "1234",
               "--dtype", "bf16", "--print_loss", "--deepspeed", "--local_rank", "0"]
"""DeepSpeed-Chat step 1's switches, as training_scripts/opt/single_node/run_1.3b.sh passes them, with tiny sizes: its
synthetic Dahoas/rm-static (dschat/utils/data/raw_datasets.py: 32 train, 8 test records), all for step 1 (10,0,0),
and its shuffle indices and tokenized data cached under {tmp}. No --output_dir: save_hf_format's
tokenizer.save_vocabulary needs a tokenizer with a vocabulary file (the tiny one is a tokenizer.json). --local_rank 0, as DeepSpeed's launcher passes it
(the script calls deepspeed.init_distributed() only with one; the launchers pass their own --local_rank=<i> before
the script's arguments, so with one rank the script reads this one, the same 0)."""

BF16_EXAMPLE_ARGS = ["--deepspeed_config", "{tmp}/ds_config.json", "--hidden_dim", "64", "--num_layers", "2",
                     "--num_heads", "4", "--vocab_size", "512", "--seq_length", "16", "--num_steps", "8",
                     "--log_interval", "1", "--loss_log_file", "{tmp}/losses.csv"]
"""training/bf16_master_weight/train.py's switches at tiny sizes (its model: an embedding, nn.MultiheadAttention
blocks and a head; random tokens and labels from its seed, 42); it writes each step's loss to --loss_log_file."""


def bf16_example_config(name: str, **changes) -> dict:
    """One of training/bf16_master_weight/configs/ (copied into bf16_master_weight/), its top-level sections updated
    with `changes`."""
    with open(os.path.join(HERE, "bf16_master_weight", f"{name}.json")) as f:
        config = json.load(f)
    for section, values in changes.items():
        config[section] = {**config.get(section, {}), **values}
    return config


def replaced(args: list[str], **values: str) -> list[str]:
    """`args` with the value after each `--<key>` replaced by values[key]."""
    out = list(args)
    for key, value in values.items():
        out[out.index(f"--{key}") + 1] = value
    return out


DSCHAT_STEP3_ARGS = ["--data_path", "Dahoas/rm-static", "--data_split", "0,0,10", "--data_output_path",
                     "{tmp}/data_files", "--actor_model_name_or_path", "{tmp}/model", "--critic_model_name_or_path",
                     "{tmp}/critic", "--num_padding_at_beginning", "0", "--per_device_generation_batch_size", "4",
                     "--per_device_training_batch_size", "4", "--generation_batches", "1", "--ppo_epochs", "1",
                     "--max_prompt_seq_len", "16", "--max_answer_seq_len", "16", "--actor_learning_rate", "1e-4",
                     "--critic_learning_rate", "1e-4", "--num_train_epochs", "1", "--lr_scheduler_type", "cosine",
                     "--gradient_accumulation_steps", "1", "--num_warmup_steps", "0", "--seed", "1234",
                     "--dtype", "fp32", "--actor_zero_stage", "3", "--critic_zero_stage", "3", "--offload",
                     "--local_rank", "0"]
"""DeepSpeed-Chat step 3's switches, as training_scripts/opt/single_node/run_1.3b.sh passes them, with tiny sizes: the
synthetic Dahoas/rm-static's prompts (12 of them, 3 generation batches of 4), actor and reference from {tmp}/model,
critic and reward from {tmp}/critic (a step-2 output: tiny_models.write_critic), fp32 (an EDIT: the script takes fp16
or bf16, and with bf16 the PPO losses amplify the two engines' different bf16 roundings past any useful tolerance
within two steps), both ZeRO-3 with --offload. No --output_dir (save_hf_format: see DSCHAT_ARGS)."""

ZERO_INFERENCE_ARGS = ["--model", "{tmp}/model", "--batch-size", "2", "--prompt-len", "8", "--gen-len", "6",
                       "--loops", "2", "--local_rank", "0", "--log-file", "{tmp}/benchmark.log"]
"""ZeRO-Inference's run_model.py switches, as run_model.sh passes them, at tiny sizes: the tiny OPT (fp32, its config's
dtype) from {tmp}/model, 2 prompts padded to 8 tokens, 6 tokens generated greedily, twice (--loops); --local_rank 0,
as DeepSpeed's launcher passes it (the script prints its summary only on local rank 0)."""

CASES: dict[str, dict] = {
    "cifar10_zero3_cpu_offload_1rank": {
        "script": "cifar10_deepspeed.py", "world": 1, "args": CIFAR_ARGS,
    },
    "cifar10_zero3_cpu_offload_2ranks": {
        "script": "cifar10_deepspeed.py", "world": 2, "args": CIFAR_ARGS,
    },
    "superoffload_finetune_zero3_nvme_1rank": {
        # a tiny Llama from_pretrained from {tmp}/model, DeepSpeedCPUAdam built by the script, 6 steps of 2 examples
        "script": "finetune_zero3.py", "world": 1, "setup": "llama", "config": SUPEROFFLOAD_CONFIG,
        "args": ["--deepspeed_config", "{tmp}/ds_config.json", "--model_name", "{tmp}/model", "--lr", "1e-5",
                 "--batch_size", "2", "--output_dir", "{tmp}/output", "--attn_implementation", "sdpa",
                 "--max_length", "32", "--bench_steps", "6", "--warmup_steps", "2", "--log_interval", "1",
                 "--weight_decay", "0.01", "--seed", "42"],
    },
    "hello_bert_zero1_cpu_offload_save_load": {
        # RoBERTa MLM built in the script (ZeRO-1, optimizer on the CPU, bf16: the script accepts only fp16 or bf16);
        # 3 steps, save_checkpoint; then load_checkpoint from that directory and 3 more steps
        "script": "train_bert_ds.py", "world": 1, "setup": "roberta_tokenizer",
        "args": ["--checkpoint_dir", "{tmp}/checkpoints", "--tokenizer", "{tmp}/tokenizer", "--num_layers", "2",
                 "--num_heads", "2", "--ff_dim", "64", "--h_dim", "32", "--batch_size", "4", "--num_iterations", "4",
                 "--dtype", "bf16"],
        "resume": {"args": ["--load_checkpoint_dir", "{exp_dir}", "--num_iterations", "8", "--dtype", "bf16"]},
    },
    "deepspeed_chat_sft_zero2_bf16": {
        # DeepSpeed-Chat's step 1 (supervised fine-tuning), its dschat package beside it: a tiny Llama from_pretrained
        # from {tmp}/model and resized to a multiple of 8 words, ZeRO-2 without --offload (the script's FusedAdam),
        # bf16 (the script takes only fp16 or bf16), gradient clipping 1.0, the script's HF cosine schedule handed to
        # initialize, 2 micro-batches per step: 8 micro-batches of 4, 4 optimizer steps; an evaluation before and
        # after the epoch
        "script": "deepspeed_chat_step1_main.py", "package": "dschat", "world": 1, "setup": "llama",
        "args": DSCHAT_ARGS + ["--zero_stage", "2"], "tolerance": BF16_TOLERANCE,
    },
    "deepspeed_chat_sft_zero2_cpu_offload_bf16": {
        # the same with --offload: the optimizer state on the CPU and the script's DeepSpeedCPUAdam
        "script": "deepspeed_chat_step1_main.py", "package": "dschat", "world": 1, "setup": "llama",
        "args": DSCHAT_ARGS + ["--zero_stage", "2", "--offload"], "tolerance": BF16_TOLERANCE,
    },
    "deepspeed_chat_sft_zero3_cpu_offload_bf16": {
        # at ZeRO-3 with --offload: parameters and optimizer state on the CPU, the model built under
        # HfDeepSpeedConfig (transformers' zero.Init) and its embeddings resized under GatheredParameters
        "script": "deepspeed_chat_step1_main.py", "package": "dschat", "world": 1, "setup": "llama",
        "args": DSCHAT_ARGS + ["--zero_stage", "3", "--offload"], "tolerance": BF16_TOLERANCE,
    },
    "deepspeed_chat_dpo_zero3_cpu_offload": {
        # DeepSpeed-Chat's step 2 by DPO: the policy trained and a reference model evaluated, two ZeRO-3 engines in
        # one process with parameters and optimizer state on the CPU, 2 micro-batches per step, fp32 (an EDIT, as
        # step 3's); an evaluation before and after the epoch
        "script": "deepspeed_chat_step2_dpo_main.py", "package": "dschat", "world": 1, "setup": "llama",
        "args": replaced(DSCHAT_ARGS, data_split="0,10,0", dtype="fp32") + ["--zero_stage", "3", "--offload"],
    },
    "deepspeed_chat_reward_zero3_cpu_offload": {
        # DeepSpeed-Chat's step 2 (the reward model): dschat's RewardModel (the base without its head, a value head)
        # built under HfDeepSpeedConfig, the chosen and rejected answers of each pair in one batch, its pairwise loss;
        # ZeRO-3 with parameters and optimizer state on the CPU, 2 micro-batches per step, fp32 (an EDIT, as step
        # 3's); the reward evaluation (chosen and rejected scores, accuracy) before and after the epoch
        "script": "deepspeed_chat_step2_main.py", "package": "dschat", "world": 1, "setup": "llama",
        "args": [a for a in replaced(DSCHAT_ARGS, data_split="0,10,0", dtype="fp32") if a != "--print_loss"]
        + ["--zero_stage", "3", "--offload", "--num_padding_at_beginning", "0"],  # (step 2 has no --print_loss)
    },
    "deepspeed_chat_rlhf_zero3_cpu_offload": {
        # DeepSpeed-Chat's step 3 (PPO): four engines in one process (actor and critic trained, reference and reward
        # evaluated), ZeRO-3 with parameters and optimizer state on the CPU, the actor generating each batch's answers
        # under ZeRO-3 (sampled: the same draws as DeepSpeed's), actor and critic backward and step in turn; each
        # engine.backward's loss recorded in order (actor, critic, actor, ...)
        "script": "deepspeed_chat_step3_main.py", "package": "dschat", "world": 1, "setup": "llama_critic",
        "args": DSCHAT_STEP3_ARGS,
    },
    "deepspeed_chat_rlhf_zero3_cpu_offload_2ranks": {
        # the same on two ranks (torchrun; zero.launch --num_gpus 2): each rank's prompts, generations and both
        # engines' reductions over gloo; both ranks' losses compared. Each rank's --local_rank the launcher's alone
        # (the one-rank cases' `--local_rank 0`, the last, would win: both ranks would write the prompt dataset's
        # files at once, and one read a file the other had just begun)
        "script": "deepspeed_chat_step3_main.py", "package": "dschat", "world": 2, "setup": "llama_critic",
        "args": DSCHAT_STEP3_ARGS[:DSCHAT_STEP3_ARGS.index("--local_rank")],  # (the last two)
    },
    "deepspeed_chat_rlhf_lora_zero3_cpu_offload": {
        # step 3 with the actor's linear layers given dschat's LoRA (convert_linear_layer_to_lora, after the model
        # was built under zero.Init: its layers are moved `.to(weight.device)` of a partitioned weight) and only the
        # LoRA matrices trained (--only_optimize_lora: the base frozen, partitioned, never stepped), the actor's
        # gradient checkpointing on, an EMA copy of the actor kept (--enable_ema: GatheredParameters each step), and
        # --enable_hybrid_engine as 11 of step 3's 12 training_scripts pass it (the actor's config gets
        # hybrid_engine.enabled). DeepSpeed's hybrid engine needs its CUDA inference kernels ("This op had not been
        # implemented on CPU backend"): DeepSpeed's recording runs without that switch (`deepspeed_without`), which
        # changes which kernels compute the generation, not what it computes
        "script": "deepspeed_chat_step3_main.py", "package": "dschat", "world": 1, "setup": "llama_critic",
        "args": DSCHAT_STEP3_ARGS + ["--actor_lora_dim", "8", "--actor_lora_module_name", "layers.",
                                     "--only_optimize_lora", "--actor_gradient_checkpointing", "--enable_ema",
                                     "--enable_hybrid_engine"],
        "deepspeed_without": ["--enable_hybrid_engine"],
    },
    "bf16_master_weight_bf16_full_zero3": {
        # DeepSpeed's bf16_full.json as it is: ZeRO-3 with nothing offloaded, bf16 master weights and gradients,
        # bf16 optimizer states, and torch_autocast in bf16 around the forward (the script's own autocast around
        # forward and loss too); the script calls loss.backward(), not engine.backward
        "script": "bf16_master_weight_train.py", "world": 1, "config": bf16_example_config("bf16_full"),
        "args": BF16_EXAMPLE_ARGS, "loss_csv": "{tmp}/losses.csv", "tolerance": BF16_TOLERANCE,
    },
    "bf16_master_weight_autocast_fp32_offload": {
        # baseline.json with fp32 parameters under torch_autocast in bf16 (no bf16 section: torch's mixed precision
        # instead of DeepSpeed's), parameters and optimizer state offloaded to the CPU, activation checkpointing
        "script": "bf16_master_weight_train.py", "world": 1, "config": bf16_example_config(
            "baseline", bf16={"enabled": False}, torch_autocast={"enabled": True, "dtype": "bfloat16"},
            zero_optimization={"offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu"}}),
        "args": BF16_EXAMPLE_ARGS + ["--activation_checkpointing"], "loss_csv": "{tmp}/losses.csv",
        "tolerance": BF16_TOLERANCE,
    },
    "zero_inference_opt_cpu_offload": {
        # ZeRO-Inference: an OPT from_pretrained under HfDeepSpeedConfig (built under zero.Init), initialize without an
        # optimizer, ZeRO-3 with parameters offloaded to the CPU, generate() on the engine's module; each forward's
        # logits compared (prefill and 5 decoding steps, twice)
        "script": "zero_inference/run_model.py", "world": 1, "setup": "opt", "record": "logits",
        "args": ZERO_INFERENCE_ARGS + ["--cpu-offload"],
    },
    "zero_inference_opt_disk_offload": {
        # the same with the parameters on NVMe (the script's aio section), under an --offload-dir that does not exist
        # yet (DeepSpeed creates it)
        "script": "zero_inference/run_model.py", "world": 1, "setup": "opt", "record": "logits",
        "args": ZERO_INFERENCE_ARGS + ["--disk-offload", "--offload-dir", "{tmp}/offload"],
    },
}

MODES = ("deepspeed", "zero_imports", "zero_launch")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rewrite_imports(source: str) -> str:
    """`import deepspeed` -> `import zero as deepspeed`, `import deepspeed.x as y` -> `import zero.x as y`,
    `from deepspeed...` -> `from zero...`, and transformers' `HfDeepSpeedConfig` (which needs the deepspeed package)
    -> `from zero.integrations.hf_config import HfZeroConfig as HfDeepSpeedConfig`; nothing else."""
    source = re.sub(r"^(\s*)from transformers\.(?:integrations\.)?deepspeed import HfDeepSpeedConfig(\r?)$",
                    r"\1from zero.integrations.hf_config import HfZeroConfig as HfDeepSpeedConfig\2", source, flags=re.M)
    source = re.sub(r"^(\s*)import deepspeed(\r?)$", r"\1import zero as deepspeed\2", source, flags=re.M)
    source = re.sub(r"^(\s*)import deepspeed((?:\.\w+)+) as ", r"\1import zero\2 as ", source, flags=re.M)
    source = re.sub(r"^(\s*)from deepspeed([. ])", r"\1from zero\2", source, flags=re.M)
    left = re.findall(r"^\s*(?:import|from) deepspeed\b.*$", source, flags=re.M)
    assert not left, f"imports not rewritten: {left}"
    return source


def setup(case: dict, tmp: str) -> None:
    sys.path.insert(0, HERE)
    try:
        import tiny_models
    finally:
        sys.path.remove(HERE)
    if case.get("setup") in ("llama", "llama_critic"):
        tiny_models.write_llama(os.path.join(tmp, "model"))
    if case.get("setup") == "opt":
        tiny_models.write_opt(os.path.join(tmp, "model"))
    if case.get("setup") == "llama_critic":
        tiny_models.write_critic(os.path.join(tmp, "critic"), os.path.join(tmp, "model"))
    elif case.get("setup") == "roberta_tokenizer":
        tiny_models.write_roberta_tokenizer(os.path.join(tmp, "tokenizer"))
    if "config" in case:
        os.makedirs(os.path.join(tmp, "nvme"), exist_ok=True)
        with open(os.path.join(tmp, "ds_config.json"), "w") as f:
            f.write(json.dumps(case["config"], indent=2).replace("{tmp}", tmp))


def fill(args: list[str], tmp: str) -> list[str]:
    filled = [a.replace("{tmp}", tmp) for a in args]
    if any("{exp_dir}" in a for a in filled):
        made = glob.glob(os.path.join(tmp, "checkpoints", "bert_pretrain.*"))
        assert len(made) == 1, f"the first run made {made}, not one experiment directory"
        filled = [a.replace("{exp_dir}", made[0]) for a in filled]
    return filled


def command(case: dict, mode: str, tmp: str, args: list[str], python: str) -> tuple[list[str], dict]:
    """The command line and environment of one run."""
    script = os.path.join(HERE, case["script"])
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "ZT_LOSS_LOG")}
    env["PYTHONPATH"] = os.pathsep.join([RECORDER, *filter(None, [env.get("PYTHONPATH")])])
    env["OMP_NUM_THREADS"] = "1"
    env["TOKENIZERS_PARALLELISM"] = "false"
    port = str(free_port())
    world = case["world"]
    if mode == "zero_launch":
        return [python, "-m", "zero.launch", "--num_gpus", str(world), "--master_port", port, script, *args], env
    if mode == "deepspeed":
        env["DS_ACCELERATOR"] = "cpu"
    else:
        with open(script, newline="") as f:
            source = f.read()
        script = os.path.join(tmp, "zero_imports_" + case["script"])
        with open(script, "w", newline="") as f:
            f.write(rewrite_imports(source))
        if "package" in case:  # the script's own modules, imported from beside it: rewritten too
            copy_rewritten(os.path.join(HERE, case["package"]), os.path.join(tmp, case["package"]))
    if world == 1:
        env.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        return [python, script, *args], env
    return [python, "-m", "torch.distributed.run", *launcher_args(world), "--master-addr", "127.0.0.1",
            "--master-port", port, os.path.join(HERE, "local_rank.py"), script, *args], env


def copy_rewritten(source_dir: str, target_dir: str) -> None:
    """A copy of a package directory with every .py file's imports rewritten (rewrite_imports)."""
    for root, dirs, files in os.walk(source_dir):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        target = os.path.join(target_dir, os.path.relpath(root, source_dir))
        os.makedirs(target, exist_ok=True)
        for name in files:
            if name.endswith(".py"):
                with open(os.path.join(root, name), newline="") as f:
                    source = f.read()
                with open(os.path.join(target, name), "w", newline="") as f:
                    f.write(rewrite_imports(source))


def launcher_args(world: int) -> list[str]:
    return ["--nnodes", "1", "--nproc-per-node", str(world)]


def run_once(case: dict, mode: str, tmp: str, args: list[str], name: str, python: str, timeout: int) -> list[list[float]]:
    """Run; each rank's losses, in order of rank."""
    log = os.path.join(tmp, "losses", name)
    os.makedirs(os.path.dirname(log), exist_ok=True)
    argv, env = command(case, mode, tmp, fill(args, tmp), python)
    env["ZT_LOSS_LOG"] = log
    env["ZT_RECORD"] = case.get("record", "loss")
    done = subprocess.run(argv, cwd=tmp, env=env, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}\nexited {done.returncode}\n--- stdout\n{done.stdout[-4000:]}\n"
                           f"--- stderr\n{done.stderr[-8000:]}")
    if "loss_csv" in case:  # a script that calls loss.backward(): its own log of each step's loss (rank 0)
        with open(case["loss_csv"].replace("{tmp}", tmp)) as f:
            return [[float(row["loss"]) for row in csv.DictReader(f)]]
    losses = []
    for rank in range(case["world"]):
        with open(f"{log}.rank{rank}") as f:
            losses.append([float(line.split()[0]) for line in f if line.strip()])
    return losses


def deepspeed_args(case: dict) -> list[str]:
    """The arguments of DeepSpeed's run of `case`: its own, less its `deepspeed_without`."""
    return [a for a in case["args"] if a not in case.get("deepspeed_without", ())]


def run_case(name: str, mode: str, tmp: str, python: str = sys.executable, timeout: int = 600) -> dict:
    """Run a case (and its resume) in `tmp`: {"losses": rank 0's, "losses_rank1": ..., "resume": {...}}."""
    case = CASES[name]
    setup(case, tmp)
    args = deepspeed_args(case) if mode == "deepspeed" else case["args"]
    result = as_result(run_once(case, mode, tmp, args, "first", python, timeout))
    if "resume" in case:
        result["resume"] = as_result(run_once(case, mode, tmp, case["resume"]["args"], "resume", python, timeout))
    return result


def as_result(per_rank: list[list[float]]) -> dict:
    return {"losses": per_rank[0], **{f"losses_rank{r}": losses for r, losses in enumerate(per_rank) if r}}
