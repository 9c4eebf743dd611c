"""Materializer: real values for a unit's parameters when the model was built on the meta device.

Unit by unit, so a model whose training state exceeds host memory can be initialized: the unit's meta
parameters get host memory (the Parameter objects keep their identity), then take their values from a
pretrained checkpoint (PretrainedWeights: read by name, straight into them) or, without one, from each owning
module's own initialization: a transformers model's `_init_weights(module)`, else `reset_parameters()`.
Parameters zero.Init partitioned take their values from its store (every rank's slice, gathered), never from
an initialization.
Parameters in no unit (trained outside every param group, frozen below stage 3, not floating point) and buffers
are materialized the same way once the units are done (`rest`).
"""
from __future__ import annotations

import torch
from torch import nn

from tiering import aligned_empty

from .ds_param import owner_of
from .flat_unit import FlatUnit
from .pretrained import PretrainedWeights, PretrainedWeightsError


class Materializer:
    def __init__(self, model: nn.Module, weights: PretrainedWeights | None = None):
        self.model = model
        self.weights = weights
        self.init_weights = getattr(model, "_init_weights", None)
        self.names: dict[int, list[str]] = {}
        """id(tensor) -> every name the model reaches it by (tied weights have several); for a PEFT model, the
        base model's names follow (what its pretrained checkpoint calls them)."""
        peft = getattr(model, "peft_config", None) is not None
        for name, p in model.named_parameters(remove_duplicate=False):
            self.names.setdefault(id(p), []).append(name)
            if peft:
                self.names[id(p)].append(name.removeprefix("base_model.model.").replace(".base_layer.", ".")
                                         .replace(".original_module.", "."))
        self.adapters: dict[int, list[tuple[nn.Module, str]]] = {}
        """id(module) -> (PEFT tuner layer, adapter name) of an adapter's own modules (`lora_A[name]`, ...; an
        embedding's `lora_embedding_A`, a ParameterDict, holds every adapter's parameters itself)."""
        self.copies: dict[int, nn.Parameter] = {}
        """id(parameter) -> its original, for a PEFT `modules_to_save` copy (trained, starting as the base's)."""
        for layer in model.modules():
            if callable(getattr(layer, "reset_lora_parameters", None)):
                for part in ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B"):
                    for adapter, owned in getattr(layer, part, {}).items():
                        key = id(owned if isinstance(owned, nn.Module) else getattr(layer, part))
                        self.adapters.setdefault(key, []).append((layer, adapter))
            if isinstance(getattr(layer, "original_module", None), nn.Module) and \
                    isinstance(getattr(layer, "modules_to_save", None), nn.ModuleDict):
                originals = dict(layer.original_module.named_parameters())
                for copy in layer.modules_to_save.values():
                    self.copies.update((id(p), originals[n]) for n, p in copy.named_parameters() if n in originals)

    def __call__(self, *units: FlatUnit) -> None:
        """Materialize the units' meta parameters (a module's units at once: one module may hold parameters of
        several, e.g. a trained bias beside a frozen weight)."""
        ours = {id(slot.param) for unit in units for slot in unit.slots if slot.param.is_meta}
        if not ours:
            return
        for module in self.model.modules():
            own = list(module.parameters(recurse=False))
            if not any(id(p) in ours for p in own):
                continue
            foreign = [p for p in own if p.is_meta and id(p) not in ours and _staged(p) is None]
            if foreign and self.weights is None:
                raise ValueError(f"{type(module).__name__} holds meta parameters of several units; give them "
                                 "real values before zero.initialize")
            self._materialize(module, own)

    def _materialize(self, module: nn.Module, params: list[nn.Parameter]) -> None:
        staged = [p for p in params if p.is_meta and _staged(p) is not None]
        params = [p for p in params if _staged(p) is None]
        if any(p.is_meta for p in params):
            self._fill(module, params)
        for p in staged:  # after any initialization, which leaves them on meta; in the same order on every rank
            store = _staged(p)
            swap_keeping_attributes(p, nn.Parameter(host_empty(p.shape, p.dtype), p.requires_grad))
            store.take(p, p.data)

    def _fill(self, module: nn.Module, params: list[nn.Parameter]) -> None:
        for p in params:
            if p.is_meta:
                swap_keeping_attributes(p, nn.Parameter(host_empty(p.shape, p.dtype), p.requires_grad))
        if all(id(p) in self.copies for p in params):
            self._copy_originals(params)
            return
        if self.weights is None or id(module) in self.adapters:  # a new adapter is in no pretrained checkpoint
            self._initialize(module)
            return
        for p in params:
            self._read(p, self.names[id(p)])

    def _read(self, p: nn.Parameter, names: list[str]) -> None:
        found = self.weights.find(names)
        if found is None:
            raise PretrainedWeightsError(f"{self.weights.path!r} has no tensor for the model's "
                                         f"{' / '.join(map(repr, names))} (shape {list(p.shape)})")
        with torch.no_grad():
            self.weights.read_into(found, p.data, names[0])
        self.weights.mark_used(names)

    def _copy_originals(self, params: list[nn.Parameter]) -> None:
        """PEFT's modules_to_save copies start as their originals: from their values, zero.Init's slices of them, or
        the checkpoint's tensors for them."""
        for p in params:
            original = self.copies[id(p)]
            if not original.is_meta:
                with torch.no_grad():
                    p.data.copy_(original.data)
            elif _staged(original) is not None:
                _staged(original).read_into(original, p.data)
            elif self.weights is not None:
                self._read(p, self.names[id(original)])
            else:
                raise ValueError(f"PEFT's modules_to_save copy {self.names[id(p)][0]!r} of a base built on meta "
                                 "starts as its original, which has no values yet: give initialize the base's "
                                 "weights (weights=...), or build it under zero.Init or with its weights")

    def _initialize(self, module: nn.Module) -> None:
        if id(module) in self.adapters:
            for layer, adapter in self.adapters[id(module)]:
                self._initialize_adapter(layer, adapter)
            return
        with torch.no_grad():
            if self.init_weights is not None:
                self.init_weights(module)
            elif hasattr(module, "reset_parameters"):
                module.reset_parameters()
            else:
                raise ValueError(f"{type(module).__name__} was built on meta and has no reset_parameters(): "
                                 "zero-tiering cannot initialize its parameters")

    def _initialize_adapter(self, layer: nn.Module, adapter: str) -> None:
        """A PEFT adapter whose base was on meta (built under zero.Init, or on meta to take pretrained weights):
        PEFT moved it to meta after initializing it, so its layer initializes it again (LoRA: A as nn.Linear, B
        zero, the model starting as its base), all its own modules at once."""
        owned = [m for m in layer.modules() if (layer, adapter) in self.adapters.get(id(m), ())]
        for module in owned:
            for p in module.parameters(recurse=False):
                if p.is_meta:
                    swap_keeping_attributes(p, nn.Parameter(host_empty(p.shape, p.dtype), p.requires_grad))
        init = self.model.peft_config[adapter].init_lora_weights
        with torch.no_grad():
            if init is False:  # PEFT's "no LoRA initialization": the layers' own
                for module in owned:
                    module.reset_parameters()
            elif init is True or str(init).lower() == "gaussian":
                layer.reset_lora_parameters(adapter, init)
            else:
                raise ValueError(f"LoRA adapter {adapter!r} asks for init_lora_weights={init!r}, computed from the "
                                 "base's weights, which were on meta when PEFT ran: apply get_peft_model to a base "
                                 "with its weights, or use init_lora_weights True or 'gaussian'")

    def rest(self) -> None:
        """What the units left: meta parameters in no unit, then buffers; with a checkpoint, check it
        holds nothing the model has no place for."""
        for module in self.model.modules():
            own = [p for p in module.parameters(recurse=False) if p.is_meta]
            if own:
                self._materialize(module, own)
        self._buffers()
        if self.weights is not None:
            known = {f"{prefix}{'.' if prefix else ''}{name}" for prefix, module in self.model.named_modules()
                     for name, _ in module.named_buffers(recurse=False)}
            self.weights.check_all_used(known)

    def _buffers(self) -> None:
        """Persistent buffers the checkpoint holds take its values; floating meta buffers of modules without
        parameters (a rotary embedding's `inv_freq`) get theirs from the same initialization; one it leaves
        unset (NaN) is an error naming it."""
        if self.weights is not None:
            for prefix, module in self.model.named_modules():
                for name, buffer in list(module.named_buffers(recurse=False)):
                    full = f"{prefix}.{name}" if prefix else name
                    found = self.weights.find([full])
                    if found is None or name in module._non_persistent_buffers_set:
                        continue
                    if buffer.is_meta:
                        module._buffers[name] = buffer = torch.empty_like(buffer, device="cpu")
                    self.weights.read_into(found, buffer, full)
        if self.init_weights is None:
            return
        for module in self.model.modules():
            names = [n for n, b in module.named_buffers(recurse=False) if b.is_meta and b.is_floating_point()]
            if not names or next(module.parameters(recurse=False), None) is not None:
                continue
            for n in names:
                module._buffers[n] = torch.full_like(module._buffers[n], float("nan"), device="cpu")
            self._initialize(module)
            for n in names:
                if module._buffers[n].isnan().any():
                    raise ValueError(f"buffer {n!r} of {type(module).__name__} was built on meta and its "
                                     "model's _init_weights does not set it: give it real values")


def _staged(param: nn.Parameter):
    """The zero.Init store holding `param`'s slices, or None."""
    owner = owner_of(param)
    return owner if hasattr(owner, "take") else None


def swap_keeping_attributes(param: nn.Parameter, new: nn.Parameter) -> None:
    """Give `param` the tensor `new` holds, the Parameter object and its attributes (DeepSpeed's `ds_*`)
    staying the same."""
    attributes = dict(param.__dict__)
    torch.utils.swap_tensors(param, new)
    param.__dict__.update(attributes)


def host_empty(shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """A host tensor in an anonymous mapping of its own, unmapped when it dies. A model is materialized one unit
    at a time: tensors from malloc of up to 32 MiB come from glibc's heap once it has raised its mmap
    threshold, and freed ones stay in the process (measured: 0.5 GB retained after loading a 3 GB model)."""
    numel = torch.Size(shape).numel()
    return aligned_empty(numel * dtype.itemsize)[: numel * dtype.itemsize].view(dtype).view(shape)
