"""DFlash2: the DFlash backbone with grouped dynamic causal convolutions, plus the candidate selector.

Every attention and MLP sublayer is wrapped by a `GroupedDynamicConv`: its normed input u
is convolved over the block rows before the sublayer ("prepare", side 0) and the
sublayer's output is convolved again before the residual add ("finish", side 1). The
coefficient of channel c, tap t at block row i is `base[s, t, c] + d_i[s, t, group(c)]`
with the dynamic kernel `d_i = W_proj · u_i` computed once from the sublayer input, so
both sides use row i's own kernel. The convolution is causal inside the block with zero
padding before row 0: no state is carried from the context or the previous block.

The backbone is `DFlashModel` unchanged: it calls the wrappers through the
`attention_conv` / `mlp_conv` slots of its layers. Module names equal the checkpoint
names (`layers.N.attention_conv.base_kernel`, `candidate_selector.*`).

`walk` is the selector's decode: score_n[k] = U_n[k] + <A(prev_n) ⊙ W_hid h_n, S(C_n[k])>,
greedy at temperature 0, sampled from softmax(score_n / T) over the M candidates above.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from draftflow.layers.sampling import sample
from draftflow.plugins.dflash.dflash2_config import DFlash2Config
from draftflow.plugins.dflash.model import DFlashModel


class GroupedDynamicConv(nn.Module):
    """Causal convolution over block rows with a base kernel plus a per-row kernel per channel group."""

    def __init__(self, hidden_size: int, kernel_size: int, group_size: int, dtype: torch.dtype, device) -> None:
        super().__init__()
        self.kernel_size, self.group_size = kernel_size, group_size
        self.num_groups = hidden_size // group_size
        # Identity init (tap 0 = 1, projection 0) is an exact no-op; loading replaces both.
        base = torch.zeros(2, kernel_size, hidden_size, dtype=dtype, device=device)
        if base.device.type != "meta":
            base[:, 0] = 1.0
        self.base_kernel = nn.Parameter(base)  # [2, K, H]
        self.kernel_projection = nn.Linear(hidden_size, 2 * kernel_size * self.num_groups, bias=False,
                                           dtype=dtype, device=device)

    def prepare(self, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Side-0 convolution of the sublayer input; returns it and the side-1 kernel for `finish`."""
        # u: [1, W, H]; returns [1, W, H] and dynamic [1, W, K, groups]
        dynamic = self.kernel_projection(u).view(*u.shape[:-1], 2, self.kernel_size, self.num_groups)
        return self._convolve(u, dynamic[..., 0, :, :], 0), dynamic[..., 1, :, :]

    def finish(self, y: torch.Tensor, dynamic: torch.Tensor) -> torch.Tensor:
        """Side-1 convolution of the sublayer output with the kernel computed from its input."""
        # y: [1, W, H]; dynamic: [1, W, K, groups]; returns [1, W, H]
        return self._convolve(y, dynamic, 1)

    def _convolve(self, z: torch.Tensor, dynamic: torch.Tensor, side: int) -> torch.Tensor:
        # z: [1, W, H]; dynamic: [1, W, K, groups]; returns [1, W, H]
        b, width, _ = z.shape
        grouped = z.view(b, width, self.num_groups, self.group_size)  # [1, W, g, G]
        out = torch.zeros_like(grouped)
        for tap in range(min(self.kernel_size, width)):  # taps reaching before row 0 see only zeros
            # Row i reads row i - tap; the first `tap` rows read the zero padding.
            shifted = grouped if tap == 0 else F.pad(grouped[:, :width - tap], (0, 0, 0, 0, tap, 0))
            base = self.base_kernel[side, tap].view(self.num_groups, self.group_size).to(z.dtype)
            out = out + base * shifted
            out = torch.addcmul(out, dynamic[:, :, tap, :, None], shifted)
        return out.view_as(z)


class CandidateSelector(nn.Module):
    """Codebooks and hidden projection of the pairwise candidate score."""

    def __init__(self, cfg: DFlash2Config, dtype: torch.dtype, device) -> None:
        super().__init__()
        v, r, h = cfg.vocab_size, cfg.selector_rank, cfg.base.hidden_size
        self.predecessor_codebook = nn.Embedding(v, r, dtype=dtype, device=device)  # A: [V, R]
        self.successor_codebook = nn.Embedding(v, r, dtype=dtype, device=device)  # S: [V, R]
        self.hidden_projection = nn.Linear(h, r, bias=False, dtype=dtype, device=device)  # W_hid: [R, H]


class DFlash2Model(DFlashModel):
    """`DFlashModel` with both convolutions in every layer and the selector's weights."""

    def __init__(self, cfg: DFlash2Config, dtype: torch.dtype = torch.float32, device=None) -> None:
        super().__init__(cfg.base, dtype=dtype, device=device)
        self.config2 = cfg
        h, k, g = cfg.base.hidden_size, cfg.conv_kernel_size, cfg.conv_group_size
        for layer in self.layers:
            layer.attention_conv = GroupedDynamicConv(h, k, g, dtype, device)
            layer.mlp_conv = GroupedDynamicConv(h, k, g, dtype, device)
        self.candidate_selector = CandidateSelector(cfg, dtype, device)
        self.requires_grad_(False)


def walk(
    selector: CandidateSelector,
    ids: torch.Tensor,  # [1, K, M] candidate ids per draft row
    unary: torch.Tensor,  # [1, K, M] their unary logits
    hidden: torch.Tensor,  # [1, K, H] final-normed drafter hidden states of the draft rows
    anchor: torch.Tensor,  # [1] int64, the predecessor of row 1
    temperature: float,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:  # drafts [1, K], q [1, K, M] float32 (None at T = 0)
    """Walk the draft rows left to right, each row's predecessor being the previous row's pick.

    No host synchronisation: the predecessor stays a device tensor between rows.
    """
    z = selector.hidden_projection(hidden)  # [1, K, R]
    successors = selector.successor_codebook(ids)  # [1, K, M, R]
    prev = anchor
    drafts, q_rows = [], []
    for n in range(ids.shape[1]):
        pair = selector.predecessor_codebook(prev) * z[:, n]  # [1, R]
        scores = unary[:, n] + torch.einsum("br,bmr->bm", pair, successors[:, n])  # [1, M]
        if temperature > 0:
            q = (scores.float() / temperature).softmax(dim=-1)  # [1, M]
            pick = sample(q, generator)  # [1]
            q_rows.append(q)
        else:
            pick = scores.argmax(dim=-1)  # [1]
        prev = ids[:, n].gather(-1, pick[:, None])[:, 0]  # [1]
        drafts.append(prev)
    return torch.stack(drafts, dim=1), (torch.stack(q_rows, dim=1) if q_rows else None)
