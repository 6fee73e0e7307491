"""Gated DeltaNet: the linear-attention mixer of Qwen3-Next-style hybrid targets.

Per value head the layer keeps a [Dk, Dv] state S and, per token t,
    S <- exp(g_t) S;   S <- S + k_t (beta_t (v_t - S^T k_t))^T;   o_t = S^T q_t
with q, k L2-normalised (q also scaled by Dk^-1/2), beta = sigmoid(b) and the decay
g = -exp(A_log) softplus(a + dt_bias). q, k and v first pass a depthwise causal conv
(kernel K, SiLU) whose last K-1 inputs are the layer's conv state; the output goes
through an RMSNorm gated by silu(z) and `out_proj`.

Two ways through a window, both over `LinearState` (see linear_state.py):
- windows of at most `max_window` tokens (decode, verify) run the token recurrence
  and record the state after every position, so rollback is a selection; on CUDA that is
  the Triton kernels of gdn_kernels.py (windows of up to 32 tokens: conv, recurrence and
  gated norm in three launches), elsewhere the token-by-token torch loop, the reference;
- longer windows (prefill chunks) use the chunked (WY / UT-transform) form, which is
  matmul-bound; on CUDA it is flash-linear-attention's `chunk_gated_delta_rule` when
  `fla` is importable (extra `draftflow[fla]`), else the pure-torch chunk loop below.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from draftflow.layers.config import TargetConfig
from draftflow.layers.linear_state import LinearState, delta_step

CHUNK = 64

try:  # optional CUDA kernels; the CPU path never needs them
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule as _fla_chunk
except Exception:  # noqa: BLE001 - any import failure (no triton, no CUDA build) means "not available"
    _fla_chunk = None


def fla_available() -> bool:
    return _fla_chunk is not None


class GatedRMSNorm(nn.Module):
    """RMSNorm over each value head, then * silu(gate) in float32 (the FLA / HF order)."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype, device) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim, dtype=dtype, device=device))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        # x, gate: [..., Dv]
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * h.to(x.dtype) * F.silu(gate.float())).to(x.dtype)


class GatedDeltaNet(nn.Module):
    def __init__(self, cfg: TargetConfig, dtype: torch.dtype, device, use_fla: bool = True) -> None:
        super().__init__()
        kw = {"dtype": dtype, "device": device}
        h = cfg.hidden_size
        self.hk, self.hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.dk, self.dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.key_dim, self.value_dim = self.hk * self.dk, self.hv * self.dv
        self.kernel = cfg.linear_conv_kernel
        self.in_proj_qkvz = nn.Linear(h, 2 * self.key_dim + 2 * self.value_dim, bias=False, **kw)
        self.in_proj_ba = nn.Linear(h, 2 * self.hv, bias=False, **kw)
        conv_dim = cfg.linear_conv_dim
        self.conv1d = nn.Conv1d(conv_dim, conv_dim, self.kernel, groups=conv_dim, bias=False, **kw)
        self.dt_bias = nn.Parameter(torch.empty(self.hv, **kw))
        self.A_log = nn.Parameter(torch.empty(self.hv, **kw))
        self.norm = GatedRMSNorm(self.dv, cfg.rms_norm_eps, dtype, device)
        self.out_proj = nn.Linear(self.value_dim, h, bias=False, **kw)
        self.use_fla = use_fla
        # Recorded windows through gdn_kernels: None = on CUDA; True also on the CPU (Triton's interpreter, tests);
        # False = the token-by-token torch loop everywhere.
        self.verify_kernel: bool | None = None

    def _split(self, x: torch.Tensor):
        # x: [B, T, H] -> mixed [B, T, conv_dim], z [B, T, Hv, Dv], b, a [B, T, Hv]
        bsz, t, _ = x.shape
        r = self.hv // self.hk
        qkvz = self.in_proj_qkvz(x).view(bsz, t, self.hk, 2 * self.dk + 2 * r * self.dv)
        q, k, v, z = qkvz.split([self.dk, self.dk, r * self.dv, r * self.dv], dim=-1)  # grouped per key head
        b, a = self.in_proj_ba(x).view(bsz, t, self.hk, 2 * r).split([r, r], dim=-1)
        mixed = torch.cat([q.reshape(bsz, t, -1), k.reshape(bsz, t, -1), v.reshape(bsz, t, -1)], dim=-1)
        return mixed, z.reshape(bsz, t, self.hv, self.dv), b.reshape(bsz, t, self.hv), a.reshape(bsz, t, self.hv)

    def forward(self, x: torch.Tensor, state: LinearState, slot: int, recorded: bool) -> torch.Tensor:
        """Run a window (T tokens after `state.length`); write candidate states, never the committed ones."""
        # x: [B, T, H]; returns [B, T, H]
        bsz, t, _ = x.shape
        if recorded and self._kernel_takes(x, t):
            return self._kernel_window(x, state, slot)
        mixed, z, b, a = self._split(x)
        tail = state.kernel_tail
        tape = state.conv[slot]  # [B, C, K-1 + max(W, K-1)]
        if recorded:  # window inputs go right after the committed ones: the conv reads one slice
            tape[..., tail:tail + t] = mixed.transpose(1, 2)
            seq = tape[..., :tail + t]
        else:
            seq = torch.cat([tape[..., :tail], mixed.transpose(1, 2)], dim=-1)  # [B, C, K-1+T]
            tape[..., tail:2 * tail] = seq[..., -tail:]
        conv = F.silu(F.conv1d(seq, self.conv1d.weight, groups=seq.shape[1]))  # [B, C, T]
        q, k, v = conv.transpose(1, 2).split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        beta = b.float().sigmoid()  # [B, T, Hv]
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)  # [B, T, Hv], log decay
        q, k = (_l2norm(y.reshape(bsz, t, self.hk, self.dk).float()) for y in (q, k))
        r = self.hv // self.hk
        q, k = q.repeat_interleave(r, dim=2) * self.dk ** -0.5, k.repeat_interleave(r, dim=2)  # [B, T, Hv, Dk]
        v = v.reshape(bsz, t, self.hv, self.dv).float()
        rec = state.rec[slot]  # [slots, B, Hv, Dk, Dv] float32
        if recorded:
            out = self._recurrent(q, k, v, g, beta, rec, state, slot)
        elif self.use_fla and _fla_chunk is not None and x.is_cuda and x.dtype != torch.float32:  # fla's dots are TF32
            out, final = _fla_chunk(q.to(x.dtype), k.to(x.dtype), v.to(x.dtype), g, beta.to(x.dtype), scale=1.0,
                                    initial_state=rec[0], output_final_state=True)
            rec[1] = final
        else:
            out, rec[1] = chunk_gated_delta(q, k, v, g, beta, rec[0])
        out = self.norm(out.to(x.dtype), z)  # [B, T, Hv, Dv]
        return self.out_proj(out.reshape(bsz, t, self.value_dim))

    def _kernel_takes(self, x: torch.Tensor, t: int) -> bool:
        if not (x.is_cuda if self.verify_kernel is None else self.verify_kernel):
            return False
        from draftflow.layers import gdn_kernels  # imports Triton: CUDA (or interpreter) only

        return gdn_kernels.supported(self.dk, self.dv, self.kernel, t)

    def _kernel_window(self, x: torch.Tensor, state: LinearState, slot: int) -> torch.Tensor:
        """The recorded window in three launches (gdn_kernels.py); the same math as the torch path below."""
        # x: [B, T, H]; returns [B, T, H]
        from draftflow.layers import gdn_kernels

        bsz, t, _ = x.shape
        qkvz = self.in_proj_qkvz(x)  # [B, T, Hk * (2Dk + 2r Dv)]
        journal = state.journal[slot] if state.mode != "select" else None
        out = gdn_kernels.window(qkvz, self.in_proj_ba(x), state.conv[slot], self.conv1d.weight, self.A_log,
                                 self.dt_bias, state.rec[slot], journal, self.hk, self.dk, self.dv)  # [B, T, Hv, Dv]
        z = qkvz.reshape(bsz, t, self.hk, -1)[..., 2 * self.dk + (self.hv // self.hk) * self.dv:]  # [B, T, Hk, r Dv]
        out = gdn_kernels.gated_norm(out, z, self.norm.weight, self.norm.eps)
        return self.out_proj(out.reshape(bsz, t, self.value_dim))

    @staticmethod
    def _recurrent(q, k, v, g, beta, rec, state: LinearState, slot: int) -> torch.Tensor:
        # q, k: [B, T, Hv, Dk]; v: [B, T, Hv, Dv]; g, beta: [B, T, Hv]; returns [B, T, Hv, Dv] float32
        select = state.mode == "select"
        if not select:  # replay mode journals the recurrence inputs instead of the states
            state.journal[slot, :q.shape[1]] = torch.cat([k, v, g[..., None], beta[..., None]], dim=-1).transpose(0, 1)
        s, outs = rec[0], []
        for i in range(q.shape[1]):
            s = delta_step(s, k[:, i], v[:, i], g[:, i].exp(), beta[:, i])
            outs.append((q[:, i].unsqueeze(-2) @ s).squeeze(-2))
            if select:
                rec[i + 1] = s
        return torch.stack(outs, dim=1)


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def chunk_gated_delta(q, k, v, g, beta, state: torch.Tensor, chunk: int = CHUNK):
    """The gated delta rule over a long sequence in chunks: exact, but matmuls instead of T small steps.

    Inside a chunk the T sequential rank-one updates are folded with the UT transform
    (a unit-lower-triangular solve), so only the chunk boundaries are sequential.
    """
    # q, k: [B, T, H, Dk] (q pre-scaled); v: [B, T, H, Dv]; g, beta: [B, T, H]; state: [B, H, Dk, Dv] float32
    # returns (out [B, T, H, Dv] float32, final state [B, H, Dk, Dv])
    bsz, t, h, _ = q.shape
    pad = -t % chunk
    q, k, v = (F.pad(y.transpose(1, 2), (0, 0, 0, pad)) for y in (q, k, v))  # [B, H, T', D]
    g, beta = (F.pad(y.transpose(1, 2), (0, pad)) for y in (g, beta))  # [B, H, T']
    n = q.shape[2] // chunk
    q, k, v = (y.reshape(bsz, h, n, chunk, -1) for y in (q, k, v))
    g, beta = g.reshape(bsz, h, n, chunk), beta.reshape(bsz, h, n, chunk)
    cum = g.cumsum(-1)  # log decay from the chunk start through position i
    future = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(future, float("-inf")).exp()  # [.., i, j]: j -> i
    kb = k * beta[..., None]
    # (I + strictly-lower(diag(beta) K K^T * decay)) u = beta v, and the same for the state read-out keys;
    # `unitriangular` makes the solve read only the strict lower triangle and assume ones on the diagonal.
    system = (kb @ k.transpose(-1, -2)) * decay
    values = torch.linalg.solve_triangular(system, v * beta[..., None], upper=False, unitriangular=True)
    read_keys = torch.linalg.solve_triangular(system, kb * cum.exp()[..., None], upper=False, unitriangular=True)
    attn = (q @ k.transpose(-1, -2)) * decay  # causal incl. the diagonal
    q_decayed = q * cum.exp()[..., None]
    k_to_end = k * (cum[..., -1:] - cum).exp()[..., None]
    out = torch.empty_like(v)
    s = state.float()
    for c in range(n):
        u = values[:, :, c] - read_keys[:, :, c] @ s  # new values with what the state already predicts removed
        out[:, :, c] = q_decayed[:, :, c] @ s + attn[:, :, c] @ u
        s = s * cum[:, :, c, -1].exp()[..., None, None] + k_to_end[:, :, c].transpose(-1, -2) @ u
    out = out.reshape(bsz, h, n * chunk, -1)[:, :, :t].transpose(1, 2)
    return out, s
