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
`pair_scores` computes it for every predecessor a row can have, in one product.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from draftflow.layers import cpu_linear
from draftflow.layers.meta import embedding
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
        self.kernel_projection = cpu_linear.Linear(hidden_size, 2 * kernel_size * self.num_groups, bias=False,
                                                   dtype=dtype, device=device)
        self.triton = False  # `DFlash2Model.use_triton`: one Triton kernel a convolution (conv_kernel.py)

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
        if self.triton:
            from draftflow.plugins.dflash.conv_kernel import grouped_dynamic_conv

            return grouped_dynamic_conv(z.contiguous(), dynamic, self.base_kernel[side], self.group_size)
        b, width, _ = z.shape
        grouped = z.view(b, width, self.num_groups, self.group_size)  # [1, W, g, G]
        base = self.base_kernel[side].view(self.kernel_size, self.num_groups, self.group_size).to(z.dtype)
        coef = base + dynamic[..., None]  # [1, W, K, g, G]: row i's coefficient of tap t, channel c
        out = coef[:, :, 0] * grouped
        for tap in range(1, min(self.kernel_size, width)):  # taps reaching before row 0 see only zeros
            # Row i reads row i - tap; the first `tap` rows read the zero padding.
            out = torch.addcmul(out, coef[:, :, tap], F.pad(grouped[:, :width - tap], (0, 0, 0, 0, tap, 0)))
        return out.view_as(z)


class CandidateSelector(nn.Module):
    """Codebooks and hidden projection of the pairwise candidate score."""

    def __init__(self, cfg: DFlash2Config, dtype: torch.dtype, device) -> None:
        super().__init__()
        v, r, h = cfg.vocab_size, cfg.selector_rank, cfg.base.hidden_size
        self.predecessor_codebook = embedding(v, r, dtype, device)  # A: [V, R]
        self.successor_codebook = embedding(v, r, dtype, device)  # S: [V, R]
        self.hidden_projection = cpu_linear.Linear(h, r, bias=False, dtype=dtype, device=device)  # W_hid: [R, H]


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

    def use_triton(self) -> bool:
        """`DFlashModel.use_triton`, and each convolution as one Triton kernel."""
        took = super().use_triton()
        for layer in self.layers:
            layer.attention_conv.triton = layer.mlp_conv.triton = took
        return took


def pair_scores(
    selector: CandidateSelector,
    ids: torch.Tensor,  # [B, K, M] candidate ids per draft row
    unary: torch.Tensor,  # [B, K, M] their unary logits
    hidden: torch.Tensor,  # [B, K, H] final-normed drafter hidden states of the draft rows
    anchor: torch.Tensor,  # [B] int64, the predecessor of row 1
) -> torch.Tensor:  # [B, K, M, M] float: score of candidate m of row n after predecessor p
    """Every row's candidate scores for every predecessor the walk can reach, in one batched product.

    Row n's predecessor is one of row n-1's M candidates (row 1's is the anchor, so its M
    predecessor rows are equal): score[b, n, p, m] = U_n[m] + <A(C_{n-1}[p]) ⊙ W_hid h_n, S(C_n[m])>.
    """
    z = selector.hidden_projection(hidden)  # [B, K, R]
    successors = selector.successor_codebook(ids)  # [B, K, M, R]
    before = torch.cat([anchor[:, None, None].expand(-1, 1, ids.shape[2]), ids[:, :-1]], dim=1)  # [B, K, M]
    pair = selector.predecessor_codebook(before) * z[:, :, None]  # [B, K, M, R]
    return unary[:, :, None] + torch.einsum("bkpr,bkmr->bkpm", pair, successors)


def walk(
    selector: CandidateSelector,
    ids: torch.Tensor,  # [B, K, M] candidate ids per draft row
    unary: torch.Tensor,  # [B, K, M] their unary logits
    hidden: torch.Tensor,  # [B, K, H] final-normed drafter hidden states of the draft rows
    anchor: torch.Tensor,  # [B] int64, the predecessor of row 1
    temperature: float,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:  # drafts [B, K], q [B, K, M] float32 (None at T = 0)
    """Walk the draft rows left to right, each row's predecessor being the previous row's pick.

    The scores of every (predecessor, candidate) pair come from one product (`pair_scores`).
    At T = 0 the picks are composed on the device (`greedy_walk`: one argmax and log2(K)
    gathers, no host read). At T > 0 each row draws on the device from softmax(score / T),
    in row order, with `generator`.
    """
    scores = pair_scores(selector, ids, unary, hidden, anchor)  # [B, K, M, M]
    if temperature <= 0:
        return greedy_walk(scores, ids), None
    b, k, m = ids.shape
    rows = torch.arange(b, device=ids.device)
    pick = torch.zeros(b, dtype=torch.long, device=ids.device)  # row 1: every predecessor row is the anchor's
    drafts, q_rows = [], []
    for n in range(k):
        q = (scores[rows, n, pick].float() / temperature).softmax(dim=-1)  # [B, M]
        pick = sample(q, generator)  # [B]
        q_rows.append(q)
        drafts.append(ids[:, n].gather(-1, pick[:, None])[:, 0])
    return torch.stack(drafts, dim=1), torch.stack(q_rows, dim=1)


def greedy_walk(scores: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Greedy picks over `pair_scores` on the device, with no host read (argmax: the first of equal scores).

    Row n's pick is best[n, pick of row n-1], best[n, p] = argmax_m scores[n, p, m]: a chain of
    K lookups. They are composed by doubling (round r: row n's map after row n-r's), so the
    walk is one argmax and log2(K) gathers, not K dependent steps or a host round trip (the
    host walk stalled the cycle on the drafter before the target's window could launch).
    """
    # scores: [B, K, M, M]; ids: [B, K, M]; returns drafts [B, K] on ids' device
    chain = scores.argmax(dim=-1)  # [B, K, M]: row n's pick after each predecessor index p
    k, step = chain.shape[1], 1
    while step < k:  # chain[:, n] becomes row n's pick as a function of row n-2*step's (row 0's: every p equal)
        chain = torch.cat([chain[:, :step], chain[:, step:].gather(2, chain[:, :-step])], dim=1)
        step *= 2
    picks = chain[:, :, :1]  # [B, K, 1]: from row 1's predecessor, the anchor (index 0: its M rows are equal)
    return ids.gather(2, picks)[:, :, 0]
