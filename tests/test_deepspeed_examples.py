"""Real scripts from DeepSpeed's examples repository (deepspeedai/DeepSpeedExamples at 45b4b715, copied under
tests/deepspeed_examples/ with synthetic data and tiny sizes, every change marked `EDIT(zero-tiering)`) run on our
engine, and each step's loss equals DeepSpeed's own on the same script and data, within 1e-5 (fp32; 2e-3 where the
model computes in bf16 and its loss is computed in fp32: a case's `tolerance`).

DeepSpeed's losses were recorded once with DeepSpeed 0.19 on this CPU (tests/deepspeed_examples/record.py; README.md
there) into deepspeed_losses.json; DeepSpeed is not needed here. Each run is in a fresh directory:
- zero_launch, every case: the script unchanged, under `python -m zero.launch --num_gpus N`;
- zero_imports: the script with its imports changed to `import zero as deepspeed` / `from zero...`, started as
  DeepSpeed's run was (one rank: a plain process; two: torchrun), for the cases zero_launch cannot run and for
  IMPORTS_TOO (the engine is the same either way: what differs is how the script reaches it, so the other cases'
  second run would repeat the same training for the suite's minutes).
The cases (tests/deepspeed_examples/harness.py):
- cifar10_deepspeed.py, ZeRO-3 with parameters and optimizer state offloaded to the CPU, on 1 rank and on 2;
- DeepSpeed-SuperOffload/finetune_zero3.py: a Hugging Face Llama (tiny, from_pretrained from a local directory)
  fine-tuned with ZeRO-3, the script's own DeepSpeedCPUAdam, parameters and optimizer state offloaded to NVMe;
- HelloDeepSpeed/train_bert_ds.py: a RoBERTa MLM built outside any Trainer, ZeRO-1 with the optimizer on the CPU
  (bf16: the script takes fp16 or bf16 only), save_checkpoint after 3 steps, then a second run that
  load_checkpoints it and trains 3 more steps;
- DeepSpeed-Chat's training/step1_supervised_finetuning/main.py with its dschat package (copied beside it,
  imports rewritten too in the zero_imports run): a tiny Llama from_pretrained and resized by the script, bf16,
  2 micro-batches per step, the script's HF cosine schedule; at ZeRO-2 (FusedAdam), at ZeRO-2 with --offload
  (DeepSpeedCPUAdam, optimizer state on the CPU) and at ZeRO-3 with --offload (parameters too; the model built
  under transformers' HfDeepSpeedConfig, which is zero's HfZeroConfig under the launcher, and by its rewritten
  import in the zero_imports run); its DPO step (a reference engine beside the policy) and step 3 (PPO: four
  engines, generation under ZeRO-3), both in fp32, step 3 also on two ranks, and with dschat's LoRA on the actor
  (--only_optimize_lora), gradient checkpointing, an EMA copy and --enable_hybrid_engine (DeepSpeed's run without
  that switch: its hybrid engine needs CUDA kernels);
- training/bf16_master_weight/train.py: its bf16_full.json as it is (ZeRO-3 on the device, bf16 master weights,
  gradients and optimizer states, torch_autocast, loss.backward() instead of engine.backward), and fp32 parameters
  under torch_autocast with cpu offload and activation checkpointing.
A case's `zero_launch_limit` skips its zero_launch run (a documented limit, with the reason).
"""
from __future__ import annotations

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "deepspeed_examples"))
import harness  # noqa: E402

with open(harness.FIXTURE) as _f:
    FIXTURE = json.load(_f)

HF_CASES = {"superoffload_finetune_zero3_nvme_1rank", "hello_bert_zero1_cpu_offload_save_load",
            *(name for name in harness.CASES if name.startswith(("deepspeed_chat_", "zero_inference_")))}


def check(name: str, run: str, ours: dict, theirs: dict, tolerance: float = harness.TOLERANCE) -> None:
    """Every rank's per-step losses of one run, ours against DeepSpeed's."""
    lines, worst = [], 0.0
    for key in sorted(k for k in theirs if k.startswith("losses")):
        mine, recorded = ours.get(key), theirs[key]
        assert mine is not None and len(mine) == len(recorded), \
            f"{name} ({run}) {key}: {len(mine or [])} steps here, DeepSpeed had {len(recorded)}"
        diffs = [abs(a - b) for a, b in zip(mine, recorded)]
        worst = max(worst, *diffs)
        lines.append(f"{key}: zero {mine}\n{' ' * len(key)}  DeepSpeed {recorded}\n"
                     f"{' ' * len(key)}  |diff| {[f'{d:.2e}' for d in diffs]}")
    report = f"{name} ({run}): max |zero - DeepSpeed| = {worst:.3g} (tolerance {tolerance})\n" + \
        "\n".join(lines)
    print(report)
    assert worst <= tolerance, report


IMPORTS_TOO = {"cifar10_zero3_cpu_offload_1rank", "deepspeed_chat_sft_zero3_cpu_offload_bf16"}
"""Cases run with rewritten imports beside their zero_launch run: a script of its own, and the model built under
HfZeroConfig named by the script (the launcher gives it transformers' name). Two ranks under torchrun run the same
engine as under zero.launch (the cifar10 and DeepSpeed-Chat two-rank cases)."""
RUNS = [(name, "zero_launch") for name in harness.CASES] + [
    (name, "zero_imports") for name, case in harness.CASES.items()
    if "zero_launch_limit" in case or name in IMPORTS_TOO]


@pytest.mark.slow
@pytest.mark.parametrize("name, mode", RUNS)
def test_losses_equal_deepspeeds(name, mode, tmp_path):
    if name in HF_CASES:
        pytest.importorskip("transformers")
    case = harness.CASES[name]
    if mode == "zero_launch" and "zero_launch_limit" in case:
        pytest.skip(case["zero_launch_limit"])
    assert name in FIXTURE, f"{name}: no DeepSpeed losses recorded (tests/deepspeed_examples/record.py)"
    recorded = FIXTURE[name]
    assert recorded["script"] == case["script"] and recorded["args"] == harness.deepspeed_args(case) and \
        recorded["world"] == case["world"], f"{name}: the case changed since it was recorded: record it again"
    ours = harness.run_case(name, mode, str(tmp_path), timeout=300)
    tolerance = case.get("tolerance", harness.TOLERANCE)
    check(name, "first", ours, recorded, tolerance)
    if "resume" in case:
        check(name, "resume", ours["resume"], recorded["resume"], tolerance)
