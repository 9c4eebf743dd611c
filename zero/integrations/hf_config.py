"""HfZeroConfig: transformers' `HfDeepSpeedConfig` without the deepspeed package. Made (and kept alive) before
`from_pretrained` or `from_config`, a ZeRO-3 config makes transformers build the model under our `zero.Init`:
each module partitioned as it is built, pretrained weights loaded a module at a time through GatheredParameters,
never the whole model in memory.

    dschf = HfZeroConfig("ds_config.json")      # keep a reference: transformers holds only a weak one
    model = AutoModelForCausalLM.from_pretrained(path)
    engine, *_ = zero.initialize(model=model, config="ds_config.json")

It registers itself where transformers looks (`transformers.integrations.deepspeed`'s weak reference), lets the
`import deepspeed` transformers does there resolve to `zero` (deepspeed_alias.py), and joins a process group of one
where no launcher made one (transformers' ZeRO-3 loading asks torch.distributed for the rank); its
`resize_token_embeddings` keeps the rows it adds (hf_resize.py), and a tied pair the checkpoint holds both of is
compared by value (hf_tied.py).
"""
from __future__ import annotations

import copy
import os
from collections.abc import Mapping
from typing import Any

from ..comm import DataParallel, init_distributed
from ..config import load_config, read_json
from . import deepspeed_alias, hf_resize, hf_tied


class HfZeroConfig:
    def __init__(self, config_file_or_dict: str | os.PathLike | Mapping):
        if isinstance(config_file_or_dict, Mapping):
            config = copy.deepcopy(dict(config_file_or_dict))
        else:
            config = read_json(config_file_or_dict)
        self.config = config
        """The DeepSpeed-format dict, as transformers' `deepspeed_config()` returns it to `zero.Init`."""
        validated = load_config(config, world_size=DataParallel.world_size_to_join())  # bad keys are named now
        self._stage = validated.zero_optimization.stage
        from transformers.integrations import deepspeed as hf_deepspeed

        deepspeed_alias.install()
        if self.is_zero3():
            init_distributed()
            hf_resize.install()
            hf_tied.install()
        hf_deepspeed.set_hf_deepspeed_config(self)

    def is_zero3(self) -> bool:
        return self._stage == 3

    def is_zero2(self) -> bool:
        return self._stage == 2

    def is_offload(self) -> bool:
        zo = self.config.get("zero_optimization", {})
        return any(zo.get(section, {}).get("device", "none") in ("cpu", "nvme")
                   for section in ("offload_param", "offload_optimizer"))

    def get_value(self, ds_key_long: str, default: Any = None) -> Any:
        """A value by its dotted key ("zero_optimization.stage"), or `default` where the config lacks it."""
        node: Any = self.config
        for key in ds_key_long.split("."):
            if not isinstance(node, Mapping) or key not in node:
                return default
            node = node[key]
        return node

    def is_true(self, ds_key_long: str) -> bool:
        return self.get_value(ds_key_long) is True

    def is_false(self, ds_key_long: str) -> bool:
        return self.get_value(ds_key_long) is False
