"""Issue 69: the seeds' words kept (romsto's argument order, --gamma as a fixed γ, EGAG's
defaults, lenience everywhere)."""

from __future__ import annotations

import pytest

from conftest import tiny_model
from specdec.errors import SpecdecError
from specdec.generate import speculative_generate


def test_swapped_roles_are_refused():
    # romsto's order, speculative_generate(inputs, drafter, target), on models the loader marked
    target = tiny_model(0, vocab=16, name="big", role="target")
    drafter = tiny_model(1, vocab=16, name="small", role="drafter")
    with pytest.raises(SpecdecError, match="swapped"):
        speculative_generate([2, 3], drafter, target, max_new_tokens=4)
    assert len(speculative_generate([2, 3], target, drafter, max_new_tokens=4).tokens) == 4


def test_a_drafter_larger_than_the_target_is_refused_unless_allowed():
    small = tiny_model(0, vocab=16, layers=1, name="small")
    large = tiny_model(1, vocab=16, layers=2, name="large")  # both loaded as targets: only sizes tell
    with pytest.raises(SpecdecError, match="larger than the target.*allow_larger_drafter=True"):
        speculative_generate([2, 3], small, large, max_new_tokens=4)
    result = speculative_generate([2, 3], small, large, max_new_tokens=4, allow_larger_drafter=True)
    assert len(result.tokens) == 4
    assert len(speculative_generate([2, 3], large, small, max_new_tokens=4).tokens) == 4


def test_a_model_free_drafter_and_self_drafting_pass_the_role_check():
    from specdec.drafters import LookupDrafter

    target = tiny_model(0, vocab=16, role="drafter")
    assert len(speculative_generate([2, 3, 2, 3], target, LookupDrafter(), max_new_tokens=4).tokens) == 4
    assert len(speculative_generate([2, 3], target, target, max_new_tokens=4).tokens) == 4
