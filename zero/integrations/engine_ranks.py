"""What DeepSpeedEngine says of the ranks it trains on (`engine.global_rank`, `world_size`, `dp_world_size`,
`data_parallel_group`, ...), which scripts read to log on one rank or to shard their own data. DeepSpeed sets them
as attributes in its constructor; here they are read from the engine's data-parallel group. There is no model,
sequence or pipeline parallelism, so those sizes are 1."""
from __future__ import annotations

import os
from typing import Any

import torch.distributed as dist

from ..comm import DataParallel


class EngineRanks:
    dp: DataParallel
    training_dataloader: Any = None
    """The loader `initialize(training_data=...)` returned (DeepSpeed keeps it on the engine too), or None."""
    mpu = None
    """DeepSpeed's model-parallel unit: None, as DeepSpeed has it when a script passes none."""

    @property
    def local_rank(self) -> int:
        """This process's place among the ranks of its node (LOCAL_RANK, as the launcher sets it; 0 without one)."""
        return int(os.environ.get("LOCAL_RANK", "0"))

    @property
    def global_rank(self) -> int:
        return self.dp.rank

    @property
    def world_size(self) -> int:
        return self.dp.world_size

    @property
    def dp_world_size(self) -> int:
        return self.dp.world_size

    @property
    def seq_dp_world_size(self) -> int:
        return self.dp.world_size

    @property
    def mp_world_size(self) -> int:
        return 1

    @property
    def sequence_parallel_size(self) -> int:
        return 1

    @property
    def data_parallel_group(self) -> dist.ProcessGroup | None:
        """The group the gradients are reduced over: the one `initialize` was given or joined (the default group);
        None on one rank without a process group (zero joins none there, where DeepSpeed always initializes one)."""
        if self.dp.group is not None:
            return self.dp.group
        return dist.group.WORLD if self.dp.active else None

    @property
    def seq_data_parallel_group(self) -> dist.ProcessGroup | None:
        return self.data_parallel_group
