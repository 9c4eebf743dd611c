"""`python -m zero.inference`: generate from a saved model whose weights stay in host memory or on nvme.

    python -m zero.inference --model DIR --prompt "Hello" --max-new-tokens 32
    python -m zero.inference --model DIR --offload nvme --host-budget 1GiB --prompt-ids 1,2,3

DIR is a `save_pretrained` directory (config.json and model.safetensors, or its shards) or our export. The model
is built on meta and its weights read unit by unit into the tier asked for; the prompt goes through DIR's
tokenizer when it has one, else its UTF-8 bytes are the token ids. Greedy decoding; prints the output, the
prefill time, decode tokens/s, the weight bytes each forward streams and the peak RSS.
"""
from __future__ import annotations

import argparse
import os
import resource
import time

import torch

from tiering.errors import fmt_bytes

from ..cli import add_common_flags, run_command
from ..config import read_json
from ..config.sizes import parse_size
from .engine import init_inference

DTYPES = {"fp32": None, "bf16": "bf16", "fp16": "fp16"}


class Clock:
    """A generate() streamer that notes when each token arrives: the prompt first, then one per new token."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value: torch.Tensor) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m zero.inference", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="a save_pretrained directory (or our export)")
    prompt = parser.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="text (tokenized by the model's tokenizer, else as UTF-8 bytes)")
    prompt.add_argument("--prompt-ids", help="token ids, comma-separated")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--config", help="a DeepSpeed-format config (stage 3, offload_param); overrides the flags")
    parser.add_argument("--offload", choices=("cpu", "nvme"), default="cpu", help="where the weights stay")
    parser.add_argument("--nvme-path", default="/tmp/zero_tiering_nvme")
    parser.add_argument("--host-budget", help="zero_tiering.host_budget (e.g. 1GiB)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32", help="the compute dtype")
    add_common_flags(parser)
    return parser.parse_args(argv)


def inference_config(args: argparse.Namespace) -> dict:
    if args.config:
        return read_json(args.config)  # as load_config reads it: a key twice is an error
    offload = {"device": args.offload}
    if args.offload == "nvme":
        if os.path.exists(args.nvme_path) and not os.path.isdir(args.nvme_path):
            raise ValueError(f"--nvme-path {args.nvme_path!r} is not a directory")
        os.makedirs(args.nvme_path, exist_ok=True)
        offload["nvme_path"] = args.nvme_path
    config = {"train_micro_batch_size_per_gpu": 1,
              "zero_optimization": {"stage": 3, "offload_param": offload, "stage3_param_persistence_threshold": 0}}
    if DTYPES[args.dtype]:
        config[DTYPES[args.dtype]] = {"enabled": True}
    if args.host_budget:
        try:  # a bad size is named here, before the model is built
            parse_size(args.host_budget)
        except ValueError as exc:
            raise ValueError(f"--host-budget {args.host_budget!r}: {exc}") from None
        config["zero_tiering"] = {"host_budget": args.host_budget}
    return config


def main(argv: list[str] | None = None) -> list[int]:
    args = parse_args(argv)
    from transformers import AutoConfig, AutoModelForCausalLM

    if not os.path.isfile(os.path.join(args.model, "config.json")):
        raise ValueError(f"--model {args.model!r}: no config.json there (a save_pretrained directory is expected)")
    model_config = AutoConfig.from_pretrained(args.model)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(model_config)
    engine = init_inference(model, inference_config(args), weights=args.model)
    try:
        tokenizer = load_tokenizer(args.model)
        if args.prompt_ids is not None:
            try:
                ids = [int(i) for i in args.prompt_ids.split(",")]
            except ValueError:
                raise ValueError(f"--prompt-ids {args.prompt_ids!r}: token ids separated by commas, such as 1,2,3") \
                    from None
        elif tokenizer is not None:
            ids = tokenizer(args.prompt)["input_ids"]
        else:
            ids = list(args.prompt.encode())
        if not ids:
            raise ValueError("the prompt is empty: give --prompt some text or --prompt-ids at least one id")
        bad = [i for i in ids if not 0 <= i < model_config.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary (0..{model_config.vocab_size - 1})")
        prompt = torch.tensor([ids], dtype=torch.long, device=engine.device)
        clock = Clock()
        start = time.perf_counter()
        out = engine.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=args.max_new_tokens,
                              do_sample=False, pad_token_id=model_config.eos_token_id or 0, streamer=clock)
        new = out[0, len(ids):].tolist()
        print(tokenizer.decode(new) if tokenizer is not None else f"token ids: {new}")
        report(engine, clock.times, start, len(new))
        return new
    finally:
        engine.close()


def load_tokenizer(directory: str):
    if not any(os.path.exists(os.path.join(directory, name)) for name in ("tokenizer.json", "tokenizer_config.json")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(directory)


def report(engine, times: list[float], start: float, new_tokens: int) -> None:
    weight_bytes = sum(unit.nbytes for unit in engine.placement.units)
    prefill = times[1] - start if len(times) > 1 else float("nan")
    decode = (new_tokens - 1) / (times[-1] - times[1]) if new_tokens > 1 else float("nan")
    read = engine.swap.stats.bytes_moved.get("nvme->host", 0)
    print(f"prefill {prefill:.3f} s, decode {decode:.2f} tokens/s; {fmt_bytes(weight_bytes)} of weights streamed "
          f"each forward, {fmt_bytes(read)} read from nvme; peak RSS "
          f"{fmt_bytes(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)}")


if __name__ == "__main__":
    run_command("zero.inference", main, errors=(ValueError,))  # ValueError: a bad prompt, PretrainedWeightsError
