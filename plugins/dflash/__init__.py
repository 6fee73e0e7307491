"""DFlash block drafter (z-lab): config, model, artifact loader and the `dflash` node."""
