"""LoRAManager: an engine's LoRA adapters. The registry of loaded adapters (read from PEFT's files into CPU
memory) and a pool of max_loras slots on the device, which the model's hooked projections read (layers.py).

An adapter takes a slot when a step first needs it; with every slot taken, it evicts the least recently used
adapter that no row of the step uses (the scheduler lets at most max_loras adapters run at once, so one is always
idle). Each load of an adapter gets its own `lora_id`, which the engine's sequences carry: the slot it maps to,
and part of their prefix-cache keys (core/block_manager.py), so KV computed under one adapter is never reused
under another, nor under a later adapter loaded with the same lora_int_id.

With tensor parallelism every rank has a LoRAManager over its shard of the model (each slot holds this rank's
shard of its adapter: layers.py), and rank 0's decides: the registry lives there (add, remove, with the files read
once, by rank 0), and so does the choice of slots. Each step rank 0 broadcasts (worker/model_runner.py, StepInput)
carries a `LoRASync` when something changed for the workers: the adapters its rows use that the workers have not
had yet (their weights, as rank 0 read them), the adapters removed since, and rank 0's slot table, which each
worker copies (apply_sync), loading an adapter into the same slot where its own table differs. So every rank runs
every row with the same adapter in the same slot, and an adapter added at run time reaches the workers with the
first step that uses it.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import NamedTuple

import torch

from nanoqwen.errors import InvalidRequestError
from nanoqwen.layers.linear import RowParallelLinear
from nanoqwen.lora.layers import LoRALayer, LoRAStep
from nanoqwen.lora.peft import LoRAAdapter, load_peft_adapter, module_shape
from nanoqwen.lora.request import LoRARequest
from nanoqwen.models.qwen3 import Qwen3ForCausalLM
from nanoqwen.ops.cpu import kernels as cpu_kernels

logger = logging.getLogger("nanoqwen")


class LoadedLoRA(NamedTuple):
    """A registered adapter: the request that named it, its weights, and the engine's id for this load."""

    request: LoRARequest
    adapter: LoRAAdapter
    lora_id: int


class LoRASync(NamedTuple):
    """What the tensor-parallel workers' adapters and slots must become before a step (rank 0's
    LoRAManager.sync_for_workers; the workers' apply_sync): the adapters new to them (weights as rank 0 read them),
    the lora_ids removed since the last sync, and rank 0's slot table (lora_id -> slot)."""

    added: list[LoadedLoRA]
    removed: list[int]
    slots: dict[int, int]


class LoRAManager:
    """The adapters of one engine's model: hooks on its projections, the slot pool, the registry.

    max_loras: slots (adapters that can run in one step); max_lora_rank: the largest rank an adapter may have
    (every slot is padded to it)."""

    def __init__(self, model: Qwen3ForCausalLM, max_loras: int, max_lora_rank: int) -> None:
        config = model.config
        self.tp_rank, self.tp_size = model.tp_rank, model.tp_size
        self.max_loras, self.max_lora_rank = max_loras, max_lora_rank
        self.model_config = config
        self.step = LoRAStep()
        # use the per-group loop (layers.py, the definition) instead of the batched matmuls
        self.reference = False
        # (layer index, PEFT's short module name) -> (the LoRALayer of its linear, its part there)
        self.targets: dict[tuple[int, str], tuple[LoRALayer, int]] = {}
        self.layers: list[LoRALayer] = []
        # per decoder layer: the LoRALayer of each adapted linear, by the linear's name (qkv_proj, o_proj, ...)
        self.layer_linears: list[dict[str, LoRALayer]] = []
        # PEFT's short module name -> the name of the model's linear that computes it (q_proj -> qkv_proj)
        self.linear_names = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj", "o_proj": "o_proj",
                             "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj", "down_proj": "down_proj"}
        self._hooks = []
        for i, layer in enumerate(model.layers):
            attn = layer.self_attn
            linears = [(attn.qkv_proj, ["q_proj", "k_proj", "v_proj"]), (attn.o_proj, ["o_proj"])]
            if not config.is_moe_layer(i):
                linears += [(layer.mlp.gate_up_proj, ["gate_proj", "up_proj"]), (layer.mlp.down_proj, ["down_proj"])]
            self.layer_linears.append({})
            for linear, names in linears:
                # cut as the linear is (layers.py): output rows of a column-parallel one, input columns of a
                # row-parallel one, whose all_reduce then sums the adapter's parts too
                row_parallel = isinstance(linear, RowParallelLinear)
                lora = LoRALayer(module_shape(config, names[0])[0], [module_shape(config, n)[1] for n in names],
                                 max_loras, max_lora_rank, model.dtype, model.device, self.step,
                                 self.tp_rank, self.tp_size, row_parallel)
                if row_parallel and self.tp_size > 1:
                    linear.partial_sum_hook = lora.hook
                else:
                    self._hooks.append(linear.register_forward_hook(lora.hook))
                self.layers.append(lora)
                self.layer_linears[i][self.linear_names[names[0]]] = lora
                for part, name in enumerate(names):
                    self.targets[(i, name)] = (lora, part)
        self.registry: dict[int, LoadedLoRA] = {}  # by lora_int_id
        self.by_lora_id: dict[int, LoadedLoRA] = {}
        self.slots: OrderedDict[int, int] = OrderedDict()  # lora_id -> slot, least recently used first
        self._next_lora_id = 1
        self.slot_loads = 0  # adapters copied into a slot since start
        # slot -> its adapter as the fused CPU decoder takes it (fused_decoder_weights), until the slot is reloaded
        self._fused_weights: dict[int, object] = {}
        # rank 0 under tensor parallelism: the lora_ids whose weights the workers have (sync_for_workers)
        self._worker_lora_ids: set[int] = set()
        if self.tp_rank == 0:  # (the workers' managers follow rank 0's)
            logger.info("LoRA: %d slots of rank %d; decode steps whose rows all use one adapter run the fused CPU "
                        "decoder where it is on, other steps with an adapter the model's per-module forward (not CUDA "
                        "graphs)%s", max_loras, max_lora_rank,
                        f"; each of the {self.tp_size} ranks holds its shard of every adapter" if self.tp_size > 1
                        else "")

    def add(self, request: LoRARequest) -> LoadedLoRA:
        """Register request's adapter (read from its files unless its lora_int_id is already loaded from the same
        path); an InvalidRequestError for a bad adapter or a clash with a registered one."""
        loaded = self.registry.get(request.lora_int_id)
        if loaded is not None:
            if loaded.request.lora_path != request.lora_path or loaded.request.lora_name != request.lora_name:
                raise InvalidRequestError(
                    f"lora_int_id {request.lora_int_id} is already adapter {loaded.request.lora_name!r} "
                    f"({loaded.request.lora_path}); remove it first or choose another id", param="lora_int_id")
            return loaded
        for other in self.registry.values():
            if other.request.lora_name == request.lora_name:
                raise InvalidRequestError(f"lora_name {request.lora_name!r} is already adapter id "
                                          f"{other.request.lora_int_id}; names must be unique", param="lora_name")
        adapter = load_peft_adapter(request.lora_path, self.model_config)
        if adapter.rank > self.max_lora_rank:
            raise InvalidRequestError(f"adapter {request.lora_name!r} has rank {adapter.rank}, more than "
                                      f"max_lora_rank={self.max_lora_rank}: raise max_lora_rank", param="lora_path")
        loaded = LoadedLoRA(request, adapter, self._next_lora_id)
        self._next_lora_id += 1
        self.registry[request.lora_int_id] = self.by_lora_id[loaded.lora_id] = loaded
        return loaded

    def remove(self, lora_int_id: int) -> bool:
        """Forget an adapter (False if none has that id); its slot is free again."""
        loaded = self.registry.pop(lora_int_id, None)
        if loaded is None:
            return False
        del self.by_lora_id[loaded.lora_id]
        self.slots.pop(loaded.lora_id, None)
        return True

    def find(self, name: str) -> LoadedLoRA | None:
        """The registered adapter named `name`, if any."""
        return next((x for x in self.registry.values() if x.request.lora_name == name), None)

    def assign_slots(self, row_lora_ids: list[int]) -> dict[int, int]:
        """The slot of each adapter of these rows (lora_id per row, 0: none), putting each into one first."""
        ids = sorted(set(row_lora_ids) - {0})
        return {lora_id: self._slot_for(lora_id, ids) for lora_id in ids}

    def sync_for_workers(self, row_lora_ids: list[int]) -> LoRASync | None:
        """On rank 0 under tensor parallelism, before it broadcasts a step whose rows run with these adapters:
        put them into slots (the step's prepare then finds them there) and say what the workers' registries and
        slot tables must become (None when no row has an adapter and none was removed since the last sync)."""
        slot_of = self.assign_slots(row_lora_ids)
        added = [self.by_lora_id[i] for i in slot_of if i not in self._worker_lora_ids]
        removed = sorted(self._worker_lora_ids - self.by_lora_id.keys())
        if not slot_of and not removed:
            return None
        self._worker_lora_ids.difference_update(removed)
        self._worker_lora_ids.update(loaded.lora_id for loaded in added)
        return LoRASync(added, removed, dict(self.slots))

    def apply_sync(self, sync: LoRASync) -> None:
        """On a tensor-parallel worker, before a step: take rank 0's changes (sync_for_workers), so that every
        adapter sits in the slot it has on rank 0 (this rank's shard of it)."""
        for lora_id in sync.removed:
            loaded = self.by_lora_id.pop(lora_id, None)
            if loaded is not None:
                self.registry.pop(loaded.request.lora_int_id, None)
        for loaded in sync.added:
            self.registry[loaded.request.lora_int_id] = self.by_lora_id[loaded.lora_id] = loaded
        for lora_id, slot in sync.slots.items():
            if self.slots.get(lora_id) != slot:
                self._load(lora_id, slot)
        self.slots = OrderedDict(sync.slots)

    def prepare(self, row_lora_ids: list[int]) -> None:
        """Set the step for a forward whose rows run with these adapters (lora_id per row, 0: none), putting
        each into a slot first."""
        slot_of = self.assign_slots(row_lora_ids)
        slots = [slot_of[i] if i else -1 for i in row_lora_ids]
        device = self.layers[0].lora_a.device
        step = self.step
        step.slots = torch.tensor(slots, device=device)
        step.uniform_slot = slots[0] if len(set(slots)) == 1 and slots[0] >= 0 else None
        step.one_hot = torch.zeros(len(slots), self.max_loras, dtype=self.layers[0].lora_a.dtype, device=device)
        rows = torch.arange(len(slots), device=device)
        used = step.slots >= 0
        step.one_hot[rows[used], step.slots[used]] = 1
        step.groups = [(s, rows[step.slots == s]) for s in sorted(set(slots) - {-1})]
        step.reference = self.reference

    def fused_decoder_weights(self, lora_id: int) -> object:
        """Adapter lora_id as the fused CPU decoder takes it for a step whose rows all use it
        (cpu_kernels.decoder_lora_weights, worker/fused_decoder.py), put into a slot first where it has none: per
        layer and linear, views of the matrices the hooks multiply by for such a step (the slot's rows of
        LoRALayer.lora_a and its lora_b_by_slot), or none where the adapter has no part on that linear. Made once a
        slot, until the slot takes another adapter."""
        slot = self._slot_for(lora_id, [lora_id])
        weights = self._fused_weights.get(slot)
        if weights is None:
            adapted = {(layer, self.linear_names[name]) for layer, name in self.by_lora_id[lora_id].adapter.weights}
            layers = []
            for i, linears in enumerate(self.layer_linears):
                layers.append(cpu_kernels.decoder_layer_lora(**{
                    name: [lora.lora_a[lora.rows(slot)], lora.lora_b_by_slot[slot]] if (i, name) in adapted else []
                    for name, lora in linears.items()}))
            weights = self._fused_weights[slot] = cpu_kernels.decoder_lora_weights(layers)
        return weights

    def clear(self) -> None:
        """No adapter until the next prepare."""
        self.step.slots = self.step.one_hot = self.step.uniform_slot = None
        self.step.groups = []

    def _slot_for(self, lora_id: int, in_use: list[int]) -> int:
        """The slot holding adapter lora_id, copying it into a free one, or else into the least recently used
        one no row of this step needs."""
        if lora_id in self.slots:
            self.slots.move_to_end(lora_id)
            return self.slots[lora_id]
        if lora_id not in self.by_lora_id:
            raise InvalidRequestError(f"LoRA adapter id {lora_id} was removed while a request used it")
        taken = set(self.slots.values())
        free = [s for s in range(self.max_loras) if s not in taken]
        if free:
            slot = free[0]
        else:
            victim = next((i for i in self.slots if i not in in_use), None)
            if victim is None:
                raise RuntimeError(f"a step uses more than max_loras={self.max_loras} adapters")
            slot = self.slots.pop(victim)
        self._load(lora_id, slot)
        return slot

    def _load(self, lora_id: int, slot: int) -> None:
        """Copy adapter lora_id (this rank's shard of it) into slot, in place of the one there."""
        for other in [i for i, s in self.slots.items() if s == slot]:
            del self.slots[other]
        adapter = self.by_lora_id[lora_id].adapter
        self._fused_weights.pop(slot, None)
        for layer in self.layers:
            layer.clear_slot(slot)
        for key, weights in adapter.weights.items():
            layer, part = self.targets[key]
            layer.set_part(slot, part, weights)
        self.slots[lora_id] = slot
        self.slot_loads += 1
