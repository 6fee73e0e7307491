"""Public verification math for plugin authors: acceptance rules and target sampling.

    from draftflow.verify import filter_logits, greedy_accept, rejection_sample

    probs = filter_logits(target_logits, temperature=0.7, top_p=0.9)  # [B, K+1, V]
    accepted, emitted = rejection_sample(draft_tokens, probs, draft_probs, generator=g)

The definitions of accepted / recovered / bonus tokens, the three forms of the draft
distribution q and the no-host-sync guarantee are in the docstring of
`draftflow.plugins.verifier.accept`; filtering order and sampling are in
`draftflow.layers.sampling`. Background and the peers these rules follow:
section 3 of the verification reference (`shared/reference/verification_and_mtp.md`).
"""

from draftflow.plugins.verifier.accept import greedy_accept, rejection_sample
from draftflow.layers.sampling import filter_logits, sample

__all__ = ["filter_logits", "greedy_accept", "rejection_sample", "sample"]
