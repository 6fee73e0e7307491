"""The expert cache: routed experts live on the host; N device slots hold the resident ones.

Residency. The N slots are split evenly over the MoE layers (the first `N mod L` layers
get one more); each layer needs at least `num_experts_per_tok` slots so one token never
waits on itself. At start-up the slots of a layer hold its lowest-numbered experts.

Per window and layer (`LayerExperts.compute`): every token of the window is routed at
once; the routed expert ids are read to the host (one small sync per MoE layer per
window: the host must decide what to upload); each routed expert that is not resident
is uploaded **once** (a miss), resident ones are hits; then all (token, expert) rows of
the window are computed as one grouped GEMM over the layer's slots. When a window routes
to more experts than the layer has slots (a long prefill chunk on a small cache), it
runs in passes: experts already computed this window become evictable, so each missing
expert is still uploaded once per window.

Eviction. Each (layer, expert) keeps a routing-frequency score: tokens routed to it,
decayed by half every `HALF_LIFE_TOKENS` tokens. A miss takes a free slot or the slot of
the lowest-scoring expert not routed in the current window (ties: lowest expert id).

Misses are served by upload, never by computing on the CPU: every expert is then
computed by the same kernel from the same weights wherever it was resident before, and
rows are reduced over the top-k positions in a fixed order, so the output does not
depend on residency (a test asserts bit-equal logits at full, half and a tenth). On the
CPU the slots are a separate CPU buffer, so routing, eviction, copies and counters run
the same code as on a GPU. See docs/MOE.md for the measurement behind upload-vs-compute.

The device path (`device_path`, CUDA with Triton). A layer routes and computes on the
device with no host synchronisation (`LayerExperts.compute_device`: the fused Triton
kernels of moe_kernels.py), which CUDA graphs can capture. With every expert resident
(the common case when they fit) nothing is ever uploaded; a window longer than
`DEVICE_WINDOW_TOKENS` takes one grouped GEMM with group offsets computed on the device.
With fewer slots than experts, the device residency map (`slot_key`) tells the kernels
where each expert is: a resident one is read from its slot, a missing one straight from
pinned host memory (mapped into the device's address space: zero-copy, same weights,
same kernel, so numerics still do not depend on residency). The kernels count tokens per
expert, hits and misses on the device; the counts reach pinned memory after each window
and `rebalance` (between windows, outside any graph, no sync) folds them into the scores
and uploads an expert that now clearly out-scores a resident one. Windows longer than
`DEVICE_WINDOW_TOKENS` (prefill chunks) take the host-routed path above. A device whose
kernels cannot read pinned host memory (probed once) keeps the host-routed path.
"""

from __future__ import annotations

import importlib.util

import torch
import torch.nn.functional as F

from draftflow.layers.moe import HostExperts

HALF_LIFE_TOKENS = 64
DEVICE_WINDOW_TOKENS = 64  # longest window the fused kernels serve in one token block (moe_kernels)
# Device path promotions, per layer and `rebalance`: an upload shares the bus with the misses the kernels read,
# so at most one, and only for an expert that out-scores the evicted one by a token's worth (no ping-pong
# between near-equal experts; under near-uniform routing no policy wins, so promotions stay rare there).
PROMOTE_PER_LAYER = 1
PROMOTE_MARGIN = 1.0
_DECAY_PER_TOKEN = 0.5 ** (1 / HALF_LIFE_TOKENS)


def min_resident(num_moe_layers: int, top_k: int) -> int:
    """The fewest resident experts a model can run with: top-k slots in every MoE layer."""
    return num_moe_layers * top_k


def _use_grouped_mm(x: torch.Tensor) -> bool:
    # torch's grouped GEMM runs on the CPU for any float dtype and on CUDA for bf16 (sm90+ kernels).
    return hasattr(torch, "_grouped_mm") and (x.device.type == "cpu" or x.dtype == torch.bfloat16)


def grouped_linear(x: torch.Tensor, w: torch.Tensor, offs: list[int], grouped: bool = True) -> torch.Tensor:
    """Rows `offs[g-1]:offs[g]` of `x` times slot `g` of `w` (F.linear layout): one grouped GEMM, or one GEMM per group."""
    # x: [M, K]; w: [G, N, K]; offs: G cumulative row ends -> [M, N]
    if grouped and _use_grouped_mm(x):
        return torch._grouped_mm(x, w.transpose(1, 2), offs=torch.tensor(offs, dtype=torch.int32, device=x.device))
    out, start = x.new_empty(x.shape[0], w.shape[1]), 0
    for g, end in enumerate(offs):
        if end > start:
            out[start:end] = F.linear(x[start:end], w[g])
        start = end
    return out


class ExpertCache:
    """N device slots for the routed experts of one model; counters of hits, misses and bytes uploaded."""

    def __init__(self, host: HostExperts, resident: int | None, top_k: int, device: torch.device | str,
                 grouped: bool | None = None) -> None:
        # grouped: one grouped GEMM per layer and window where torch has one, else a GEMM per routed expert.
        # None: grouped on the CPU, per expert on CUDA (H200, 30B-A3B shape: 11.6 vs 6.5 tokens/s, BENCHMARKS.md).
        n_layers, self.num_experts, two_i, h = host.shape
        self.grouped = torch.device(device).type != "cuda" if grouped is None else grouped
        self.host, self.device, self.top_k = host, torch.device(device), top_k
        self.total = n_layers * self.num_experts
        self.resident = self.total if resident is None else resident
        low = min_resident(n_layers, top_k)
        if not low <= self.resident <= self.total:
            raise ValueError(f"expert_cache={self.resident} is outside [{low}, {self.total}]: at least top-k "
                             f"({top_k}) per MoE layer and at most every expert; pick a count in that range")
        self.bytes_per_expert = host.bytes_per_expert  # what an upload moves (a quantized host's blocks: fewer)
        self.slot_gate_up = torch.empty((self.resident, two_i, h), dtype=host.dtype, device=self.device)  # [N, 2I, H]
        self.slot_down = torch.empty((self.resident, h, two_i // 2), dtype=host.dtype, device=self.device)  # [N, H, I]
        self.hits = self.misses = self.upload_bytes = 0
        self.all_resident = self.resident == self.total
        # The device path (docs above); tests force it on the CPU through Triton's interpreter.
        self.device_path = self.device.type == "cuda" and importlib.util.find_spec("triton") is not None and (
            self.all_resident or host.readable_on_device())
        # Per MoE layer, counted by the kernels: tokens routed to each expert, then hits, then misses.
        e = self.num_experts
        self.tally = torch.zeros(n_layers, e + 2, dtype=torch.int32, device=self.device)  # [L, E + 2]
        self.staged = torch.zeros(n_layers, e + 2, dtype=torch.int32, pin_memory=self.device.type == "cuda")
        self.seen = torch.zeros(n_layers, e, dtype=torch.int32)  # routed counts `rebalance` has folded in
        self.resident_mask = torch.zeros(n_layers, e, dtype=torch.bool)  # [L, E], mirrors the layers' slot_of
        self.scores = torch.zeros(n_layers, e, dtype=torch.float64)  # [L, E] routing-frequency scores (docs above)
        # The residency map for the kernels: slot of each expert, `size` (sorting after every slot) when on the
        # host only; kept on the host and sent whole (`push_keys`), each layer's `slot_key` a row of the device copy
        self.key_host = torch.empty(n_layers, e, dtype=torch.int64)  # [L, E]
        self.slot_keys = torch.empty(n_layers, e, dtype=torch.int64, device=self.device)  # [L, E]
        base, extra = divmod(self.resident, n_layers)
        self.layers, start = [], 0
        for row in range(n_layers):
            size = base + (row < extra)
            self.layers.append(LayerExperts(self, row, start, size))
            start += size
        self.slot_keys.copy_(self.key_host)

    def attach(self, blocks) -> None:
        """Hand each MoE block (in `host.layers` order) its layer's view of the cache."""
        for block, layer in zip(blocks, self.layers, strict=True):
            block.experts = layer

    def counters(self) -> dict[str, int]:
        """Cumulative hits, misses and bytes uploaded since construction.

        A miss is a routed expert that had no slot: uploaded for the window on the host-routed
        path, read from host memory by the kernels on the device path (whose uploads are
        `rebalance`'s promotions). The device path's counts live on the device: reading them
        waits for the stream (the executor asks once per cycle, after the cycle's own sync).
        """
        hits, misses = self.hits, self.misses
        if self.device_path:
            device_hits, device_misses = self.tally[:, -2:].sum(0).tolist()
            hits, misses = hits + device_hits, misses + device_misses
        return {"expert_hits": hits, "expert_misses": misses, "expert_upload_bytes": self.upload_bytes}

    def capturable(self, tokens: int) -> bool:
        """Whether windows of up to `tokens` tokens run with no host sync (so a CUDA graph can hold them)."""
        return self.device_path and (self.all_resident or tokens <= DEVICE_WINDOW_TOKENS)

    def rebalance(self) -> None:
        """Between windows, outside any CUDA graph: fold the device path's routing counts into the scores and
        upload the experts that now out-score a resident one. Nothing syncs: the counts were copied to pinned
        memory after the last window, and a copy still in flight only delays a promotion."""
        if self.all_resident or not self.device_path:
            return
        routed = self.staged[:, :self.num_experts].clone()  # [L, E] cumulative
        fresh = (routed - self.seen).clamp_(min=0)
        self.seen = routed
        if not bool(fresh.any()):
            return
        # Every layer at once (torch on the host: a Python loop over 48 layers x 512 experts took ~12 ms a window)
        decay = torch.tensor([_DECAY_PER_TOKEN ** t for t in (fresh.sum(1) // self.top_k).tolist()],
                             dtype=torch.float64)
        self.scores.mul_(decay[:, None]).add_(fresh)
        candidates = (fresh > 0) & ~self.resident_mask  # [L, E] routed, read from the host
        victims = self.resident_mask & (fresh == 0)  # resident, not routed in these windows
        placed = set()
        for _ in range(PROMOTE_PER_LAYER):
            # per layer: the best-scoring candidate (lowest id on ties) for the worst-scoring victim's slot
            best = torch.where(candidates, self.scores, float("-inf")).argmax(1)  # [L]
            worst = torch.where(victims, self.scores, float("inf")).argmin(1)  # [L]
            rows = torch.arange(len(self.layers))
            go = candidates.any(1) & victims.any(1) & (self.scores[rows, best] >= self.scores[rows, worst] + PROMOTE_MARGIN)
            if not bool(go.any()):
                break
            for row in go.nonzero().flatten().tolist():
                layer, new, old = self.layers[row], int(best[row]), int(worst[row])
                layer._place(new, layer.slot_of[old])
                candidates[row, new] = victims[row, old] = False
                placed.add(row)
                self.upload_bytes += self.bytes_per_expert
        if placed:
            self.push_keys()

    def push_keys(self, row: int | None = None) -> None:
        """Send the host's residency map (every layer's, or layer `row`'s) to the device, queued after the uploads
        (no sync).

        Not element writes: `t[i] = n` on a CUDA tensor is a synchronous copy from pageable memory (the H200 run
        of 2026-12-01 counted about 2 extra host syncs per promotion). The map goes from a fresh pinned buffer
        instead, which the caching host allocator keeps alive until the copy has run."""
        src, dst = (self.key_host, self.slot_keys) if row is None else (self.key_host[row], self.slot_keys[row])
        dst.copy_(src.pin_memory() if dst.is_cuda else src.clone(), non_blocking=True)

    def upload(self, row: int, expert: int, slot: int) -> None:
        # Queued on the stream before the expert's GEMM (moe.HostExperts, quant_experts.QuantHostExperts).
        self.host.upload(row, expert, self.slot_gate_up[slot], self.slot_down[slot])

    def tensors(self):
        yield self.slot_gate_up
        yield self.slot_down

    def release(self) -> None:
        """Drop the device slots now (layers and cache refer to each other, so refcounting alone would not)."""
        self.slot_gate_up = self.slot_down = self.tally = self.slot_keys = None
        self.layers = []


class LayerExperts:
    """One MoE layer's slots [start, start+size) of the cache, its residency map and routing scores."""

    def __init__(self, cache: ExpertCache, row: int, start: int, size: int) -> None:
        self.cache, self.row, self.start, self.size = cache, row, start, size
        e = cache.num_experts
        self.slot_of = [-1] * e  # expert -> local slot, -1 when on the host only
        self.expert_in = list(range(size))  # local slot -> expert
        for slot, expert in enumerate(self.expert_in):
            self.slot_of[expert] = slot
            cache.resident_mask[row, expert] = True
            cache.upload(row, expert, start + slot)  # warm start: not counted as misses
        # The same map on the device (non-resident = size, sorting after every slot): a window whose
        # experts are all resident after its uploads groups its rows with no host-built index.
        cache.key_host[row] = torch.tensor([s if s >= 0 else size for s in self.slot_of])
        self.slot_key = cache.slot_keys[row]  # [E], filled when every layer is built
        self.arrivals: torch.Tensor | None = None  # int32 zeros: the few-token kernels' arrival counters

    def compute(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Sum over top-k of weight * expert(x) for every token of the window."""
        # x: [N, H]; ids, weights: [N, k] -> [N, H]
        n, k = ids.shape
        flat = ids.reshape(-1)  # [N*k]
        counts = torch.bincount(flat, minlength=self.cache.num_experts).tolist()  # the layer's one sync
        self._note(counts, n)
        rows = x.new_empty(n * k, x.shape[1])  # [N*k, H]: expert output of each (token, k) pair
        pending = [e for e, c in enumerate(counts) if c]
        routed = len(pending)
        while pending:
            batch, pending = self._make_resident(pending)
            self._run(x, flat, k, batch, counts, rows, whole=len(batch) == routed)
        # A fixed-order reduction over k: the result does not depend on which pass computed a row.
        return (rows.view(n, k, -1) * weights[..., None]).sum(dim=1)

    def compute_device(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """`compute` on the device path: no host sync (so capturable), except a partly resident cache's long window."""
        # x: [N, H]; ids, weights: [N, k] -> [N, H]
        cache, n = self.cache, x.shape[0]
        if self.row == 0 and not (x.is_cuda and torch.cuda.is_current_stream_capturing()):
            cache.rebalance()  # eager windows: the last window's routing decides uploads now (the runner calls it too)
        if n > DEVICE_WINDOW_TOKENS and not cache.all_resident:
            out = self.compute(x, ids, weights)  # a prefill chunk: upload its misses once, one sync
        elif n > DEVICE_WINDOW_TOKENS and _use_grouped_mm(x):
            out = self._grouped_device(x, ids, weights)
        else:
            from draftflow.layers.moe_kernels import counter_size, fused_experts

            slots = slice(self.start, self.start + self.size)
            host = None if cache.all_resident else (cache.host.gate_up[self.row], cache.host.down[self.row])
            if self.arrivals is None:  # first used eagerly (the graph warm-up runs before capture)
                self.arrivals = torch.zeros(counter_size(x.shape[1], cache.slot_down.shape[2]), dtype=torch.int32,
                                            device=x.device)
            out = fused_experts(x, ids, weights, cache.slot_gate_up[slots], cache.slot_down[slots], self.slot_key,
                                cache.tally[self.row], host, counters=self.arrivals)
        if self.row == len(cache.layers) - 1:
            cache.staged.copy_(cache.tally, non_blocking=True)  # for `rebalance`, after the window's last layer
        return out

    def _grouped_device(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Every expert resident, a long window: one grouped GEMM per projection, group offsets computed on the
        device (no bincount: on CUDA it reads its maximum back to the host)."""
        n, k = ids.shape
        slots = slice(self.start, self.start + self.size)
        key = self.slot_key[ids.reshape(-1)]  # [N*k] slot of each (token, k) pair
        order = torch.argsort(key, stable=True)  # [N*k]
        counts = torch.zeros(self.size, dtype=torch.long, device=x.device).scatter_add_(0, key, torch.ones_like(key))
        offs = counts.cumsum(0).to(torch.int32)  # [S]
        tally = self.cache.tally[self.row]  # [E + 2]; slot == expert when every expert is resident
        tally[:self.size] += counts.to(torch.int32)
        tally[-2] += (counts > 0).sum().to(torch.int32)
        gate_up, down = self.cache.slot_gate_up[slots], self.cache.slot_down[slots]
        gate, up = torch._grouped_mm(x[order // k], gate_up.transpose(1, 2), offs=offs).chunk(2, dim=-1)  # [M, I] each
        rows = x.new_empty(n * k, x.shape[1])  # [N*k, H]
        rows[order] = torch._grouped_mm((F.silu(gate) * up).contiguous(), down.transpose(1, 2), offs=offs)
        return (rows.view(n, k, -1) * weights[..., None]).sum(dim=1)

    def _place(self, expert: int, slot: int) -> None:
        """Evict the expert in local `slot` and upload `expert` there (host and device maps, queued: no sync)."""
        old, mask = self.expert_in[slot], self.cache.resident_mask[self.row]
        self.slot_of[old], mask[old] = -1, False
        self.slot_of[expert], self.expert_in[slot], mask[expert] = slot, expert, True
        self.cache.key_host[self.row, old], self.cache.key_host[self.row, expert] = self.size, slot
        self.cache.upload(self.row, expert, self.start + slot)  # the caller then pushes the map: `push_keys`

    def _note(self, counts: list[int], tokens: int) -> None:
        """Decay this layer's scores by `tokens` tokens and add the window's routed counts."""
        self.cache.scores[self.row].mul_(_DECAY_PER_TOKEN ** tokens).add_(torch.tensor(counts, dtype=torch.float64))

    def _make_resident(self, pending: list[int]) -> tuple[list[int], list[int]]:
        """Upload what fits of `pending`; return (experts resident now, experts left for a later pass)."""
        cache, wanted = self.cache, set(pending)
        hits = [e for e in pending if self.slot_of[e] >= 0]
        missing = [e for e in pending if self.slot_of[e] < 0]
        if not missing:
            cache.hits += len(hits)
            return hits, []
        score = self.cache.scores[self.row].tolist()
        free = sorted((s for s in range(self.size) if self.expert_in[s] not in wanted),
                      key=lambda s: (score[self.expert_in[s]], self.expert_in[s]))
        taken = missing[:len(free)]
        for expert, slot in zip(taken, free):
            self._place(expert, slot)
        cache.push_keys(self.row)
        cache.hits += len(hits)
        cache.misses += len(taken)
        cache.upload_bytes += len(taken) * cache.bytes_per_expert
        return hits + taken, missing[len(taken):]

    def _run(self, x: torch.Tensor, flat: torch.Tensor, k: int, batch: list[int], counts: list[int],
             rows: torch.Tensor, whole: bool) -> None:
        """Compute every (token, k) row routed to `batch` as one grouped GEMM over the layer's slots.

        `whole`: the batch is every expert the window routed to, so the device slot map is
        the sort key; otherwise (a pass of a window with more experts than slots) the key is
        built on the host so that experts outside the batch sort last.
        """
        # x: [N, H]; flat: [N*k] expert ids; rows: [N*k, H] (written in place)
        per_slot = [0] * self.size
        for e in batch:
            per_slot[self.slot_of[e]] = counts[e]
        if whole:
            key = self.slot_key[flat]  # [N*k]
        else:
            key_of = [self.size] * self.cache.num_experts  # experts outside the batch sort after every slot
            for e in batch:
                key_of[e] = self.slot_of[e]
            key = torch.tensor(key_of, device=x.device)[flat]  # [N*k]
        order = torch.argsort(key, stable=True)[:sum(per_slot)]  # [M]: (token, k) pairs, grouped by slot
        offs = [0] * self.size
        total = 0
        for s, c in enumerate(per_slot):
            total += c
            offs[s] = total
        slots = slice(self.start, self.start + self.size)
        grouped = self.cache.grouped
        gate_up = grouped_linear(x[order // k], self.cache.slot_gate_up[slots], offs, grouped)  # [M, 2I]
        gate, up = gate_up.chunk(2, dim=-1)
        rows[order] = grouped_linear((F.silu(gate) * up).contiguous(), self.cache.slot_down[slots], offs, grouped)  # [M, H]
