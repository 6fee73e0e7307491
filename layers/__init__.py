"""draftflow.layers: the model building blocks every built-in model and third-party plugin may use.

- ``norm``: RMSNorm.  ``rope``: the one RoPE table builder (every scaling) and the rotation.
- ``attention``: attention over a fixed cache prefix (buckets) and its SDPA backend;
  ``triton_kernels``: the Triton split-KV attention and fused q/k-norm + RoPE + KV write (CUDA).
- ``kv_cache``: the position-addressed KV cache.  ``linear_state``: Gated DeltaNet states.
- ``decoder``: the Qwen3/Llama/Qwen3-Next decoder layer; ``gdn``: Gated DeltaNet; ``moe``,
  ``expert_cache``: sparse MoE blocks and their device expert cache.
- ``graphs``: the one CUDA-graph runner (``GraphCache``).
- ``fused``: the small pieces (RMSNorm, add + norm, q/k-norm + RoPE, SiLU gate) plain,
  torch.compile'd or Triton (``Kernels``), and ``fuse_projections``.
- ``config``: the decoder config (config.json / GGUF header); ``gguf_names``: HF <-> GGUF names.
- ``sampling``: temperature / top-k / top-p / min-p filtering and sampling; ``processors``: penalties,
  logit bias and grammar masks over a verify window, each row given the drafts before it.
- ``grammar``: structured output through llguidance (``GrammarCompiler`` / ``GrammarMatcher``).

Modules are imported by name (``from draftflow.layers.norm import RMSNorm``), so importing
one does not load Triton or the others.
"""
