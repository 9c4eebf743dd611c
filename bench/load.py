"""Pretrained weights straight into the tiers: a transformers GPT-2 saved with save_pretrained, loaded into a model
built on meta by `zero.initialize(..., weights=DIR)` (ZeRO-3, parameters and optimizer state on nvme) under a host
budget half the weights' size. Reports the peak RSS (VmHWM) against host budget + 1 GiB, the host pool's peak,
the bytes written to nvme and the seconds it took.

    python bench/load.py [--quick] [--layers 24] [--hidden 1536] [--dir /tmp] [--json PATH]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from children import vm_hwm  # noqa: E402  (bench/ is the script's directory)
from scratch import scratch_dir  # noqa: E402


SAVE = """
import json, sys, torch
from transformers import AutoModelForCausalLM, GPT2Config
torch.manual_seed(0)
AutoModelForCausalLM.from_config(GPT2Config.from_dict(json.loads(sys.argv[1]))).save_pretrained(sys.argv[2])
"""


def main() -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a small model, seconds (what the tests run)")
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--hidden", type=int, default=1536)
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="where the model and the nvme tier go")
    parser.add_argument("--json", help="write the record here")
    args = parser.parse_args()
    if args.quick:
        args.layers, args.hidden = 4, 128
    import torch
    from transformers import AutoModelForCausalLM, GPT2Config

    import zero

    with scratch_dir(parser, args.dir) as work:
        model_dir, nvme = os.path.join(work, "model"), os.path.join(work, "nvme")
        config = GPT2Config(n_layer=args.layers, n_embd=args.hidden, n_head=max(1, args.hidden // 64), n_positions=128,
                            vocab_size=1024 if args.quick else 50257)
        # Saved by another process: the model in memory would be this one's high-water mark.
        subprocess.run([sys.executable, "-c", SAVE, json.dumps(config.to_dict()), model_dir], check=True)
        weights = sum(os.path.getsize(os.path.join(model_dir, f)) for f in os.listdir(model_dir)
                      if f.endswith(".safetensors"))
        budget = weights // 2 // 4096 * 4096
        os.makedirs(nvme)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        offload = {"device": "nvme", "nvme_path": nvme}
        ds_config = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
                     "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                           # quick: sub-groups small beside the model's, as the full size's are
                                           "sub_group_size": 20_000 if args.quick else 4_000_000,
                                           "offload_param": offload,
                                           "offload_optimizer": dict(offload)},
                     "zero_tiering": {"host_budget": budget}}
        start = time.perf_counter()
        engine = zero.initialize(model=model, config=ds_config, weights=model_dir)[0]
        record = {"weights_bytes": weights, "host_budget": budget, "peak_rss": vm_hwm(), "limit": budget + (1 << 30),
                  "pool_peak": engine.swap.pool.peak_in_use,
                  "nvme_bytes": engine.swap.store.used_bytes, "load_s": time.perf_counter() - start}
        engine.close()
    print(f"weights {weights / 1e9:.2f} GB, host budget {budget / 1e9:.2f} GB: peak RSS {record['peak_rss'] / 1e9:.2f}"
          f" GB (host budget + 1 GiB = {record['limit'] / 1e9:.2f}), pool peak {record['pool_peak'] / 1e9:.2f} GB, "
          f"{record['nvme_bytes'] / 1e9:.1f} GB on nvme, {record['load_s']:.1f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(record, f, indent=1)
    return record


if __name__ == "__main__":
    main()
