"""Checkpoints of a ZeroEngine: `save.py` writes them, `load.py` reads them back, `format.py` is the layout on
disk (shared with zero/export/), `layout.py` what besides state tensors is recorded, `ranks.py` how ranks
agree. They read the engine through its public face only: `counters`, `units`, `state_tensors()`,
`unapplied_gradients()`, `state_loaded()` and the objects it was built with (module, optimizer, scheduler,
loss scaler, data-parallel group). `sixteen_bit.py` is DeepSpeed's save_16bit_model: the weights alone, in the
compute dtype (it also finishes a step still running, as every save does)."""
from .load import load_checkpoint
from .save import save_checkpoint

__all__ = ["load_checkpoint", "save_checkpoint"]
