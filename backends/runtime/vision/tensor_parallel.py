"""Tensor-parallel Qwen2.5-VL vision tower (issue 5): each block's attention heads and MLP width split over ranks.

The split is Megatron-LM's (Shoeybi et al. 2019, section 3): per block, ``qkv`` and the MLP's ``gate_proj`` /
``up_proj`` are column-parallel (each rank keeps its heads' rows, its share of the MLP width), ``proj`` and
``down_proj`` row-parallel (the matching input columns), each followed by one all-reduce (sum); the biases of the
row-parallel layers are added once, after it. The patch embedding, rotary embedding, norms and the patch merger are
replicated (small). So a W-rank tower moves two all-reduces of ``[tokens, hidden]`` per block and holds 1/W of
the blocks' weights per GPU.

Rank 0 is the caller's process (the encode_prefill stage); ranks 1..W-1 are helper processes
(``backends.ipc.helper_process``) started here, one per device, which build the tower from its config, answer their
handshake, receive rank 0's weights by broadcast and keep their share; a helper ends when rank 0's end of its
socket closes (rank 0 killed).
With ``tp`` < W the ranks form W / tp towers of ``tp`` ranks each (hybrid parallel: data parallel over towers,
tensor parallel within one; the paper runs Qwen2.5-VL's tower at DP2 x TP2), ranks ``[g*tp, (g+1)*tp)`` being
tower g, whose all-reduces run in its own process group. Each call: rank 0 deals the items over the towers (largest
first to the least loaded, ``vision_parallel.deal``) and broadcasts a header (``[op, rows, items]``, int64; op 0
stops), the items' ``grid_thw``, their tower and the patch rows; every rank runs its tower's items one by one; each
tower's first rank keeps the outputs, and those of towers other than rank 0's are sent to rank 0.
Collectives: NCCL on GPUs, gloo on the CPU (the tests).
"""
from __future__ import annotations

import datetime
import json
import logging
import sys
import tempfile
from pathlib import Path
from typing import Callable, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from backends.ipc.helper_process import HelperProcess, ParentLink, close_all, handshake_all
from backends.runtime.vision.attention import use_varlen_vision_attention
from backends.runtime.vision.batch import Item, encode_batch
from backends.runtime.vision.data_parallel import deal
from backends.runtime.vision.speed import pad_vision_mlp

log = logging.getLogger(__name__)
# the helpers' handshake (they import torch and transformers and build the tower first), joining, and every
# collective: not over by then (a helper gone), the start fails, the stage fails (NCCL's watchdog) or the call
# raises (gloo)
TIMEOUT_S = 300.0
PATCH_DIM = 3 * 2 * 14 * 14  # input features of a patch row (Qwen2.5-VL)


class RowParallelLinear(nn.Module):
    """``linear`` with only the input columns ``[start, end)`` kept: the partial products of every rank are summed
    by an all-reduce over ``group``, then the full bias is added (so it counts once)."""

    def __init__(self, linear: nn.Linear, start: int, end: int, group):
        super().__init__()
        self.weight = nn.Parameter(linear.weight.detach()[:, start:end].clone(), requires_grad=False)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone(), requires_grad=False)
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _all_reduce(F.linear(x, self.weight), self.group) + (0 if self.bias is None else self.bias)


@torch.compiler.disable  # a collective: a graph break when the vision blocks are compiled
def _all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    dist.all_reduce(x, group=group)
    return x


def _keep_rows(linear: nn.Linear, rows: torch.Tensor) -> None:
    linear.weight = nn.Parameter(linear.weight.detach()[rows].clone(), requires_grad=False)
    if linear.bias is not None:
        linear.bias = nn.Parameter(linear.bias.detach()[rows].clone(), requires_grad=False)
    linear.out_features = len(rows)


@torch.no_grad()
def shard_vision_tower(visual: nn.Module, rank: int, world: int, group=None) -> None:
    """Keep rank ``rank`` of ``world``'s share of every block of ``visual`` (a Qwen2.5-VL tower with its MLP padded
    to a multiple of ``world``: :func:`prepare_for_tp`), in place. Raises ValueError when the heads or the MLP
    width do not divide by ``world``."""
    for block in visual.blocks:
        attn, mlp = block.attn, block.mlp
        heads, head_dim = attn.num_heads, attn.head_dim
        width = mlp.gate_proj.out_features
        if heads % world or width % world:
            raise ValueError(f"vision tensor parallel over {world} ranks needs heads ({heads}) and MLP width "
                             f"({width}) divisible by it")
        local = heads // world
        cols = torch.arange(rank * local * head_dim, (rank + 1) * local * head_dim)
        # qkv rows are [q heads | k heads | v heads], each head_dim rows per head
        _keep_rows(attn.qkv, torch.cat([part * heads * head_dim + cols for part in range(3)]))
        attn.proj = RowParallelLinear(attn.proj, int(cols[0]), int(cols[-1]) + 1, group)
        attn.num_heads = local
        share = width // world
        rows = torch.arange(rank * share, (rank + 1) * share)
        _keep_rows(mlp.gate_proj, rows)
        _keep_rows(mlp.up_proj, rows)
        mlp.down_proj = RowParallelLinear(mlp.down_proj, rank * share, (rank + 1) * share, group)
        mlp.intermediate_size = share


def prepare_for_tp(visual: nn.Module, world: int) -> None:
    """What every rank does to its full tower before the weights are broadcast: varlen attention and the MLP
    padded to a width that splits into ``world`` aligned shares (zero rows: the output is unchanged)."""
    use_varlen_vision_attention(visual)
    pad_vision_mlp(visual, multiple=8 * world)


def _state(visual: nn.Module) -> list[torch.Tensor]:
    """Every parameter and buffer, in an order all ranks agree on."""
    return [t for _, t in sorted({**dict(visual.named_parameters()), **dict(visual.named_buffers())}.items())]


def _join(init_file: str, rank: int, world: int, tp: int, device: torch.device):
    """Join the world group, then make every tower's group (all ranks make all of them, in the same order);
    returns this rank's tower group."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=TIMEOUT_S),
                            device_id=device if device.type == "cuda" else None)
    groups = [dist.new_group(list(range(first, first + tp))) for first in range(0, world, tp)]
    return groups[rank // tp]


def _share(visual: nn.Module, rank: int, tp: int, group) -> None:
    """Take rank 0's weights (broadcast over the world) and keep this rank's share of its tower."""
    for tensor in _state(visual):
        dist.broadcast(tensor.data, src=0)
    shard_vision_tower(visual, rank % tp, tp, group)


def _run_tower(tower: int, grids: list[tuple[int, int, int]], owner: list[int], rows: torch.Tensor,
               visual: nn.Module) -> list[torch.Tensor]:
    """Tower ``tower``'s items (``owner[i]`` == it; ``rows`` holds every item's patch rows back to back) through
    this rank's shard ``visual`` in one forward (``batch.encode_batch``); their outputs."""
    mine, start = [], 0
    for grid, item_tower in zip(grids, owner):
        end = start + grid[0] * grid[1] * grid[2]
        if item_tower == tower:
            mine.append((rows[start:end], grid))
        start = end
    return encode_batch(visual, mine)


def check_towers(ranks: int, tp: int, heads: int) -> None:
    """Raises ValueError unless ``ranks`` GPUs form towers of ``tp`` (a divisor of ``ranks`` and of the tower's
    attention ``heads``)."""
    if tp < 1 or ranks % tp or heads % tp:
        raise ValueError(f"vision tensor parallel: {ranks} ranks in towers of {tp} needs the ranks a multiple of it "
                         f"and the heads ({heads}) divisible by it")


class VisionTensorParallel:
    """Rank 0 of a split vision tower: ``visual`` (on the caller's device) split with one helper process per device
    of ``devices`` (each a rank), into towers of ``tp`` ranks (default all: one tower; fewer: hybrid parallel, the
    ranks' count a multiple of ``tp``). ``prepare(tower)`` runs on every rank's shard once split (e.g.
    ``torch.compile`` of the blocks); each tower runs its items of a call in one forward (``batch.encode_batch``).
    One process group per process: a second instance in the same process raises
    RuntimeError. A failed encode (out of memory, a helper gone) leaves the ranks' collectives unpaired, so the
    towers are then taken out of service (helpers killed, group left) and every later encode raises RuntimeError;
    the server must be restarted. Raises ValueError (heads not divisible by ``tp``, ranks not a multiple of it, a
    repeated GPU) and RuntimeError (a helper that does not start, answer its handshake or join within TIMEOUT_S s).
    """

    def __init__(self, visual: nn.Module, devices: Sequence[torch.device],
                 prepare: Callable[[nn.Module], None] | None, tp: int | None = None):
        if dist.is_initialized():
            raise RuntimeError("a process group exists already: one tensor-parallel vision tower per process")
        own = next(visual.parameters()).device
        self.devices = [own, *(torch.device(d) for d in devices)]
        gpus = [str(d) for d in self.devices if d.type == "cuda"]
        if len(set(gpus)) != len(gpus):
            raise ValueError(f"one vision rank per GPU, got {[str(d) for d in self.devices]}")
        self.world, self.visual = len(self.devices), visual
        self.tp = tp or self.world
        check_towers(self.world, self.tp, visual.config.num_heads)
        self.towers = self.world // self.tp
        self._dir = tempfile.TemporaryDirectory(prefix="vision-tp-")
        init_file = str(Path(self._dir.name) / "init")
        config_file = Path(self._dir.name) / "config.json"
        config_file.write_text(json.dumps({"config": json.loads(visual.config.to_json_string()),
                                           "dtype": str(visual.dtype)}))
        self.helpers: list[HelperProcess] = []
        self.device, self.broken = own, ""
        try:
            for rank, device in enumerate(self.devices[1:], start=1):
                self.helpers.append(HelperProcess("backends.runtime.vision.tensor_parallel",
                                                  [init_file, config_file, rank, self.world, self.tp, device],
                                                  what=f"vision rank {rank} on {device}"))
            prepare_for_tp(visual, self.tp)
            handshake_all(self.helpers, TIMEOUT_S)  # each has built its tower: a failure is seen here, not at the join
            _share(visual, 0, self.tp, _join(init_file, 0, self.world, self.tp, own))
            if prepare is not None:
                prepare(visual)
        except Exception as exc:
            self._teardown()
            raise RuntimeError(f"vision tensor parallel over {[str(d) for d in self.devices]} did not start: "
                               f"{type(exc).__name__}: {exc}") from exc

    def encode_many(self, items: Sequence[Item]) -> list[torch.Tensor]:
        """Each item ``(pixel_values float [t*h*w, 1176], grid_thw)`` through the split towers; returns the
        embeddings ``[t*h*w / 4, hidden]`` in item order, on rank 0's device. Raises RuntimeError when a helper has
        exited or an encode failed."""
        dead = [str(d) for d, h in zip(self.devices[1:], self.helpers) if not h.alive]
        if dead and not self.broken:
            self._kill(f"the helper(s) on {dead} exited")
        if self.broken:
            raise RuntimeError(f"the split vision tower is out of service ({self.broken}); restart the server")
        if not items:
            return []
        counts = [int(p.shape[0]) for p, _ in items]
        owner = [0] * len(items)
        for tower, indices in enumerate(deal(counts, self.towers)):
            for index in indices:
                owner[index] = tower
        grids = [tuple(g) for _, g in items]
        rows = torch.cat([p.to(self.device, self.visual.dtype) for p, _ in items]).contiguous()
        try:
            for tensor in (torch.tensor([1, rows.shape[0], len(items)], dtype=torch.long, device=self.device),
                           torch.tensor(grids, dtype=torch.long, device=self.device),
                           torch.tensor(owner, dtype=torch.long, device=self.device), rows):
                dist.broadcast(tensor, src=0)
            ours = iter(_run_tower(0, grids, owner, rows, self.visual))
            theirs = [iter(self._receive(tower, [c for c, o in zip(counts, owner) if o == tower]))
                      for tower in range(1, self.towers)]
            return [next(ours) if o == 0 else next(theirs[o - 1]) for o in owner]
        except Exception as exc:  # the ranks' collectives no longer pair up: no later encode could run
            self._kill(f"an encode failed: {type(exc).__name__}: {exc}")
            raise RuntimeError(f"the split vision tower failed and is out of service: {type(exc).__name__}: {exc}") \
                from exc

    def _receive(self, tower: int, counts: list[int]) -> list[torch.Tensor]:
        """Tower ``tower``'s outputs of its items (``counts``: their patch rows), sent by its first rank."""
        if not counts:
            return []
        merged = self.visual.spatial_merge_size ** 2
        out = torch.empty(sum(counts) // merged, self.visual.config.out_hidden_size, dtype=self.visual.dtype,
                          device=self.device)
        dist.recv(out, src=tower * self.tp)
        return list(out.split([c // merged for c in counts]))

    def close(self) -> None:
        """Stop the helpers and leave the process group."""
        if not self.broken and all(h.alive for h in self.helpers):
            dist.broadcast(torch.zeros(3, dtype=torch.long, device=self.device), src=0)
            close_all(self.helpers, 30.0)
        self.broken = self.broken or "closed"
        self._teardown()

    def _kill(self, why: str) -> None:
        """Out of service for good, because of ``why`` (logged)."""
        self.broken = self.broken or why
        log.error("vision tensor parallel out of service: %s", why)
        self._teardown()

    def _teardown(self) -> None:
        """The helpers killed (those still running), the process group left, the temporary folder removed."""
        close_all(self.helpers)
        if dist.is_initialized():
            dist.destroy_process_group()
        self._dir.cleanup()


@torch.no_grad()
def serve(fd: int, init_file: str, config_file: str, rank: int, world: int, tp: int, device: torch.device) -> None:
    """A helper rank on socket ``fd``: build the tower, answer the handshake, take rank 0's weights, keep this rank's
    share of its tower (of ``tp`` ranks), run its tower's items of every call; a tower's first rank sends their
    outputs to rank 0. Ends when rank 0's end of the socket closes."""
    from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

    from backends.runtime.vision.speed import compile_vision_blocks

    def build() -> nn.Module:
        spec = json.loads(Path(config_file).read_text())
        if device.type == "cuda":
            torch.cuda.set_device(device)
        with torch.device(device):
            visual = Qwen2_5_VisionTransformerPretrainedModel._from_config(
                Qwen2_5_VLVisionConfig.from_dict(spec["config"]),
                dtype=getattr(torch, spec["dtype"].removeprefix("torch."))).eval()
        prepare_for_tp(visual, tp)
        return visual

    parent = ParentLink(fd)
    parent.exit_with_parent()  # rank 0 killed: this rank frees its GPU memory
    visual = parent.start(build)
    dtype = visual.dtype
    _share(visual, rank, tp, _join(init_file, rank, world, tp, device))
    if device.type == "cuda":
        compile_vision_blocks(visual)
    header = torch.empty(3, dtype=torch.long, device=device)
    while True:  # an exception (out of memory, a collective timing out) ends the process: rank 0 sees it exit
        dist.broadcast(header, src=0)
        op, rows, items = header.tolist()
        if op == 0:
            break
        grid = torch.empty(items, 3, dtype=torch.long, device=device)
        owner = torch.empty(items, dtype=torch.long, device=device)
        pixel_values = torch.empty(rows, PATCH_DIM, dtype=dtype, device=device)
        for tensor in (grid, owner, pixel_values):
            dist.broadcast(tensor, src=0)
        outputs = _run_tower(rank // tp, [tuple(g) for g in grid.tolist()], owner.tolist(), pixel_values, visual)
        if outputs and rank % tp == 0:  # a tower's first rank; never rank 0's tower here
            dist.send(torch.cat(outputs).contiguous(), dst=0)
    dist.destroy_process_group()


if __name__ == "__main__":
    serve(int(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6]),
          torch.device(sys.argv[7]))
