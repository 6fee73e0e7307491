"""SamplingParams refuses every out-of-range value with a RequestError naming the field."""

from __future__ import annotations

import math

import pytest

from draftflow.core.errors import RequestError
from draftflow.core.node import SamplingParams


@pytest.mark.parametrize("field,value", [("temperature", math.nan), ("temperature", 10**400), ("temperature", -1),
                                         ("top_p", 0), ("top_k", -1), ("seed", 2**70), ("seed", -1),
                                         ("max_new_tokens", 0), ("ignore_eos", "yes")])
def test_bad_value_names_field(field, value):
    """A bad value (NaN, a huge int, out of range, wrong type) is a RequestError naming its field, never another error."""
    with pytest.raises(RequestError, match=f"sampling field '{field}'"):
        SamplingParams(**{field: value})
