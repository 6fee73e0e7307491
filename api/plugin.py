"""draftflow.plugin: everything a plugin author needs, in one public module.

Every built-in plugin imports only from here and from ``draftflow.layers`` (model building
blocks); a test enforces it (tests/test_plugin_imports.py), so a third-party plugin can do
everything a built-in one does. See docs/PLUGINS.md for the contract and a complete drafter.
"""

from draftflow.core.errors import (
    CacheCapacityError,
    CheckError,
    DraftflowError,
    ModelFormatError,
    OwnershipError,
    RequestError,
    SpecError,
)
from draftflow.core.files import file_problem, open_safetensors, read_json_object
from draftflow.core.hookspecs import hookimpl
from draftflow.core.manifest import BATCH, KV_TOKENS, BufferSpec, ExpertPool, Incompatibility, Manifest, Port, Vram, kv_dim
from draftflow.core.node import Batch, CommitInfo, CycleCost, GrammarSpec, Node, NodeContext, RequestState, SamplingParams
from draftflow.core.params import ParamSpec
from draftflow.core.ports import Candidates, Features, Proposal, TargetOutput, Verdict
from draftflow.core.problems import Problem
from draftflow.core.registry import NodeType
from draftflow.core.target import (
    EMBED_BUFFER,
    HEAD_BUFFER,
    TARGET_HANDLE,
    TargetHandle,
    TargetInfo,
    target_info,
    wrong_target_check,
)

__all__ = [
    "BATCH", "Batch", "BufferSpec", "CacheCapacityError", "Candidates", "CheckError", "CommitInfo", "CycleCost", "DraftflowError", "EMBED_BUFFER",
    "ExpertPool", "Features", "GrammarSpec", "HEAD_BUFFER", "Incompatibility", "KV_TOKENS", "Manifest", "ModelFormatError", "Node",
    "NodeContext", "NodeType", "OwnershipError", "ParamSpec", "Port", "Problem", "Proposal", "RequestError",
    "RequestState", "SamplingParams", "SpecError", "TARGET_HANDLE", "TargetHandle", "TargetInfo", "TargetOutput", "Vram", "Verdict",
    "file_problem", "hookimpl", "kv_dim", "open_safetensors", "read_json_object", "target_info", "wrong_target_check",
]
