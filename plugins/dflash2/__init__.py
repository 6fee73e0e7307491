"""DFlash2 drafter: DFlash backbone + grouped dynamic convolutions, and its candidate selector nodes."""
