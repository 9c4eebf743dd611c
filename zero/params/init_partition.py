"""`zero.Init` (DeepSpeed's `deepspeed.zero.Init`): modules built inside it are partitioned as they are built, so
a model larger than host memory never exists whole.

Inside the block every parameter registered on a module is partitioned once its module's construction is over:
when the module is assigned to its parent (its `__init__` has returned by then), or at the block's end for the
top-level model and modules never assigned. Partitioning a parameter sends rank 0's values to every rank (as
DeepSpeed does), keeps this rank's 1/world slice in an InitStore (host memory, or a file on nvme), and leaves the
parameter on the meta device with DeepSpeed's attributes (`ds_shape`, ...), its `device` saying the local one as
DeepSpeed's does (PartitionedParameter). `initialize` fills a unit's meta
parameters from their slices as it builds the unit (the same route as a model built on meta): one unit whole at a
time. Inside `GatheredParameters` a partitioned parameter holds its full values; what the modifier rank writes
there is partitioned again on exit.

As under DeepSpeed, a module's constructor that changes a child's parameters after building the child changes
nothing: the child is partitioned by then. Hugging Face models are the exception made (transformers does it for
DeepSpeed): their `post_init` weight initialization ran on meta parameters, so it runs again when the model's
construction is over (when it is assigned to its parent, or at the block's end), each module's parameters
gathered while its `_init_weights` runs: the same draws at the same point of the construction as outside
zero.Init, so the same weights. Not where transformers has switched initialization off (`from_pretrained` loads
the weights next, and initializes only the keys the checkpoint lacks): nothing is drawn there, as outside zero.Init.
"""
from __future__ import annotations

import contextlib
import ctypes
import os
import sys
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch
from torch import nn
from torch.nn.modules import module as module_hooks

from tiering import NvmeStoreConfig, SwapConfig, SwapManager

from ..comm import DataParallel, local_device
from ..config import ConfigError, load_config
from ..integrations.unsupported import UnsupportedFeatureError
from .ds_param import OWNER, ZeroParamStatus, mark, owner_of, set_status
from .gathered import GatheredParameters
from .materialize import host_empty, swap_keeping_attributes

CHUNK_BYTES = 32 << 20
"""A slice staged on nvme is written and read in segments of at most this many bytes (the staging store's host
budget holds two)."""
TRIM_BYTES = 64 << 20
"""Parameter bytes freed between two `malloc_trim` calls."""


def _malloc_trim() -> Callable[[], None]:
    """glibc's malloc_trim(0), or nothing elsewhere. The weights a module's constructor allocates come from malloc,
    and freed among smaller live allocations they stay in the process: building 8 blocks of 32 MiB under zero.Init
    kept RSS 190 MiB above where a trim brings it."""
    try:
        trim = ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return lambda: None
    return lambda: trim(0)


class InitStore:
    """This rank's slices of the parameters zero.Init partitioned, until `initialize` takes them: in host memory,
    or on nvme through a swap manager of its own, its file removed once `initialize` has taken the last slice, or
    when the store is collected (parameters replaced before `initialize`, a resized embedding's old weight, keep
    it alive until they go)."""

    def __init__(self, dp: DataParallel, nvme: NvmeStoreConfig | None):
        self.dp = dp
        self.swap = None if nvme is None else SwapManager(SwapConfig(host_budget=2 * CHUNK_BYTES, nvme=nvme,
                                                                     pin=False, timeline=False))
        self._close = weakref.finalize(self, self.swap.close) if self.swap is not None else None
        """Closes the staging swap manager once: when the last slice is taken, or when the store is collected."""
        self.slices: dict[int, list] = {}
        """ds_id -> this rank's slice: [tensor] in host memory, or the names of its nvme segments."""
        self.next_id = 0
        self.freed = 0
        """Parameter bytes partitioned since the last trim."""
        self.trim = _malloc_trim()
        self.written = 0
        """Slices kept so far (names nvme segments uniquely)."""

    def put(self, param: nn.Parameter) -> None:
        """Partition `param`: rank 0's values everywhere, this rank's slice kept, the parameter left on meta."""
        ds_id, self.next_id = self.next_id, self.next_id + 1
        self._partition(ds_id, param.detach().reshape(-1).cpu(), src=0)
        shape = param.shape
        self.freed += param.numel() * param.element_size()
        _to_meta(param)
        mark(param, ds_id, shape, self, world_size=self.dp.world_size)
        if self.freed >= TRIM_BYTES:
            self.trim()
            self.freed = 0

    def _partition(self, ds_id: int, values: torch.Tensor, src: int) -> None:
        """Keep this rank's slice of `values` (rank `src`'s, sent to every rank) as parameter `ds_id`'s."""
        self.dp.broadcast(values, src)
        per = -(-values.numel() // self.dp.world_size)
        start = min(self.dp.rank * per, values.numel())
        mine = values.narrow(0, start, min(per, values.numel() - start))
        old = self.slices.get(ds_id, [])
        self.slices[ds_id] = self._keep(mine)
        self._forget(old)

    def _keep(self, values: torch.Tensor) -> list:
        if self.swap is None:
            kept = host_empty(values.shape, values.dtype)
            kept.copy_(values)
            return [kept]
        names, step = [], max(1, CHUNK_BYTES // values.element_size())
        for start in range(0, values.numel(), step):
            piece = values.narrow(0, start, min(step, values.numel() - start))
            name, self.written = f"init/{self.written}", self.written + 1
            self.swap.register(name, dtype=values.dtype, shape=piece.shape, home="nvme", data=piece).wait()
            names.append(name)
        return names

    def read_into(self, param: nn.Parameter, out: torch.Tensor) -> None:
        """Fill `out` (host, the parameter's shape) with its full values: every rank's slice, gathered. Every
        rank calls it, for the same parameters in the same order."""
        numel, world = param.ds_numel, self.dp.world_size
        per = -(-numel // world)
        mine = out.view(-1) if world == 1 else torch.zeros(per, dtype=out.dtype)  # one rank: its slice is all
        at = 0
        for piece in self.slices[param.ds_id]:
            if isinstance(piece, str):
                with self.swap.held(piece, "host") as piece:
                    mine.narrow(0, at, piece.numel()).copy_(piece)
            else:
                mine.narrow(0, at, piece.numel()).copy_(piece)
            at += piece.numel()
        if world == 1:
            return
        full = torch.empty(per * world, dtype=out.dtype)
        self.dp.all_gather(mine, full)
        out.view(-1).copy_(full.narrow(0, 0, numel))

    def take(self, param: nn.Parameter, out: torch.Tensor) -> None:
        """`read_into`, then the slice is no longer kept: `initialize` has made the parameter its own (whole, until
        its placement partitions it and names itself the owner)."""
        self.read_into(param, out)
        self._drop(param.ds_id)
        delattr(param, OWNER)
        param.ds_status = ZeroParamStatus.AVAILABLE

    def _forget(self, pieces: list) -> None:
        for name in pieces:
            if isinstance(name, str):
                self.swap.unregister(name)

    def _drop(self, ds_id: int) -> None:
        pieces = self.slices.pop(ds_id, None)
        if pieces is None:
            return
        self._forget(pieces)
        if not self.slices and self.swap is not None:  # the last slice taken: the staging file goes
            self._close()
            self.swap = None

    @contextlib.contextmanager
    def gathered_parameters(self, params: list[nn.Parameter], modifier_rank: int | None = None) -> Iterator[None]:
        """GatheredParameters for parameters partitioned but not yet initialized: inside, each holds its full
        values (host memory); on exit what `modifier_rank` holds is partitioned again (None: changes dropped)."""
        owned = [p for p in params if owner_of(p) is self]
        made = [p for p in owned if p.is_meta]  # the others are whole for an enclosing block, which unmakes them
        for p in made:
            full = torch.empty(p.ds_shape, dtype=p.dtype)
            self.read_into(p, full)
            swap_keeping_attributes(p, nn.Parameter(full, p.requires_grad))
        set_status(made, ZeroParamStatus.AVAILABLE)
        try:
            yield
            if modifier_rank is not None:
                for p in owned:
                    self._partition(p.ds_id, p.detach().reshape(-1), src=modifier_rank)
        finally:
            for p in made:
                _to_meta(p)
            set_status(made, ZeroParamStatus.NOT_AVAILABLE)


_ACTIVE: list[Init] = []
"""The enabled zero.Init blocks entered and not yet left, outermost first."""


class Init:
    """DeepSpeed's `zero.Init`, as a context manager (and, given `module`, on a model already built).

    `remote_device`: where the slices wait for `initialize`: "cpu" (host memory) or "nvme" (files under the
    config's offload_param nvme_path); None takes offload_param.device from the config ("none" and no config:
    host memory, this being a CPU-side staging: the device takes them unit by unit at `initialize`).
    `config_dict_or_path` (or `config`): the ds_config `initialize` will get. `dtype`: the slices' dtype
    (default: the parameters' own, so fp32 masters start from the exact values built). `pin_memory` and
    `mem_efficient_linear` are accepted and change nothing here. `data_parallel_group`: the group to partition
    over (default: the world, joined here under torchrun as `initialize` would). Entered inside another zero.Init
    (transformers opens one inside the user's), it leaves the partitioning to the outer one, as DeepSpeed's does."""

    def __init__(self, module: nn.Module | None = None, data_parallel_group=None, mem_efficient_linear: bool = True,
                 remote_device: str | None = None, pin_memory: bool = False,
                 config_dict_or_path: str | os.PathLike | Mapping | None = None, config: Any = None,
                 enabled: bool = True, dtype: torch.dtype | None = None, mpu=None, **options: Any):
        if mpu is not None or options.get("zero_param_parallel_group") is not None:
            raise UnsupportedFeatureError("zero.Init with model parallelism (mpu, zero_param_parallel_group)",
                                          "data parallelism over every rank: leave them out")
        for name in ("zero_quantized_weights", "zero_quantized_nontrainable_weights"):
            if options.pop(name, False):
                raise UnsupportedFeatureError(f"zero.Init({name}=True)", "bf16 or fp16 parameters (the config's "
                                              "bf16 / fp16 section)")
        options.pop("zero_param_parallel_group", None)
        if options:
            raise TypeError(f"zero.Init got unexpected arguments: {', '.join(sorted(options))}")
        self.enabled = enabled
        self.dtype = dtype
        self._hooks: list = []
        self._pending: dict[int, nn.Parameter] = {}
        self._parents: dict[int, nn.Module] = {}
        """Modules that got children inside the block, by id: the Hugging Face models among them initialize again."""
        self._children: set[int] = set()
        self._initialized: set[int] = set()
        """Modules and parameters (ids) whose Hugging Face initialization has run on real values."""
        if not enabled:
            return
        source = config_dict_or_path if config_dict_or_path is not None else config
        cfg = None if source is None else load_config(source, world_size=DataParallel.world_size_to_join())
        if data_parallel_group is not None:
            dp = DataParallel(data_parallel_group)
        else:
            timeout = cfg.zero_tiering.collective_timeout if cfg is not None else 600.0
            dp = DataParallel.from_env(local_device(), timeout=timeout)
        offload = cfg.zero_optimization.offload_param if cfg is not None else None
        where = remote_device or (offload.device if offload is not None else "cpu")
        if where not in ("none", "cpu", "nvme"):
            raise ConfigError("remote_device", 'one of "cpu", "nvme" (or "none")', value=where)
        nvme = None
        if where == "nvme":
            if offload is None or not offload.nvme_path:
                raise ConfigError("remote_device", 'is "nvme": the config must give zero_optimization.'
                                  "offload_param.nvme_path, the directory the slices wait in", value=where)
            paths = offload.nvme_path if isinstance(offload.nvme_path, tuple) else (offload.nvme_path,)
            nvme = NvmeStoreConfig(nvme_path=paths[0], aio=cfg.to_aio_config(), create=True)
        self.store = InitStore(dp, nvme)
        if module is not None:
            self._partition(module.parameters())

    def __enter__(self) -> Init:
        _BUILDING[0] += 1
        if self.enabled and not _ACTIVE:  # nested (transformers opens one inside the user's): the outer one partitions
            self._hooks = [module_hooks.register_module_parameter_registration_hook(self._registered),
                           module_hooks.register_module_module_registration_hook(self._module_registered)]
        if self.enabled:
            _ACTIVE.append(self)
        return self

    def __exit__(self, *exc) -> None:
        try:
            self._close(exc[0] is None)
        finally:
            _BUILDING[0] -= 1

    def _close(self, finished: bool) -> None:
        if self in _ACTIVE:
            _ACTIVE.remove(self)
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        pending, self._pending = list(self._pending.values()), {}
        parents, self._parents = [m for i, m in self._parents.items() if i not in self._children], {}
        self._children = set()
        if finished:
            self._put(pending)
            for model in parents:
                if callable(getattr(model, "_initialize_weights", None)):
                    self._initialize_hf(model)

    def _registered(self, module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and not param.is_meta:
            self._pending[id(param)] = param

    def _module_registered(self, parent: nn.Module, name: str, child: nn.Module | None) -> None:
        """`child` is being assigned to its parent, so its construction is over: partition what it built."""
        if child is not None:
            self._partition(child.parameters())
            self._parents[id(parent)] = parent
            self._children.add(id(child))
            if callable(getattr(child, "_initialize_weights", None)):
                self._initialize_hf(child)

    def _partition(self, params: Iterable[nn.Parameter]) -> None:
        self._put([self._pending.pop(id(p), p) for p in params
                   if id(p) in self._pending or (not self._hooks and not p.is_meta)])

    def _initialize_hf(self, model: nn.Module) -> None:
        """Run a Hugging Face model's weight initialization again (its post_init ran it on meta parameters) for
        the modules no earlier run covered (a sub-model's ran when it was assigned), each module's
        `_init_weights` with the module's own parameters gathered and what it draws kept."""
        if _initialization_off():
            return
        for item in (*model.modules(), *model.parameters()):  # a tied weight is once among the parameters
            if id(item) not in self._initialized and getattr(item, "_is_hf_initialized", False):
                del item._is_hf_initialized  # set by the pass on meta, which initialized nothing
        pretrained = [m for m in model.modules() if callable(getattr(m, "_initialize_weights", None))]
        for m in pretrained:
            m._init_weights = _gathering(m._init_weights)
        try:
            if hasattr(model, "initialize_weights"):
                model.initialize_weights()
            else:
                model.apply(model._initialize_weights)
        finally:
            for m in pretrained:
                del m._init_weights
        self._initialized.update(id(item) for item in (*model.modules(), *model.parameters()))

    def _put(self, params: list[nn.Parameter]) -> None:
        for p in params:
            if self.dtype is not None and p.is_floating_point() and p.dtype != self.dtype:
                p.data = p.data.to(self.dtype)
            self.store.put(p)


def _initialization_off() -> bool:
    """Inside transformers' `no_init_weights` (`from_pretrained`'s construction): it swaps torch's init functions
    for no-ops (transformers 5) or clears `modeling_utils._init_weights` (transformers 4)."""
    hf_init = sys.modules.get("transformers.initialization")
    originals = getattr(hf_init, "TORCH_INIT_FUNCTIONS", None)
    if originals and "normal_" in originals:
        return torch.nn.init.normal_ is not originals["normal_"]
    return getattr(sys.modules.get("transformers.modeling_utils"), "_init_weights", True) is False


def _gathering(init_weights: Callable[[nn.Module], None]) -> Callable[[nn.Module], None]:
    """`init_weights(module)` with the parameters it may touch gathered: the module's subtree (GPT-2's attention
    initializes its child's weight), unless the subtree holds a list of blocks or a sub-model (the model, its
    layer list), whose initialization touches its own parameters only and whose subtree is the model."""
    def run(module: nn.Module) -> None:
        whole = not any(isinstance(m, (nn.ModuleList, nn.ModuleDict)) or callable(getattr(m, "_initialize_weights", None))
                        for m in module.modules())
        with GatheredParameters(list(module.parameters(recurse=whole)), modifier_rank=0):
            init_weights(module)
    return run


class PartitionedParameter(nn.Parameter):
    """A parameter zero.Init partitioned: its values wait elsewhere (this rank's slice), its tensor is on meta. Its
    `device` is the local device, as a DeepSpeed partitioned parameter's (an empty tensor there): code that builds a
    module beside it `.to(weight.device)` (DeepSpeed-Chat's LoRA layers) keeps that module's values, where a meta
    device would drop them. `is_meta` still tells a partitioned parameter."""

    @property
    def device(self) -> torch.device:
        if _BUILDING[0]:  # the model's own construction and initialization see meta, as they did before (the same
            return _META  # draws as outside zero.Init)
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else _CPU

    def to(self, *args, **kwargs):
        """To its own device and dtype: itself, as DeepSpeed's empty tensor moves (`module.to(weight.device)` of a
        module holding it); anything else as torch moves a meta tensor."""
        device, dtype, _, _ = torch._C._nn._parse_to(*args, **kwargs)
        if (device is None or torch.device(device) == self.device) and dtype in (None, self.dtype):
            return self
        return super().to(*args, **kwargs)


_CPU, _META = torch.device("cpu"), torch.device("meta")
_BUILDING = [0]
"""Open zero.Init blocks, their exits (which initialize Hugging Face models) included."""


def _to_meta(param: nn.Parameter) -> None:
    swap_keeping_attributes(param, PartitionedParameter(torch.empty(param.shape, dtype=param.dtype, device="meta"),
                                                        param.requires_grad))
