"""Everything that needs a GPU, in one command and one report (issue 25): a session that gets a CUDA machine proves
the GPU path in minutes. Without CUDA it runs too (CI): parity on the CPU through the copy worker, the GPU-only
figures as "skipped: WHAT — WHY" lines, bench/train.py --quick.

    python bench/gpu_check.py [--quick] [--out DIR] [--json PATH] [--dir NVME_PARENT] [--only N,N]

Writes DIR/gpu_check.md and DIR/gpu_check.json (DIR: bench/out/); exits 0 when every check that ran passed. Each
check runs on its own (an error is recorded, the next check runs):
1. every `cuda`-marked test;
2. ZeRO-3 parity: a small GPT trained by zero.initialize (state on cpu, then on nvme; fp32 and bf16) against the
   same model trained in memory on the same device with torch.optim.AdamW; again with every host<->device copy held
   back on the copy stream, which must not change a loss (compute that skips a wait would read other bytes);
3. torch.profiler on one streamed step: the share of copy time that overlaps kernels, of step time with no kernel;
4. budgets after streamed steps: host bytes (pinned with CUDA) against the host budget, device bytes against the
   device budget (torch.cuda.max_memory_allocated with CUDA);
5. bench/train.py against plain PyTorch and, where it imports, DeepSpeed: GPT 124M and the 1b preset at 4 layers;
   each system's disk bytes a step, and the bytes of our gradients through nvme.
--quick: small models, bench/train.py --quick (~3 minutes on a GPU); the full run fits 10 minutes on an H100.

On a device machine with torch+CUDA, transformers and pytest but no package index, install the project without
touching its torch or build tools, then run:

    pip install --no-deps --no-build-isolation -e . && python bench/gpu_check.py --quick && python bench/gpu_check.py

Missing libaio or deepspeed, or a kernel refusing io_submit or O_DIRECT, is no error: zero_tiering.engine "auto"
serves the nvme tier with the `threads` engine (the report's zero.report engine line says which) and DeepSpeed's
rows are skipped.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.metadata
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from unittest import mock

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:0] = [ROOT, HERE, os.path.join(ROOT, "tests")]

import torch  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

import zero  # noqa: E402
from stage3_models import (  # noqa: E402  (tests/stage3_models.py)
    OWN_CONFIG, VOCAB, batches, engine_train, loss_of, one_thread, own_gpt, reference_train, stage3_config,
)
from tiering.copy_stream import CudaCopyStream, WorkerCopyStream  # noqa: E402
from tiering.errors import fmt_bytes  # noqa: E402
from zero.report.checks import run_checks  # noqa: E402
from zero.train.gpt import GPTConfig  # noqa: E402

from scratch import scratch_dir  # noqa: E402  (bench/)

GRADIENT_HOOKS = "torch::autograd::AccumulateGrad"
"""The profiler's name for a leaf's gradient hook: ours reduce the gradient, send it to the host and add it there."""
FP32_RTOL = 1e-4
"""fp32 losses against torch's, relative: bitwise on CPU; on CUDA CPU-Adam and torch's fused CUDA AdamW may round
differently in the last bit, which a few steps grow to ~1e-6."""
BF16_RTOL = 0.02
"""bf16 losses against the fp32 reference's, relative (tests/test_stage3_parity.py's BF16_LOSS_RTOL)."""
SLEEP_CYCLES = 2_000_000
"""GPU clock cycles each delayed copy waits on the copy stream (~1 ms at an H100's 2 GHz)."""
SLEEP_S = 0.005
"""Seconds each delayed copy waits on the copy worker (as in tests/test_stage3_copies.py)."""
STREAMED = {"cpu": GPTConfig(n_layer=4, n_head=2, n_embd=64, vocab_size=VOCAB, seq_len=16),
            "quick": GPTConfig(n_layer=4, n_head=8, n_embd=512, vocab_size=VOCAB, seq_len=256),
            "full": GPTConfig(n_layer=8, n_head=16, n_embd=1024, vocab_size=VOCAB, seq_len=512)}
"""The models of checks 3 and 4, by run."""
PROFILE_BATCH = 64
"""Sequences a step in check 3: a unit's kernels must take about as long as its copies for an overlap to be possible
(an H100 moves a parameter over the bus in about the time it runs ~16k tokens through it); at 8 x 256 tokens the
first GPU run measured 1 ms of kernels against 6 ms of copies."""
STEP = "gpu_check.step"


@dataclasses.dataclass(frozen=True)
class Plan:
    """What this run does: --quick picks the small sizes, as does a machine without CUDA."""
    quick: bool
    nvme_parent: str | None
    cuda: bool = dataclasses.field(default_factory=torch.cuda.is_available)

    @property
    def device(self) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device()) if self.cuda else torch.device("cpu")

    @property
    def streamed(self) -> GPTConfig:
        return STREAMED["cpu" if not self.cuda else "quick" if self.quick else "full"]


def skipped(what: str, why: str) -> dict:
    return {"status": "skipped", "skipped": [f"{what} — {why}"]}


def machine(plan: Plan, nvme_dir: str) -> dict:
    """The device, driver, versions, and zero.report's lines (libaio, O_DIRECT, the engine `auto` picks...)."""
    try:
        deepspeed = importlib.metadata.version("deepspeed")
    except importlib.metadata.PackageNotFoundError:
        deepspeed = None
    info = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "deepspeed": deepspeed, "device": "cpu (no CUDA)"}
    if plan.cuda:
        props = torch.cuda.get_device_properties(plan.device)
        try:
            driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                    capture_output=True, text=True, timeout=60).stdout.strip()
        except (OSError, subprocess.TimeoutExpired) as exc:
            driver = f"n/a ({exc})"
        info.update(device=props.name, memory=fmt_bytes(props.total_memory), capability=f"{props.major}.{props.minor}",
                    driver=driver)
    info["report"] = [f"{c.verdict} {c.name}: {c.found}" for c in run_checks(nvme_dir)]
    return info


def cuda_tests(plan: Plan) -> dict:
    """1. Every cuda-marked test, in a child pytest."""
    if not plan.cuda:
        return skipped("cuda-marked tests", "no CUDA")
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    # `-o addopts=-ra`: one process (the device machine has no pytest-xdist; the tests share its one GPU)
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-o", "addopts=-ra", "-m", "cuda", "tests/"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=600)
    summary = (done.stdout.strip().splitlines() or [""])[-1]
    result = {f"tests_{word}": int(n) for n, word in re.findall(r"(\d+) (passed|failed|skipped|errors?)", summary)}
    result["status"] = "failed" if done.returncode else "passed"
    if done.returncode:
        result["tail"] = (done.stdout + done.stderr)[-4000:]
    return result


@contextlib.contextmanager
def delayed_copies(device: torch.device):
    """Every host<->device copy held back before it runs: on CUDA a sleep kernel on the copy stream, behind what the
    copy waits for and ahead of it; on CPU a sleep on the copy worker. Yields a list, one entry per delayed copy."""
    held: list[int] = []
    if device.type == "cuda":
        submit = CudaCopyStream.submit

        def slow_submit(stream, dst, src, after=None):
            after = after if after is not None else stream.mark()
            stream.stream.wait_event(after)
            with torch.cuda.stream(stream.stream):
                torch.cuda._sleep(SLEEP_CYCLES)
            held.append(1)
            return submit(stream, dst, src, after)

        patch = mock.patch.object(CudaCopyStream, "submit", slow_submit)
    else:
        run = WorkerCopyStream.run

        def slow_run(dst, src):
            time.sleep(SLEEP_S)
            held.append(1)
            run(dst, src)

        patch = mock.patch.object(WorkerCopyStream, "run", staticmethod(slow_run))
    with patch:
        yield held


def train_engine(config: dict, data: list[torch.Tensor]) -> list[float]:
    engine, *_ = zero.initialize(model=own_gpt(0), config=config)
    try:
        return engine_train(engine, data)
    finally:
        engine.close()


def parity(plan: Plan) -> dict:
    """2. ZeRO-3 against torch.optim.AdamW in memory on the same device; then with every copy delayed."""
    device, data = plan.device, batches(4 if plan.quick or not plan.cuda else 8)
    # The math attention kernel: a deterministic backward, so a delayed run compares bit for bit.
    with sdpa_kernel(SDPBackend.MATH):
        expected = reference_train(own_gpt(0).to(device), [ids.to(device) for ids in data])
        runs = []
        for offload in ("cpu", "nvme"):
            for bf16 in (False, True):
                with tempfile.TemporaryDirectory(dir=plan.nvme_parent) as nvme:
                    config = stage3_config(offload, offload, nvme_path=nvme, bf16=bf16)
                    losses = train_engine(config, data)
                    with delayed_copies(device) as held:
                        delayed = train_engine(config, data)
                rtol = BF16_RTOL if bf16 else FP32_RTOL
                close = all(abs(a - b) <= rtol * abs(b) for a, b in zip(losses, expected))
                runs.append({"run": f"{offload}/{offload} {'bf16' if bf16 else 'fp32'}", "device": str(device),
                             "max_abs_diff": max(abs(a - b) for a, b in zip(losses, expected)), "tolerance": rtol,
                             "bitwise": losses == expected, "delayed_copies": len(held),
                             "delayed_equal": delayed == losses, "passed": close and delayed == losses and held != [],
                             "losses": losses, "reference_losses": expected, "delayed_losses": delayed})
    return {"status": "passed" if all(r["passed"] for r in runs) else "failed", "model": str(OWN_CONFIG), "runs": runs}


def token_batches(count: int, batch: int, seq: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randint(0, VOCAB, (batch, seq + 1), generator=generator) for _ in range(count)]


@contextlib.contextmanager
def streamed_engine(plan: Plan, batch: int, offload: str = "nvme"):
    """ZeRO-3 in bf16, parameters and optimizer state on `offload`, under a device budget of what a block's
    backward needs with the next block prefetched (the root and two blocks gathered, the gradients of the root and
    a block, the reduction's two scratches of the largest unit; 2 bytes each); on nvme also a host budget of half
    its fp32 training state (8 of 16 bytes a parameter)."""
    model = own_gpt(0, None, plan.streamed)
    params = sum(p.numel() for p in model.parameters())
    block = sum(p.numel() for p in model.blocks[0].parameters())
    root = params - len(model.blocks) * block
    device_budget = 2 * (2 * root + 3 * block + 2 * max(root, block))
    budgets = {"device_budget": device_budget} | ({"host_budget": 8 * params} if offload == "nvme" else {})
    with tempfile.TemporaryDirectory(dir=plan.nvme_parent) as nvme:
        config = stage3_config(offload, offload, nvme_path=nvme, bf16=True, micro=batch, zero_tiering=budgets)
        engine, *_ = zero.initialize(model=model, config=config)
        try:
            yield engine
        finally:
            engine.close()


def covered(spans: list[tuple[int, int]]) -> int:
    """The length of the union of `spans`."""
    total, end = 0, None
    for start, stop in sorted(spans):
        if end is None or start > end:
            total, end = total + stop - start, stop
        elif stop > end:
            total, end = total + stop - end, stop
    return total


def profile_step(plan: Plan, out: str) -> dict:
    """3. One streamed step under torch.profiler, after a warm-up step, state on cpu then on nvme: copy/kernel overlap
    and GPU idle time, from the CUDA events clipped to the step (|copies ∩ kernels| = |copies| + |kernels| -
    |copies ∪ kernels|). On nvme the units wait for the disk, so the GPU is mostly idle and a copy has few kernels
    to hide behind; with the state in host memory the forward and backward are what the copies must overlap.
    `gradient_hooks_s`: the host's time in the gradient hooks (AccumulateGrad), where the backward's thread adds
    each part on the host and queued no kernel (session 28: 108 of a 189 ms step, bench/RESULTS.md) until the adds
    moved to a thread of their own (session 29); `adding_s`: that thread's time in the adds (where it is near the
    step, the adder bounds it). `fresh_host_buffers` / `fresh_host_bytes`: the host pool's new buffers in the step,
    each page-locked there (its churn: 1.1-2.1 GB a step at 1b x 4 with a 1 GiB budget on the CPU machine before
    its unpinned pool got an arena, session 30)."""
    if not plan.cuda:
        return skipped("profile of a streamed step (copy/kernel overlap, GPU idle)", "no CUDA")
    runs = [profile_one(plan, offload, out) for offload in ("cpu", "nvme")]
    return {"status": "measured", "model": str(plan.streamed), "tokens": PROFILE_BATCH * plan.streamed.seq_len,
            "runs": runs}


def profile_one(plan: Plan, offload: str, out: str) -> dict:
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile, record_function

    data = token_batches(2, PROFILE_BATCH, plan.streamed.seq_len)
    with streamed_engine(plan, PROFILE_BATCH, offload) as engine:
        engine_train(engine, data[:1])  # warm-up: the trace, the allocator, cuBLAS
        torch.cuda.synchronize()
        adder = engine.gradients.copies  # the gradients' adds' thread (None where the device steps)
        adding = adder.adding_s if adder is not None else 0.0
        pool = engine.swap.pool
        fresh = pool.allocations, pool.fresh_bytes
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            with record_function(STEP):
                engine_train(engine, data[1:])
                torch.cuda.synchronize()
        adding = adder.adding_s - adding if adder is not None else None
        fresh = pool.allocations - fresh[0], pool.fresh_bytes - fresh[1]
    events = prof.profiler.kineto_results.events()
    start, end = next((e.start_ns(), e.end_ns()) for e in events
                      if e.name() == STEP and e.device_type() == DeviceType.CPU)
    gpu = [(e.name(), (max(e.start_ns(), start), min(e.end_ns(), end))) for e in events
           if e.device_type() == DeviceType.CUDA and not e.is_user_annotation()
           and start < e.end_ns() and e.start_ns() < end]
    hooks = [(max(e.start_ns(), start), min(e.end_ns(), end)) for e in events if e.device_type() == DeviceType.CPU
             and e.name() == GRADIENT_HOOKS and start < e.end_ns() and e.start_ns() < end]
    copies = [span for name, span in gpu if name.startswith(("Memcpy HtoD", "Memcpy DtoH"))]
    pageable = sum(1 for name, _ in gpu if name.startswith(("Memcpy HtoD", "Memcpy DtoH")) and "Pageable" in name)
    kernels = [span for name, span in gpu if not name.startswith(("Memcpy", "Memset"))]
    copy_ns, kernel_ns = covered(copies), covered(kernels)
    trace = os.path.join(out, f"gpu_check_trace_{offload}.json")
    prof.export_chrome_trace(trace)
    if os.path.getsize(trace) > 16 << 20:
        os.remove(trace)
        trace = "not kept: over 16 MiB"
    return {"offload": offload, "step_s": (end - start) / 1e9, "copies": len(copies), "pageable_copies": pageable,
            "copy_s": copy_ns / 1e9, "kernels": len(kernels), "kernel_s": kernel_ns / 1e9,
            "gpu_idle": 1 - kernel_ns / (end - start), "trace": trace,
            "copy_overlap": (copy_ns + kernel_ns - covered(copies + kernels)) / copy_ns if copy_ns else None,
            "gradient_hooks_s": covered(hooks) / 1e9, "adding_s": adding, "fresh_host_buffers": fresh[0],
            "fresh_host_bytes": fresh[1]}


def activation_bytes(plan: Plan, data: list[torch.Tensor]) -> int:
    """What the same model keeps on the device between its forward and its backward in plain PyTorch (bf16, in
    memory): the activations, which the device budget leaves to the model ("activations kept there come on top")
    and check 4 allows on top of it. Measured after a first step (cuBLAS's workspace: the baseline's)."""
    model = own_gpt(0, None, plan.streamed).to(plan.device, torch.bfloat16)
    loss_of(model, data[0].to(plan.device), False).backward()
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    start = torch.cuda.memory_allocated()
    loss = loss_of(model, data[0].to(plan.device), False)
    kept = torch.cuda.memory_allocated() - start
    del model, loss
    torch.cuda.empty_cache()
    return kept


def budgets(plan: Plan) -> dict:
    """4. After streamed steps: host bytes (pinned with CUDA) against the host budget, device bytes against the device
    budget (with CUDA: everything torch allocated beyond what was there before, less the activations the same model
    needs in plain PyTorch, which the budget leaves to the model)."""
    data = token_batches(3, 2, 16)
    if plan.cuda:
        activations = activation_bytes(plan, data)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        torch.cuda.reset_peak_host_memory_stats()
        baseline = torch.cuda.memory_allocated()  # what earlier checks left (cuBLAS's workspace): not this engine's
    with streamed_engine(plan, 2) as engine:
        if plan.cuda:
            torch.cuda.reset_peak_memory_stats()  # training's peak: building the model is not the budget's
        engine_train(engine, data)
        pool, tier = engine.swap.pool, engine.swap.device_tier
        result = {"io_engine": engine.swap.store.engine_reason, "host_budget_bytes": pool.budget,
                  "host_pinned": pool.pin, "host_held_bytes": pool.held, "host_peak_in_use_bytes": pool.peak_in_use,
                  "device_budget_bytes": tier.budget, "device_tier_peak_bytes": tier.peak, "skipped": []}
    host, device = result["host_held_bytes"], result["device_tier_peak_bytes"]
    if plan.cuda:
        # Pinned by torch's own host allocator (a .pin_memory() somewhere): host bytes the pool never counted.
        result["torch_pinned_peak_bytes"] = torch.cuda.host_memory_stats().get("allocated_bytes.peak", 0)
        result["cuda_baseline_bytes"] = baseline
        result["cuda_max_allocated_bytes"] = torch.cuda.max_memory_allocated()
        result["activation_bytes"] = activations
        host += result["torch_pinned_peak_bytes"]
        device = max(device, result["cuda_max_allocated_bytes"] - baseline - activations)
    else:
        result["skipped"].append("torch.cuda.max_memory_allocated against the device budget — no CUDA (the device "
                                 "tier's peak, host memory here, stands in)")
    result["host_within_budget"] = host <= result["host_budget_bytes"]
    result["device_within_budget"] = device <= result["device_budget_bytes"]
    result["status"] = "passed" if result["host_within_budget"] and result["device_within_budget"] else "failed"
    return result


def bench_runs(plan: Plan) -> dict:
    """5. bench/train.py, in a process of its own (its children's peak RSS counts their parent's at the fork): each
    system's step, and its ratio to torch's in-memory step and to DeepSpeed's on the same offload device."""
    runs = [("quick", ["--quick"])]
    if plan.cuda and not plan.quick:
        steps = ["--steps", "3", "--warmup", "1"]
        runs = [("124m", ["--preset", "124m", *steps]),
                # unbudgeted, our state stays in host memory while DeepSpeed's nvme rows stream it: force streaming
                ("124m, host budget 1 GiB", ["--preset", "124m", "--systems", "ours-nvme,deepspeed-nvme",
                                             "--host-budget", "1GiB", *steps]),
                ("1b x 4 layers", ["--preset", "1b", "--layers", "4", "--systems", "torch,ours-nvme,deepspeed-nvme",
                                   "--device-budget", "1300MiB", *steps])]
    result: dict = {"status": "measured", "runs": [], "failures": []}
    for label, argv in runs:
        with tempfile.TemporaryDirectory() as scratch:
            path = os.path.join(scratch, "records.json")
            command = [sys.executable, os.path.join(HERE, "train.py"), *argv, "--json", path]
            command += ["--dir", plan.nvme_parent] if plan.nvme_parent else []
            done = subprocess.run(command, cwd=HERE, capture_output=True, text=True)
            records = json.loads(Path(path).read_text()) if done.returncode == 0 else []
        print(done.stdout)
        failed = re.findall(r"^(\S+): failed \(exit", done.stdout, re.M)
        if done.returncode:
            failed.append(f"bench/train.py (exit {done.returncode})")
        if failed:  # DeepSpeed failing is DeepSpeed's business; ours or torch failing fails the check
            result["failures"].append(f"{label}: {', '.join(failed)} failed\n{(done.stdout + done.stderr)[-3000:]}")
            if any(not system.startswith("deepspeed") for system in failed):
                result["status"] = "failed"
        steps = {r["system"]: r["step_s"] for r in records}
        for r in records:
            ds = steps.get("deepspeed-" + r["system"].split("-")[1]) if r["system"].startswith("ours") else None
            disk, kinds = r["disk_bytes"], r["segment_kinds"]
            result["runs"].append({"run": label, "system": r["system"], "params": r["params"], "step_s": r["step_s"],
                                   "vs_torch": r["step_s"] / steps["torch"] if "torch" in steps else None,
                                   "vs_deepspeed": r["step_s"] / ds if ds else None, "tokens_per_s": r["tokens_per_s"],
                                   "peak_device_bytes": r["peak_device_bytes"], "peak_rss_bytes": r["peak_rss_bytes"],
                                   # a step's disk bytes (any system's), and ours by kind: the gradients' nvme trip
                                   "disk_read_bytes": int(disk["read"]), "disk_written_bytes": int(disk["write"]),
                                   "grad_nvme_bytes": int(sum(n for key, n in kinds.items()
                                                              if "nvme" in key and key.endswith(" grad")))})
    return result


def run_check(function, *args) -> dict:
    """A check's record, or its error: one failure does not stop the others."""
    start = time.perf_counter()
    try:
        result = function(*args)
    except Exception as exc:
        result = {"status": "failed", "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
    result["seconds"] = round(time.perf_counter() - start, 1)
    return result


def fmt(key: str, value) -> str:
    if isinstance(value, int) and not isinstance(value, bool) and key.endswith("_bytes"):
        return fmt_bytes(value)
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def markdown(record: dict) -> str:
    """The machine, every skipped line, then each check's figures and tables (lists of numbers: in the JSON)."""
    lines = [f"# GPU check, {record['date']}{' (--quick)' if record['quick'] else ''}: "
             f"{'every check that ran passed' if record['passed'] else 'FAILED'}", "", "## Machine", ""]
    lines += [f"- {k}: {v}" for k, v in record["machine"].items() if k != "report"]
    lines += [f"- zero.report: {line}" for line in record["machine"]["report"]] + ["", "## Skipped", ""]
    lines += [f"- skipped: {line}" for line in record["skipped"]] or ["- nothing"]
    for name, check in record["checks"].items():
        lines += ["", f"## {check['number']}. {name}: {check['status']} ({check['seconds']} s)", ""]
        lines += [f"- {k}: {fmt(k, v)}" for k, v in check.items()
                  if k not in ("status", "seconds", "number") and not isinstance(v, list) and "\n" not in str(v)]
        lines += [f"- skipped: {line}" for line in check.get("skipped", [])]
        for rows in (v for v in check.values() if isinstance(v, list) and v and isinstance(v[0], dict)):
            columns = [k for k, v in rows[0].items() if not isinstance(v, list)]
            lines += ["", "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
            lines += ["| " + " | ".join(fmt(k, row[k]) for k in columns) + " |" for row in rows]
        for text in [v for v in check.values() if isinstance(v, str) and "\n" in v] + check.get("failures", []):
            lines += ["", "```", text.strip()[-4000:], "```"]
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)) + "\n"


def check_numbers(text: str) -> set[int]:
    """--only's value: check numbers 1-5, comma-separated."""
    numbers = {int(n) for n in text.split(",") if n.strip().isdigit()}
    if not numbers or not numbers <= set(range(1, 6)) or len(numbers) != len(text.split(",")):
        raise argparse.ArgumentTypeError(f"{text!r}: check numbers from 1 to 5, comma-separated (e.g. 3,5)")
    return numbers


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small models, bench/train.py --quick (~3 min on a GPU)")
    parser.add_argument("--out", default=os.path.join(HERE, "out"), help="where gpu_check.md, .json and the trace go")
    parser.add_argument("--json", default=None, help="the JSON record here instead of OUT/gpu_check.json")
    parser.add_argument("--dir", default=None, help="where the nvme tier's temporary directories go (an SSD)")
    parser.add_argument("--only", type=check_numbers, default=None, metavar="N,N",
                        help="run these checks only, by number (1-5), e.g. 3,5")
    args = parser.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    plan = Plan(args.quick, args.dir)
    with scratch_dir(parser, args.dir) as probe:
        record = {"date": time.strftime("%Y-%m-%d %H:%M"), "quick": args.quick, "machine": machine(plan, probe)}
    # Tiny models on CPU: one intra-op thread is far faster than several fighting over the cores.
    checks = {"cuda-marked tests": (cuda_tests, plan), "ZeRO-3 parity": (parity, plan),
              "profile of a streamed step": (profile_step, plan, args.out), "budgets": (budgets, plan),
              "bench/train.py": (bench_runs, plan)}
    record["checks"] = {}
    with one_thread() if not plan.cuda else contextlib.nullcontext():
        for number, (name, (function, *check_args)) in enumerate(checks.items(), 1):
            if args.only and number not in args.only:
                continue
            record["checks"][name] = run_check(function, *check_args) | {"number": number}
            report = write_report(record, args)  # after each check: a run cut off keeps what it measured
    print(report)
    return 0 if record["passed"] else 1


def write_report(record: dict, args: argparse.Namespace) -> str:
    """Sum up the checks run so far into `record`, write its JSON and markdown, and return the markdown."""
    record["skipped"] = [line for check in record["checks"].values() for line in check.get("skipped", [])]
    record["skipped"] += [f"libaio engine — {line.split(': ', 1)[1]}" for line in record["machine"]["report"]
                          if line.startswith("WARN libaio")]
    if record["machine"]["deepspeed"] is None:
        record["skipped"].append("bench/train.py's DeepSpeed rows — deepspeed is not installed")
    record["passed"] = all(check["status"] != "failed" for check in record["checks"].values())
    with open(args.json or os.path.join(args.out, "gpu_check.json"), "w") as f:
        json.dump(record, f, indent=1)
    report = markdown(record)
    with open(os.path.join(args.out, "gpu_check.md"), "w") as f:
        f.write(report)
    return report


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
