"""Models built on the meta device draw no initial values: a cold start does not import torch._dynamo."""

from __future__ import annotations

import subprocess
import sys

import torch
from helpers import SMALL_PAIR

from draftflow.layers.meta import embedding

# A fresh interpreter loads the demo's DFlash2 graph (target, DFlash2 drafter with its codebooks) through the public
# Session API, decodes, and says whether anything imported torch._dynamo (~1.2 s of a cold start on its own).
PROBE = f"""
import sys
from draftflow.core.node import SamplingParams
from draftflow.core.session import Session
s = Session.open(graph_path={str(SMALL_PAIR / "demo-dflash2.yaml")!r})
r = s.generate(s.encode("def f(x):"), SamplingParams(max_new_tokens=4))
print(len(r.token_ids), "torch._dynamo" in sys.modules)
"""


def test_a_cold_generate_does_not_import_dynamo():
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["4", "False"], out.stdout + out.stderr


def test_embedding_is_empty_on_meta_and_initialised_elsewhere():
    meta = embedding(10, 4, torch.bfloat16, "meta")
    assert meta.weight.device.type == "meta" and meta.weight.dtype == torch.bfloat16 and meta.weight.shape == (10, 4)
    torch.manual_seed(0)
    real = embedding(10, 4, torch.float32, "cpu")  # training builds on a real device: nn.Embedding's normal init
    torch.manual_seed(0)
    assert torch.equal(real.weight, torch.nn.Embedding(10, 4).weight) and real.weight.std() > 0.5
