"""Programmatic dependent launch (triton_kernels.pdl): the launch options follow the switch and the device.

The CUDA behaviour (PDL-captured step graphs bit-identical to plain launches) is
tests/plugins/target/test_moe_cuda.py::test_pdl_launches_replay_bit_identical_to_plain_launches.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from draftflow.layers import triton_kernels  # noqa: E402


def test_no_pdl_options_off_the_gpu_or_when_switched_off(monkeypatch):
    assert triton_kernels.pdl(torch.device("cpu")) == {}
    monkeypatch.setattr(triton_kernels, "PDL", False)
    assert triton_kernels.pdl(torch.device("cuda")) == {}  # decided before any CUDA call


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_pdl_options_on_sm90_and_newer():
    want = {"PDL": True, "launch_pdl": True} if torch.cuda.get_device_capability()[0] >= 9 else {}
    assert triton_kernels.pdl(torch.device("cuda")) == want
