"""Per-step loss recorder for the DeepSpeedExamples scripts, with no line of a script changed.

Python imports `sitecustomize` at start-up from sys.path; put this directory on PYTHONPATH. When ZT_LOSS_LOG is set,
the first import of a module named `deepspeed` (the real package) or `zero` (ours: `import zero as deepspeed`, or the
`deepspeed` alias `python -m zero.launch` installs, which reads `zero`'s names) gets its `initialize` wrapped: the
engine it returns records `loss.item()` at every `engine.backward(loss)`, one line per call (float repr), in
`<ZT_LOSS_LOG>.rank<R>` (R: this process's rank). With ZT_RECORD=logits (a script that only runs the model, as
ZeRO-Inference's), each forward of the engine's module records its logits' norm (in float64) instead. Without
ZT_LOSS_LOG this file does nothing.
"""
import os
import sys

LOG = os.environ.get("ZT_LOSS_LOG")
WHAT = os.environ.get("ZT_RECORD", "loss")
NAMES = ("deepspeed", "zero")


def _rank() -> int:
    try:
        import torch.distributed as dist
        if dist.is_available() and dist.is_initialized():
            return dist.get_rank()
    except ImportError:
        pass
    return int(os.environ.get("RANK", "0"))


def _write(value: float) -> None:
    with open(f"{LOG}.rank{_rank()}", "a") as f:
        f.write(f"{value!r}\n")


def _record(engine) -> None:
    if WHAT == "logits":
        engine.module.register_forward_hook(lambda module, args, out: _write(out.logits.double().norm().item()))
        return
    backward = engine.backward

    def recording_backward(loss, *args, **kwargs):
        _write(loss.item())
        return backward(loss, *args, **kwargs)

    engine.backward = recording_backward


def _wrap(initialize):
    if getattr(initialize, "_zt_recording", False):  # `deepspeed` as a view of an already wrapped `zero`
        return initialize

    def recording_initialize(*args, **kwargs):
        result = initialize(*args, **kwargs)
        _record(result[0])
        return result

    recording_initialize._zt_recording = True
    recording_initialize.__wrapped__ = initialize
    recording_initialize.__doc__ = initialize.__doc__
    return recording_initialize


class _Finder:
    """First on sys.meta_path: finds `deepspeed`/`zero` with the finders after it, and patches the module once its
    code has run."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in NAMES:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is None:
                continue
            if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                exec_module = spec.loader.exec_module

                def exec_and_patch(module, exec_module=exec_module):
                    exec_module(module)
                    if hasattr(module, "initialize"):
                        module.initialize = _wrap(module.initialize)

                spec.loader.exec_module = exec_and_patch
            return spec
        return None


if LOG:
    sys.meta_path.insert(0, _Finder())
