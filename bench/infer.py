"""Inference from the tiers against its bound: a GPT-2 shaped model saved with save_pretrained, generated from
greedily by plain transformers in memory, by zero.init_inference with the weights in host memory, and with the
weights on nvme under a host budget a quarter of their size (16 MiB at least, and never below the engine's minimum,
zero.inference.engine.host_need: GPT-2's tied embedding is one unit, 154 MB at 124M). Each system runs in a process
of its own (bench/children.py: its peak RSS is its own); the tokens must be the same.

    python bench/infer.py [--quick] [--layers 12] [--hidden 768] [--new-tokens 16] [--systems A,B,...] [--json PATH]

Per system: prefill seconds (a 32-token prompt), decode tokens/s (the median interval between new tokens), peak
RSS, nvme bytes read per decoded token. The bounds are measured in the same run: host memory, the weight bytes a
forward copies (read and written once) over the machine's copy rate; nvme, the bytes a token reads over the
disk's read rate (`zero.report`'s measurement through our NvmeStore, on the same directory, just before and
just after the nvme system runs: the bound uses their mean, as the disk drifts).

With deepspeed installed (`--systems` adds `deepspeed-nvme`), DeepSpeed's ZeRO-Inference does the same: the model
from_pretrained under transformers' HfDeepSpeedConfig, `deepspeed.initialize` without an optimizer, ZeRO-3 with the
parameters on nvme (DeepSpeed keeps no weights in host memory between forwards: `max_in_cpu` is read, not used);
its bytes read a token are the process's own storage reads (/proc/self/io), the tokens must be the same.

Without CUDA, the "device" the copies land in is host memory too, so the copy and the forward's own reads of the
weights share one memory bus; a second yardstick for weights in host memory says what that allows: the copy at
the copy rate and the in-memory forward at its measured rate, one after the other (each alone runs at about the
bus's rate, so running them together cannot take less than the sum). On a GPU the copy crosses PCIe while the
forward reads device memory, and the copy bound alone is the yardstick.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import socket
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import children  # noqa: E402  (bench/ is the script's directory)
from scratch import scratch_dir  # noqa: E402
from zero.inference.__main__ import Clock  # noqa: E402

SYSTEMS = ("torch", "ours-cpu", "ours-nvme", "ours-nvme-stream", "deepspeed-nvme")
"""ours-nvme-stream: the host budget at the engine's least (host_need), so that, as DeepSpeed's, nearly every weight
is read from nvme at every token."""
DEFAULT_SYSTEMS = "torch,ours-cpu,ours-nvme"
PRELOAD = ["torch", "transformers", "zero"]
"""What the children's server imports: no more than each child imports anyway (this script imports zero's Clock)."""


def storage_read() -> int:
    """Bytes this process has read from storage (all its threads; O_DIRECT reads too)."""
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("read_bytes:"))


def deepspeed_model(args: argparse.Namespace):
    """The model as ZeRO-Inference's run_model.py builds it, parameters on nvme; the HfDeepSpeedConfig kept with it."""
    import deepspeed
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.integrations.deepspeed import HfDeepSpeedConfig

    shape = AutoConfig.from_pretrained(args.model)
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {
        "stage": 3, "stage3_param_persistence_threshold": 0,
        "offload_param": {"device": "nvme", "nvme_path": args.nvme, "buffer_count": 5,
                          "buffer_size": shape.vocab_size * shape.n_embd}}}  # its buffers hold the largest tensor
    deepspeed.init_distributed("gloo")
    keep = HfDeepSpeedConfig(config)  # from_pretrained builds under deepspeed.zero.Init
    model = AutoModelForCausalLM.from_pretrained(args.model)
    engine = deepspeed.initialize(model=model, config=config)[0]
    engine.module.eval()
    return engine.module, keep


def child(args: argparse.Namespace) -> dict:
    """One system's generation, in a process of its own (bench/children.py)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if args.port is not None:  # one rank of torch.distributed, as DeepSpeed's launcher sets it
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port), RANK="0", WORLD_SIZE="1",
                          LOCAL_RANK="0")
    torch.set_num_threads(args.threads)
    prompt = torch.randint(0, 1000, (1, 32), generator=torch.Generator().manual_seed(0))
    engine = None
    if args.child == "torch":
        model = AutoModelForCausalLM.from_pretrained(args.model).eval()
    elif args.child == "deepspeed-nvme":
        model, _keep = deepspeed_model(args)
    else:
        import zero

        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(args.model))
        nvme = args.child.startswith("ours-nvme")
        offload = {"device": "nvme", "nvme_path": args.nvme} if nvme else {"device": "cpu"}
        config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {
            "stage": 3, "offload_param": offload, "stage3_param_persistence_threshold": 0}}
        if nvme:
            from zero.inference.engine import host_need

            budget = args.host_budget if args.child == "ours-nvme" else 0
            config["zero_tiering"] = {"host_budget": max(budget, host_need(model, config))}
        engine = model = zero.init_inference(model, config, weights=args.model)
    clock = Clock()
    read_before = storage_read()
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=args.new_tokens,
                             do_sample=False, pad_token_id=0, streamer=clock)
    intervals = [b - a for a, b in zip(clock.times[1:], clock.times[2:])]
    read = engine.swap.stats.bytes_moved.get("nvme->host", 0) if engine is not None else 0
    if args.child == "deepspeed-nvme":
        read = storage_read() - read_before
    if engine is not None:
        engine.close()
    return {"system": args.child, "prefill_s": clock.times[1] - start, "decode_tok_s": 1 / statistics.median(intervals),
            "host_budget": engine.swap.pool.budget if engine is not None else None,
            "nvme_read_per_token": read / max(1, args.new_tokens), "tokens": out[0, 32:].tolist()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a tiny model, seconds (what the tests run)")
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="where the model and the nvme tier go")
    parser.add_argument("--systems", help=f"some of {', '.join(SYSTEMS)} (default: {DEFAULT_SYSTEMS}, and "
                        "deepspeed-nvme where deepspeed is installed)")
    parser.add_argument("--json", help="write the records here")
    args = parser.parse_args()
    if args.quick:
        args.layers, args.hidden, args.new_tokens = 2, 64, 6
    have_deepspeed = importlib.util.find_spec("deepspeed") is not None  # imported in its child only
    systems = (args.systems or DEFAULT_SYSTEMS + (",deepspeed-nvme" if have_deepspeed else "")).split(",")
    if not set(systems) <= set(SYSTEMS) or "torch" not in systems:
        sys.exit(f"--systems {args.systems}: torch and some of {', '.join(SYSTEMS)}")
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from zero.plan.machine import memory_rates
    from zero.report.bandwidth import measure

    with scratch_dir(parser, args.dir) as work:
        torch.manual_seed(0)
        config = GPT2Config(n_layer=args.layers, n_embd=args.hidden, n_head=max(1, args.hidden // 64),
                            vocab_size=50257 if not args.quick else 1024, n_positions=128)
        GPT2LMHeadModel(config).save_pretrained(os.path.join(work, "model"))
        weights = os.path.getsize(os.path.join(work, "model", "model.safetensors"))
        nvme = os.path.join(work, "nvme")
        os.makedirs(nvme)
        probe = max(64 << 20, min(512 << 20, weights // 4096 * 4096))
        copy_rate = memory_rates()[0]
        records = []
        disk = []  # the disk's read rate before the first nvme system and after each
        for system in systems:
            nvme_system = system.endswith(("nvme", "stream"))
            if nvme_system and not disk:
                disk.append(measure(nvme, probe).read_gbps)
            port = None
            if system.startswith("deepspeed"):
                with socket.socket() as free:
                    free.bind(("127.0.0.1", 0))
                    port = free.getsockname()[1]
            record, peak = children.run(child, argparse.Namespace(
                child=system, model=os.path.join(work, "model"), nvme=nvme, host_budget=max(weights // 4, 16 << 20),
                threads=args.threads, new_tokens=args.new_tokens, port=port), preload=PRELOAD)
            records.append({**record, "peak_rss": peak})
            if nvme_system:
                disk.append(measure(nvme, probe).read_gbps)
                records[-1]["disk_read_gbps"] = (disk[-2] + disk[-1]) / 2  # the rates just before and just after
    same = all(r["tokens"] == records[0]["tokens"] for r in records)
    memory_bound = copy_rate / (2 * weights)
    in_memory = next(r["decode_tok_s"] for r in records if r["system"] == "torch")
    bus_bound = 1 / (1 / memory_bound + 1 / in_memory)
    print(f"model: {weights / 1e6:.0f} MB of fp32 weights; copy {copy_rate / 1e9:.1f} GB/s (read + written), disk "
          f"read {', '.join(f'{rate:.2f}' for rate in disk)} GB/s before and after each nvme system; tokens "
          f"identical: {same}")
    print(f"{'system':<16} {'prefill s':>10} {'decode tok/s':>13} {'GB read/tok':>12} {'bound tok/s':>12} "
          f"{'of bound':>9} {'peak RSS MB':>12}")
    for r in records:
        bound = None
        if r["system"] == "ours-cpu":
            bound = memory_bound
            r["bus_bound_tok_s"] = bus_bound
        elif "disk_read_gbps" in r and r["nvme_read_per_token"]:
            bound = r["disk_read_gbps"] * 1e9 / r["nvme_read_per_token"]
        r["bound_tok_s"] = bound
        shown = f"{bound:12.2f} {r['decode_tok_s'] / bound:9.2f}" if bound else f"{'':>12} {'':>9}"
        print(f"{r['system']:<16} {r['prefill_s']:10.3f} {r['decode_tok_s']:13.2f} "
              f"{r['nvme_read_per_token'] / 1e9:12.3f} {shown} {r['peak_rss'] / 1e6:12.0f}")
    for r in records:
        if r["system"].startswith("ours-nvme"):
            print(f"{r['system']}'s host budget: {r['host_budget'] / 1e6:.0f} MB")
    for ours in (r for r in records if r["system"] == "ours-cpu"):
        print(f"weights in host memory, copy and forward on one memory bus: bound {bus_bound:.2f} tokens/s (the copy "
              f"at {memory_bound:.2f}, then the in-memory forward at {in_memory:.2f}); ours "
              f"{ours['decode_tok_s'] / bus_bound:.2f} of it")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"weights_bytes": weights, "copy_bytes_per_s": copy_rate, "disk_read_gbps": disk,
                       "tokens_identical": same, "records": records}, f, indent=1)
    if not same:
        sys.exit("the systems generated different tokens")


if __name__ == "__main__":
    main()
