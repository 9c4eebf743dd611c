"""DeepSpeed's `deepspeed.runtime` paths that scripts import names from: `zero.partition_parameters` and
`zero.offload_config`, `utils` (set_random_seed, see_memory_usage), `dataloader` (RepeatingLoader) and `config`
(DeepSpeedConfig); `data_pipeline` and `domino` hold stand-ins for DeepSpeed features that are not here."""
from . import config, data_pipeline, dataloader, domino, utils, zero

__all__ = ["config", "data_pipeline", "dataloader", "domino", "utils", "zero"]
