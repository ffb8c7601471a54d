"""Which model is the target and which the drafter: a pair passed the wrong way round is refused.

`speculative_generate(prompt_ids, target, drafter)` runs whatever it is given, and a drafter in
the target's place is sampled exactly: the output then follows the small model's law, silently.
Code ported from romsto/Speculative-Decoding (`speculative_generate(inputs, drafter, target)`)
does just that, so the entry points check the pair first: the roles the loader gave the models
(`specdec.load(..., role=)`), and their sizes (a drafter larger than its target is refused
unless the caller says it is meant).
"""

from __future__ import annotations

from ..backends import declares_features
from ..drafters.base import Drafter, capabilities_of
from ..drafters.multi import MultiDrafter
from ..errors import SpecdecError


def parameter_count(model) -> int | None:
    """The weights a loaded model holds (the backend's declared `num_parameters`), or None where
    it cannot tell."""
    count = model.num_parameters
    return None if count is None else int(count)


def drafter_model(drafter):
    """The model a drafter drafts with: a backend itself, a drafter's declared model
    (`Capabilities.model`), else None (a model-free drafter, a factory)."""
    if declares_features(drafter):
        return drafter
    if isinstance(drafter, Drafter) and capabilities_of(drafter).model:
        return drafter.model
    return None


def check_roles(target, drafter, allow_larger_drafter: bool = False, cli: bool = False) -> None:
    """SpecdecError when `target` and `drafter` look swapped: the loader marked them the other way
    round (role "drafter" in the target's place and "target" in the drafter's), or the drafter
    holds more parameters than the target (unless `allow_larger_drafter`). A drafter that is no
    model (n-gram, lookup) and the target drafting for itself pass; a drafter of several
    (multi-draft) is checked member by member. cli: the error names the command's flags."""
    for member in drafter.drafters if isinstance(drafter, MultiDrafter) else ():
        check_roles(target, member, allow_larger_drafter, cli)
    model = drafter_model(drafter)
    if model is None or model is target:
        return
    fix = "give them as --target and --drafter the other way round" if cli else \
        "pass them as speculative_generate(prompt_ids, target, drafter)"
    allow = "--allow-larger-drafter" if cli else "allow_larger_drafter=True"
    if target.role == "drafter" and model.role == "target":
        raise SpecdecError(f"the target and the drafter are swapped: {target.name} was "
                           f"loaded as a drafter and {model.name} as a target; {fix} "
                           "(the romsto code's order is (inputs, drafter, target))")
    if allow_larger_drafter:
        return
    target_size, drafter_size = parameter_count(target), parameter_count(model)
    if target_size is not None and drafter_size is not None and drafter_size > target_size:
        raise SpecdecError(f"the drafter ({model.name}, {drafter_size:,} parameters) "
                           f"is larger than the target ({target.name}, "
                           f"{target_size:,}): the output would follow the drafter's law; swap them "
                           f"({fix}), or pass {allow} if that is meant")
