"""DeepSpeed's `deepspeed.utils`, for scripts that import from it: the accessors of one parameter's whole training
state (`safe_get_full_*`, `safe_set_full_*`: tensor_fragment.py), the `logger` and `log_dist` (logging.py), ZeRO-3
leaf modules (z3_leaf_module.py) and `RepeatingLoader` (runtime/dataloader.py, where DeepSpeed has it too)."""
from ..runtime.dataloader import RepeatingLoader
from .logging import log_dist, logger
from .tensor_fragment import (safe_get_full_fp32_param, safe_get_full_grad, safe_get_full_optimizer_state,
                              safe_set_full_fp32_param, safe_set_full_grad, safe_set_full_optimizer_state)
from .z3_leaf_module import (get_z3_leaf_modules, set_z3_leaf_module, set_z3_leaf_modules,
                             set_z3_leaf_modules_by_name, set_z3_leaf_modules_by_suffix, unset_z3_leaf_modules,
                             z3_leaf_module, z3_leaf_parameter)

__all__ = ["RepeatingLoader", "get_z3_leaf_modules", "log_dist", "logger", "safe_get_full_fp32_param",
           "safe_get_full_grad", "safe_get_full_optimizer_state", "safe_set_full_fp32_param", "safe_set_full_grad",
           "safe_set_full_optimizer_state", "set_z3_leaf_module", "set_z3_leaf_modules", "set_z3_leaf_modules_by_name",
           "set_z3_leaf_modules_by_suffix", "unset_z3_leaf_modules", "z3_leaf_module", "z3_leaf_parameter"]
