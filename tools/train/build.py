"""The drafter and recipe a `draftflow train` command trains: a new backbone from the shape flags, one grown or
continued from `--init-from`, or an MTP head (`build_recipe`); the shape flags are checked against what
`--init-from` fixes."""

from __future__ import annotations

import attrs

from draftflow.core.errors import DraftflowError, ModelFormatError

MASK_NAMES = ("<|mask|>", "<|MASK|>", "<mask>", "[MASK]")


def build_recipe(a, loaded, labels: str):
    """The recipe (drafter inside) for the parsed flags `a` against the loaded target; `labels` as the recipe takes them."""
    from draftflow.tools.train.loop import init_weights

    target = loaded.model
    if a.recipe == "dflash":
        from draftflow.plugins.dflash.model import DFlashModel
        from draftflow.tools.train.dflash_recipe import DFlashRecipe

        if a.init_from:
            from draftflow.tools.train.dflash2_recipe import init_backbone_config, load_backbone
            from draftflow.tools.train.dflash_recipe import grown_config, zero_new_layers

            base = init_backbone_config(a.init_from, target)
            # more --layers than it has: grown (layers base.num_layers.. are new; none when not grown)
            cfg = grown_config(base, a.layers) if a.layers and a.layers > base.num_layers else base
            _check_shape_flags(a, cfg)
            drafter = DFlashModel(cfg, device=a.device)
            if cfg is not base:
                init_weights(drafter, seed=a.seed)
            load_backbone(drafter, a.init_from, grown_from=base.num_layers)
            zero_new_layers(drafter, base.num_layers)
            drafter.requires_grad_(True)
        else:
            drafter = DFlashModel(_backbone_config(a, loaded), device=a.device)
            init_weights(drafter, seed=a.seed)
        return DFlashRecipe(target, drafter, a.anchors, a.gamma, labels, a.seed, a.distill)
    if a.recipe == "dflash2":
        from draftflow.plugins.dflash.dflash2_config import DFlash2Config
        from draftflow.plugins.dflash.dflash2_loader import is_dflash2
        from draftflow.tools.train.dflash2_recipe import DFlash2Recipe, continue_drafter, init_backbone_config, new_drafter

        if a.init_from and is_dflash2(a.init_from):  # fine-tune a trained DFlash2: its whole shape is fixed
            drafter = continue_drafter(a.init_from, target, device=a.device)
            _check_shape_flags(a, drafter.config2.base, drafter.config2)
        else:
            base = init_backbone_config(a.init_from, target) if a.init_from else _backbone_config(a, loaded)
            _check_shape_flags(a, base)
            try:
                cfg = DFlash2Config(base, a.conv_kernel_size, a.conv_group_size, a.selector_rank, a.selector_top_k)
            except ModelFormatError as exc:  # its fix names config keys; the CLI user sets them with flags
                raise DraftflowError(f"{exc} (the dflash_config keys come from --conv-kernel-size, --conv-group-size, "
                                     "--selector-rank and --selector-top-k)") from None
            drafter = new_drafter(cfg, seed=a.seed, init_from=a.init_from, device=a.device)
        return DFlash2Recipe(target, drafter, a.anchors, a.gamma, labels, a.seed, a.selector_alpha,
                             a.selector_warmup, a.selector_ramp, a.selector_stop_gradient, a.distill)
    from draftflow.tools.train.mtp_recipe import MtpRecipe, new_head

    return MtpRecipe(target, new_head(target, a.seed, a.mtp_layout), labels, a.num_draft)


def _tap_layers(text: str | None, num_target: int, num_draft: int) -> tuple[int, ...]:
    from draftflow.plugins.dflash.config import default_target_layer_ids

    if text:
        try:
            taps = tuple(int(t) for t in text.split(","))
        except ValueError:
            raise DraftflowError(f"--tap-layers {text!r}: expected comma-separated layer numbers like 1,2,3") from None
    else:
        taps = default_target_layer_ids(num_target, num_draft) if num_target >= 8 else tuple(range(1, num_target))
    bad = [t for t in taps if not 0 <= t < num_target]
    if bad or not taps:
        raise DraftflowError(f"--tap-layers {list(taps)}: layers must lie in [0, {num_target}); pick existing layers")
    return taps


def _mask_id(a, tokenizer, vocab: int) -> int:
    if a.mask_token_id is not None:
        mask = a.mask_token_id
    else:
        found = [tokenizer.token_to_id(n) for n in MASK_NAMES if tokenizer.token_to_id(n) is not None]
        if not found:
            raise DraftflowError("the target's tokenizer has no mask token (" + ", ".join(MASK_NAMES) + "); pass "
                                 "--mask-token-id ID with a token the target never needs to emit")
        mask = found[0]
    if not 0 <= mask < vocab:
        raise DraftflowError(f"--mask-token-id {mask} is outside the target's vocabulary of {vocab}")
    return mask


def _backbone_config(a, loaded):
    """A fresh DFlash backbone config from the shape flags (z-lab's defaults: 2 layers, block 8)."""
    from draftflow.tools.train.dflash_recipe import new_config

    layers, tcfg, block = a.layers or 2, loaded.config, a.block_size or 8
    cfg = new_config(loaded.model, layers, block, _tap_layers(a.tap_layers, tcfg.num_layers, layers),
                     _mask_id(a, loaded.tokenizer, tcfg.vocab_size), a.intermediate)
    window = a.seq_len if a.window is None else a.window
    if window and window < block:
        raise DraftflowError(f"--window {window} is shorter than the block of {block}; give --window >= --block-size "
                             "(or 0 for full attention)")
    return attrs.evolve(cfg, layer_types=("sliding_attention",) * layers, sliding_window=window,
                        is_causal=False) if window else cfg


def _check_shape_flags(a, base, dflash2=None) -> None:
    """With --init-from the backbone's shape is the given drafter's (a DFlash2's convolutions and selector too,
    `dflash2` its config); a disagreeing shape flag is a mistake."""
    if not a.init_from:
        return
    given = {"--layers": (a.layers, base.num_layers), "--block-size": (a.block_size, base.block_size),
             "--mask-token-id": (a.mask_token_id, base.mask_token_id),
             "--intermediate": (a.intermediate, base.intermediate_size),
             "--window": (a.window, (base.sliding_window or 0) if "sliding_attention" in base.layer_types else 0),
             "--tap-layers": (_tap_layers(a.tap_layers, base.num_target_layers, 1) if a.tap_layers else None,
                              base.target_layer_ids)}
    for dest in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k") if dflash2 else ():
        given["--" + dest.replace("_", "-")] = (getattr(a, dest) if dest in a.given else None, getattr(dflash2, dest))
    bad = [f"{flag} {mine} (it has {theirs})" for flag, (mine, theirs) in given.items()
           if mine is not None and mine != theirs]
    if bad:
        what = "DFlash2 drafter's" if dflash2 else "backbone's"
        raise DraftflowError(f"--init-from {a.init_from} fixes the {what} shape, but " + ", ".join(bad)
                             + "; drop those flags or pass matching values")
