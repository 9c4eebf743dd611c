"""CPU-Adam against torch.optim.AdamW / Adam: elementwise parity over 100 steps for every combination of the
options, the copy-out equal to the fp32 param cast, rejection of what we do not implement, state_dict round
trips both ways with torch, property tests over sizes down to 0 and 1, and bench/adam.py --quick end to end.
No speed thresholds: the machine is shared and noisy.

"Within 1e-6 relative" is measured against each tensor's scale (the largest magnitude of the reference):
torch's fused kernel and its per-op path round differently by an ulp here and there, and an ulp of a value
near 1 is a large relative error for an element that happens to sit near 0.
"""
from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import threading

import pytest
import torch
from conftest import REPO_ROOT, child_env
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from zero.optim import adam_math
from zero.optim import compact_step as compact_step_module
from zero.optim.adam_math import AdamInputError, AdamThreads, adam_step
from zero.optim.cpu_adam import CPUAdam, UnsupportedOptionError

SMALL_BLOCK = 1000
"""Block size the parity tests run under (monkeypatched), so a few thousand elements cross several blocks."""
SIZES = (1, 999, 3001)
"""One element; less than one small block; several blocks with a ragged tail."""
STEPS = 100
LR = 1e-2


def assert_rel(actual: torch.Tensor, expected: torch.Tensor, rel: float = 1e-6) -> None:
    scale = expected.abs().max().item() if expected.numel() else 0.0
    torch.testing.assert_close(actual, expected, rtol=rel, atol=rel * scale)


def make_pair(sizes, seed=0):
    """The same initial params twice: ours, and torch's reference."""
    gen = torch.Generator().manual_seed(seed)
    ours = [torch.nn.Parameter(torch.randn(n, generator=gen)) for n in sizes]
    ref = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    return ours, ref


@pytest.fixture
def small_blocks(monkeypatch):
    """Small blocks, and one intra-op thread for the torch reference: a few thousand elements gain nothing
    from a second thread, and on a busy machine each of torch's forks can wait milliseconds for a core.
    (The tests using it step ours on one thread too; our threads are tested against this path below.)"""
    monkeypatch.setattr(adam_math, "BLOCK", SMALL_BLOCK)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("out_dtype", [None, torch.bfloat16, torch.float16], ids=["no-out", "bf16", "fp16"])
@pytest.mark.parametrize("grad_scale", [1.0, 0.37])
@pytest.mark.parametrize("eps", [1e-8, 1e-6])
@pytest.mark.parametrize("betas", [(0.9, 0.999), (0.8, 0.95)], ids=["b0.9-0.999", "b0.8-0.95"])
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
@pytest.mark.parametrize("adamw_mode", [True, False], ids=["adamw", "adam"])
def test_parity_with_torch(small_blocks, adamw_mode, weight_decay, betas, eps, grad_scale, out_dtype):
    ours, ref = make_pair(SIZES)
    hyper = dict(lr=LR, betas=betas, eps=eps, weight_decay=weight_decay)
    opt = CPUAdam(ours, adamw_mode=adamw_mode, threads=1, **hyper)
    torch_opt = (torch.optim.AdamW if adamw_mode else torch.optim.Adam)(ref, **hyper)
    outs = [torch.empty(p.shape, dtype=out_dtype) for p in ours] if out_dtype else []
    for p, out in zip(ours, outs):
        opt.set_output(p, out)
    gen = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        for p, r in zip(ours, ref):
            grad = torch.randn(p.shape, generator=gen)
            p.grad = grad.clone()
            r.grad = grad * grad_scale
        opt.step(grad_scale=grad_scale)
        torch_opt.step()
    for p, r in zip(ours, ref):
        assert_rel(p.detach(), r.detach())
        for key in ("exp_avg", "exp_avg_sq"):
            assert_rel(opt.state[p][key], torch_opt.state[r][key])
        assert opt.state[p]["step"].item() == torch_opt.state[r]["step"].item() == STEPS
    for p, out in zip(ours, outs):
        assert torch.equal(out, p.detach().to(out_dtype))


def test_parity_beyond_one_real_block():
    """At the real block size: a tensor of more than one block, copy-out and grad scale on."""
    numel = adam_math.BLOCK + 17
    ours, ref = make_pair([numel])
    opt = CPUAdam(ours, lr=LR, weight_decay=0.1)
    torch_opt = torch.optim.AdamW(ref, lr=LR, weight_decay=0.1)
    out = torch.empty(numel, dtype=torch.bfloat16)
    opt.set_output(ours[0], out)
    gen = torch.Generator().manual_seed(1)
    for _ in range(5):
        grad = torch.randn(numel, generator=gen)
        ours[0].grad, ref[0].grad = grad.clone(), grad * 0.37
        opt.step(grad_scale=0.37)
        torch_opt.step()
    assert_rel(ours[0].detach(), ref[0].detach())
    assert torch.equal(out, ours[0].detach().to(torch.bfloat16))


@pytest.mark.parametrize("adamw_mode", [True, False], ids=["adamw", "adam"])
def test_unscaled_step_matches_torch_fused_bitwise(adamw_mode):
    """With grad_scale 1.0 and weight decay, a step is bit for bit torch's fused kernel's, and the gradient
    is only read."""
    ours, ref = make_pair([3001])
    opt = CPUAdam(ours, lr=LR, weight_decay=0.1, adamw_mode=adamw_mode)
    torch_opt = (torch.optim.AdamW if adamw_mode else torch.optim.Adam)(ref, lr=LR, weight_decay=0.1, fused=True)
    gen = torch.Generator().manual_seed(1)
    for _ in range(10):
        grad = torch.randn(3001, generator=gen)
        ours[0].grad, ref[0].grad = grad.clone(), grad.clone()
        opt.step()
        torch_opt.step()
        assert torch.equal(ours[0].grad, grad)
    assert torch.equal(ours[0].detach(), ref[0].detach())
    assert torch.equal(opt.state[ours[0]]["exp_avg_sq"], torch_opt.state[ref[0]]["exp_avg_sq"])


def test_param_groups_step_with_their_own_hyperparameters():
    ours, ref = make_pair([100, 200, 300])
    groups = lambda ps: [{"params": ps[:2], "lr": 1e-2}, {"params": ps[2:], "weight_decay": 0.0, "betas": (0.8, 0.9)}]
    opt = CPUAdam(groups(ours), lr=1e-3, weight_decay=0.1)
    torch_opt = torch.optim.AdamW(groups(ref), lr=1e-3, weight_decay=0.1)
    for _ in range(10):
        for p, r in zip(ours, ref):
            p.grad = torch.randn(p.shape)
            r.grad = p.grad.clone()
        opt.step()
        torch_opt.step()
    for p, r in zip(ours, ref):
        assert_rel(p.detach(), r.detach())


def test_closure_and_params_without_grad():
    ours, _ = make_pair([10, 10])
    opt = CPUAdam(ours)
    before = ours[1].detach().clone()

    def closure():
        opt.zero_grad()
        loss = (ours[0] ** 2).sum()
        loss.backward()
        return loss

    assert opt.step(closure).item() > 0
    assert torch.equal(ours[1].detach(), before) and ours[1] not in opt.state
    assert opt.state[ours[0]]["step"].item() == 1


@pytest.mark.parametrize("copy_out", [True, False], ids=["copy-out", "no-copy-out"])
def test_threads_path_equals_the_calling_thread_path(copy_out):
    """Our threads (blocks, each updated and copied out in one pass) give what one call of torch's fused
    kernel over the whole tensor in the calling thread, then a copy, gives, bit for bit."""
    numel = 2 * adam_math.BLOCK + 1001
    gen = torch.Generator().manual_seed(0)
    tensors = [torch.randn(numel, generator=gen), torch.randn(numel, generator=gen), torch.zeros(numel),
               torch.zeros(numel)]
    twin = [t.clone() for t in tensors]
    outs = [torch.empty(numel, dtype=torch.bfloat16) for _ in range(2)]
    hyper = dict(step=3, lr=LR, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, grad_scale=0.5)
    with AdamThreads(2) as threads:
        adam_step(*tensors, **hyper, out=outs[0] if copy_out else None, threads=threads)
    adam_step(*twin, **hyper, out=outs[1] if copy_out else None)
    for a, b in zip(tensors, twin):
        assert torch.equal(a, b)
    assert not copy_out or torch.equal(outs[0], outs[1])


def test_adam_threads_change_nothing_for_other_threads():
    before = torch.get_num_threads()
    with AdamThreads(3) as threads:
        assert threads.count == 3
        if "OpenMP" in torch.__config__.parallel_info():
            assert threads.serial_ops
        inside = []
        threads.run([lambda: inside.append(torch.get_num_threads())] * 50)
        if threads.serial_ops:
            assert inside == [1] * 50, "our threads, the caller included, run torch ops on themselves alone"
        seen = []
        fresh = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
        fresh.start()
        fresh.join()
        assert seen == [before] and torch.get_num_threads() == before


def test_adam_threads_run_every_block_once_and_raise_errors():
    with AdamThreads(2) as threads:
        done = []
        threads.run([lambda i=i: done.append(i) for i in range(1000)])
        assert sorted(done) == list(range(1000))

        def fail(i):
            done.append(i)
            if i == 7:
                raise RuntimeError("block 7")

        done.clear()
        with pytest.raises(RuntimeError, match="block 7"):
            threads.run([lambda i=i: fail(i) for i in range(20)])
        assert sorted(done) == list(range(20)), "the other thread finishes the work"
        threads.run([])
    with pytest.raises(AdamInputError, match="count = 0"):
        AdamThreads(0)


def test_optimizer_threads_setting_matches_default():
    numel = adam_math.BLOCK + 3
    ours, ref = make_pair([numel])
    one, default = CPUAdam(ours, threads=1), CPUAdam(ref)
    for _ in range(3):
        ours[0].grad = torch.randn(numel)
        ref[0].grad = ours[0].grad.clone()
        one.step()
        default.step()
    assert torch.equal(ours[0], ref[0])
    assert one._workers.count == 1 and default._workers.count == torch.get_num_threads()


def test_optimizer_survives_deepcopy():
    params, _ = make_pair([10])
    opt = CPUAdam(params, threads=1)
    run_steps(opt, params, 1, seed=0)
    clone = copy.deepcopy(opt)
    run_steps(clone, clone.param_groups[0]["params"], 1, seed=0)
    assert clone.state[clone.param_groups[0]["params"][0]]["step"].item() == 2


# --- what we do not implement: errors that name it -------------------------------------------------------

@pytest.mark.parametrize("option,value", [
    ("amsgrad", True), ("maximize", True), ("capturable", True), ("differentiable", True),
    ("foreach", True), ("foreach", False), ("fused", True),
])
def test_unsupported_options_raise_naming_the_option(option, value):
    with pytest.raises(UnsupportedOptionError, match=f"{option}={value}"):
        CPUAdam([torch.nn.Parameter(torch.zeros(3))], **{option: value})


def test_unsupported_option_in_a_param_group_raises():
    p, q = torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(3))
    opt = CPUAdam([p])
    with pytest.raises(UnsupportedOptionError, match="amsgrad=True"):
        opt.add_param_group({"params": [q], "amsgrad": True})
    assert len(opt.param_groups) == 1


def test_unknown_keyword_is_a_type_error():
    with pytest.raises(TypeError, match="'bogus'"):
        CPUAdam([torch.nn.Parameter(torch.zeros(3))], bogus=1)


@pytest.mark.parametrize("kwargs,match", [
    ({"lr": -1.0}, "lr = -1.0"), ({"betas": (1.0, 0.999)}, "beta1 = 1.0"), ({"betas": (0.9, -0.1)}, "beta2"),
    ({"eps": float("nan")}, "eps = nan"), ({"weight_decay": -0.1}, "weight_decay"), ({"threads": 0}, "threads = 0"),
    ({"lr": torch.tensor(1e-3)}, "lr = tensor"),
])
def test_bad_hyperparameters_raise_with_the_value(kwargs, match):
    with pytest.raises(AdamInputError, match=match):
        CPUAdam([torch.nn.Parameter(torch.zeros(3))], **kwargs)


@pytest.mark.parametrize("param", [torch.zeros(3, dtype=torch.float64), torch.zeros(3, dtype=torch.bfloat16)],
                         ids=["fp64", "bf16"])
def test_non_fp32_params_are_rejected(param):
    with pytest.raises(ValueError, match=str(param.dtype)):
        CPUAdam([torch.nn.Parameter(param)])


def test_sparse_gradient_is_rejected():
    p = torch.nn.Parameter(torch.zeros(4))
    p.grad = torch.zeros(4).to_sparse()
    with pytest.raises(ValueError, match="sparse"):
        CPUAdam([p]).step()


def test_a_rejected_step_changes_nothing():
    params, _ = make_pair([10, 10])
    opt = CPUAdam(params)
    before = [p.detach().clone() for p in params]
    params[0].grad = torch.ones(10)
    params[1].grad = torch.ones(20)[::2]  # torch allows a strided gradient; we read flat memory
    with pytest.raises(AdamInputError, match="grad .* not a contiguous"):
        opt.step()
    assert all(opt.state[p]["step"].item() == 0 for p in params)
    assert all(torch.equal(p, b) for p, b in zip(params, before))


def test_set_output_checks():
    p = torch.nn.Parameter(torch.zeros(8))
    opt = CPUAdam([p])
    with pytest.raises(ValueError, match="not in this optimizer"):
        opt.set_output(torch.nn.Parameter(torch.zeros(8)), torch.zeros(8, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="7 elements, the param 8"):
        opt.set_output(p, torch.zeros(7, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="torch.float32"):
        opt.set_output(p, torch.zeros(8))
    out = torch.zeros(2, 4, dtype=torch.float16)  # any shape of the right element count
    opt.set_output(p, out)
    p.grad = torch.ones(8)
    opt.step()
    assert torch.equal(out.view(-1), p.detach().half())
    opt.set_output(p, None)
    opt.step()
    assert not torch.equal(out.view(-1), p.detach().half())


def flat(n=16):
    return [torch.zeros(n) for _ in range(4)]


HYPER = dict(step=1, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8)


@pytest.mark.parametrize("tensors,kwargs,match", [
    ([torch.zeros(16, dtype=torch.float64)] + flat()[1:], {}, "param is torch.float64"),
    (flat()[:3] + [torch.zeros(15)], {}, "exp_avg_sq has 15 elements, param has 16"),
    (flat()[:1] + [torch.zeros(32)[::2]] + flat()[2:], {}, "grad .* not a contiguous"),
    (flat(), {"out": torch.zeros(16)}, "out is torch.float32"),
    (flat(), {"out": torch.zeros(8, dtype=torch.bfloat16)}, "out has 8 elements"),
    (flat(), {"step": 0}, "step = 0"),
    (flat(), {"grad_scale": 0.0}, "grad_scale = 0.0"),
    (flat(), {"grad_scale": float("inf")}, "grad_scale = inf"),
    (flat(), {"grad_scale": 1e-39}, "grad_scale = 1e-39"),
])
def test_adam_step_input_errors(tensors, kwargs, match):
    with pytest.raises(AdamInputError, match=match):
        adam_step(*tensors, **{**HYPER, **kwargs})


def test_adam_step_has_no_amsgrad():
    with pytest.raises(TypeError, match="amsgrad"):
        adam_step(*flat(), **HYPER, amsgrad=True)


# --- state_dict: torch's layout, both ways ----------------------------------------------------------------

def run_steps(opt, params, n, seed):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(n):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()


@pytest.mark.parametrize("adamw_mode", [True, False], ids=["adamw", "adam"])
@pytest.mark.parametrize("direction", ["torch-to-ours", "ours-to-torch"])
def test_state_dict_moves_between_torch_and_ours(direction, adamw_mode):
    torch_cls = torch.optim.AdamW if adamw_mode else torch.optim.Adam
    hyper = dict(lr=LR, betas=(0.8, 0.95), eps=1e-7, weight_decay=0.1)
    make_ours = lambda ps: CPUAdam(ps, adamw_mode=adamw_mode, **hyper)
    make_torch = lambda ps: torch_cls(ps, **hyper)
    make_first, make_second = (make_torch, make_ours) if direction == "torch-to-ours" else (make_ours, make_torch)
    first_params, _ = make_pair([50, 1200])
    first = make_first(first_params)
    run_steps(first, first_params, 5, seed=1)
    saved = copy.deepcopy(first.state_dict())
    second_params = [torch.nn.Parameter(p.detach().clone()) for p in first_params]
    # built with other hyperparameters: the loaded groups must replace them
    second = (CPUAdam(second_params, lr=1.0, adamw_mode=not adamw_mode) if direction == "torch-to-ours"
              else torch_cls(second_params, lr=1.0))
    second.load_state_dict(saved)
    run_steps(first, first_params, 5, seed=2)
    run_steps(second, second_params, 5, seed=2)
    for p, q in zip(first_params, second_params):
        assert_rel(q.detach(), p.detach())
        assert second.state[q]["step"].item() == 10
        assert second.state[q]["step"].dtype == torch.float32
    assert second.param_groups[0]["decoupled_weight_decay"] is adamw_mode


def test_state_dict_layout_is_torchs():
    p = torch.nn.Parameter(torch.randn(10))
    opt = CPUAdam([p])
    p.grad = torch.randn(10)
    opt.step()
    state = opt.state_dict()["state"][0]
    assert set(state) == {"step", "exp_avg", "exp_avg_sq"}
    assert state["step"].dtype == torch.float32 and state["step"].dim() == 0
    torch_keys = set(torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))]).state_dict()["param_groups"][0])
    assert set(opt.state_dict()["param_groups"][0]) == torch_keys


def test_loading_a_torch_state_with_amsgrad_raises():
    params, _ = make_pair([10])
    torch_opt = torch.optim.AdamW(params, amsgrad=True)
    run_steps(torch_opt, params, 1, seed=0)
    with pytest.raises(UnsupportedOptionError, match="amsgrad=True"):
        CPUAdam(params).load_state_dict(torch_opt.state_dict())


def test_loading_a_fused_torch_state_keeps_its_choice_for_the_way_back():
    params, _ = make_pair([10])
    torch_opt = torch.optim.AdamW(params, fused=True)
    run_steps(torch_opt, params, 2, seed=0)
    opt = CPUAdam(params)
    opt.load_state_dict(torch_opt.state_dict())
    run_steps(opt, params, 1, seed=1)
    assert opt.state_dict()["param_groups"][0]["fused"] is True


# --- properties over sizes, down to 0 and 1 element -------------------------------------------------------

# small_blocks only sets things every example wants the same: it need not be reset between examples.
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    numel=st.integers(0, 5000),
    steps=st.integers(1, 4),
    adamw_mode=st.booleans(),
    weight_decay=st.sampled_from([0.0, 0.05]),
    grad_scale=st.sampled_from([1.0, 0.25, 3.0]),
    out_dtype=st.sampled_from([None, torch.bfloat16, torch.float16]),
    threads=st.sampled_from([None, 1, 2]),  # 2: blocks on a helper too (with out)
)
@example(numel=0, steps=1, adamw_mode=True, weight_decay=0.05, grad_scale=0.25, out_dtype=torch.bfloat16,
         threads=2)
@example(numel=1, steps=2, adamw_mode=False, weight_decay=0.05, grad_scale=3.0, out_dtype=torch.float16,
         threads=None)
def test_adam_step_matches_torch_for_any_size(small_blocks, numel, steps, adamw_mode, weight_decay, grad_scale,
                                              out_dtype, threads):
    gen = torch.Generator().manual_seed(numel)
    param = torch.randn(numel, generator=gen)
    ref = torch.nn.Parameter(param.clone())
    exp_avg, exp_avg_sq = torch.zeros(numel), torch.zeros(numel)
    out = torch.empty(numel, dtype=out_dtype) if out_dtype else None
    torch_opt = (torch.optim.AdamW if adamw_mode else torch.optim.Adam)([ref], lr=LR, weight_decay=weight_decay)
    workers = AdamThreads(threads) if threads else None
    for step in range(1, steps + 1):
        grad = torch.randn(numel, generator=gen)
        ref.grad = grad * grad_scale
        adam_step(param, grad, exp_avg, exp_avg_sq, step=step, lr=LR, beta1=0.9, beta2=0.999, eps=1e-8,
                  weight_decay=weight_decay, decoupled=adamw_mode, grad_scale=grad_scale, out=out,
                  threads=workers)
        torch_opt.step()
    if workers:
        workers.close()
    assert_rel(param, ref.detach())
    if out is not None:
        assert torch.equal(out, param.to(out_dtype))


@settings(max_examples=25, deadline=None)
@given(sizes=st.lists(st.integers(0, 3000), min_size=1, max_size=3), steps=st.integers(1, 3))
@example(sizes=[0, 1], steps=2)
def test_state_dict_round_trip_resumes_identically(sizes, steps):
    a_params, _ = make_pair(sizes)
    a = CPUAdam(a_params, lr=LR)
    run_steps(a, a_params, steps, seed=3)
    b_params = [torch.nn.Parameter(p.detach().clone()) for p in a_params]
    b = CPUAdam(b_params, lr=0.5)
    b.load_state_dict(copy.deepcopy(a.state_dict()))
    run_steps(a, a_params, 2, seed=4)
    run_steps(b, b_params, 2, seed=4)
    for p, q in zip(a_params, b_params):
        assert torch.equal(p, q)
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(a.state[p][key], b.state[q][key])


# --- the benchmark script runs --------------------------------------------------------------------------

def test_bench_quick_writes_the_agreed_records(tmp_path):
    json_path = tmp_path / "adam.json"
    done = subprocess.run(
        [sys.executable, os.path.join(REPO_ROOT, "bench", "adam.py"), "--quick", "--json", str(json_path)],
        capture_output=True, text=True, timeout=300, env=child_env(),
    )
    assert done.returncode == 0, done.stderr
    assert "| ours / best torch |" in done.stdout, done.stdout
    with open(json_path) as f:
        records = json.load(f)
    impls = {r["impl"] for r in records}
    assert {"ours", "torch-fused", "torch-foreach"} <= impls <= {"ours", "torch-fused", "torch-foreach", "deepspeed"}
    sizes, threads = {r["params"] for r in records}, {r["threads"] for r in records}
    assert len(records) == len(impls) * len(sizes) * len(threads) * 2
    for r in records:
        assert set(r) == {"impl", "params", "threads", "copy_out", "params_per_s"}, r
        assert isinstance(r["params"], int) and isinstance(r["threads"], int) and isinstance(r["copy_out"], bool)
        assert isinstance(r["params_per_s"], float) and r["params_per_s"] > 0
    assert {r["copy_out"] for r in records} == {False, True} and threads == {1, 2}


@pytest.mark.skipif(not compact_step_module.int8_paths(), reason="the C kernel is not built")
def test_bench_measures_int8_paths_side_by_side_each_named(tmp_path):
    """`ours-int8@PATH` runs the int8 codecs that way; plain `ours-int8` is recorded under the path it ran."""
    json_path = tmp_path / "adam.json"
    done = subprocess.run(
        [sys.executable, os.path.join(REPO_ROOT, "bench", "adam.py"), "--sizes", "50K", "--threads", "1", "--steps",
         "1", "--impls", "ours,torch-fused,torch-foreach,ours-int8,ours-int8@scalar", "--json", str(json_path)],
        capture_output=True, text=True, timeout=300, env=child_env(),
    )
    assert done.returncode == 0, done.stderr
    impls = {r["impl"] for r in json.loads(json_path.read_text())}
    int8 = {impl.split("@")[1] for impl in impls if impl.startswith("ours-int8")}
    # the bench's process chose its path at import (timing gathers against loads): one of this CPU's
    assert impls - {f"ours-int8@{path}" for path in int8} == {"ours", "torch-fused", "torch-foreach"}, impls
    assert "scalar" in int8 and int8 <= set(compact_step_module.int8_paths()) and len(int8) <= 2, impls
    assert "ours-int8@scalar (moments int8, one pass) / ours (exact)" in done.stdout, done.stdout
