"""EAGLE drafting (Li et al. 2024): EAGLE-2 dynamic trees from a one-layer feature drafter.

The loop hands the drafter the target's final hidden states at every committed position
(`observe`). Each step, the layer (adapters/eagle_layer.py) first reads the positions it has not seen, each as
[embedding of the token; the target's feature one position before], which gives the feature
predicted after the last token and with the frozen head q at the tree's root. The tree then
grows like `Eagle2Drafter`'s, one layer pass per depth under tree attention: a node's input is
[its token; its parent's predicted feature]. After verification the layer's cache drops the whole
tree: the accepted tokens are read again next step with the target's own features, which are
what the layer was trained to read.

The trees are deterministic (top-k siblings), so the one-hot verification law is exact under
every sampler, and greedy output is token-identical to greedy AR.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import torch

from ..backends import Backend, Features
from ..backends.cache import cache_length, crop_cache
from ..adapters.checkpoints import head_rows
from ..adapters.eagle_layer import Eagle, check_eagle_target, load_eagle
from ..core.samplers import Sampler
from ..sizing.schedules import TreeCost
from ..core.trees import tree_attention
from .base import Capabilities, KeepGoing, Proposal
from .eagle2 import Eagle2Drafter
from .nodes import Node


class EagleModel:
    """An EAGLE layer bound to a target, with the surface `Eagle2Drafter` drives: `forward` over
    new tokens (a chain, or tree nodes after `tree_start`) returning logits over the target's ids
    (-inf outside the scored ids), and a cache that `crop_cache`/`compact_cache` handle."""

    tokenizer = None
    max_context = 1 << 30
    role = "drafter"
    num_parameters = None  # a layer over the target's: never compared with it (roles.check_roles)

    def features(self) -> Features:
        """What it does beyond `Backend` (`backends.Features`): token trees, one sequence a pass."""
        return Features()

    def __init__(self, eagle: Eagle):
        self.eagle = eagle
        self.name = "eagle"
        self._features: torch.Tensor | None = None  # [capacity, H] the target's, per position
        self._count = 0  # positions whose target feature is known
        self._root: torch.Tensor | None = None  # [H] predicted feature after the last plain input
        self._nodes: dict[int, torch.Tensor] = {}  # tree region index -> its predicted feature
        self._target = None

    def bind(self, target) -> None:
        """Prepare the layer, the target's embeddings and its head rows on the target's device and dtype."""
        if self._target is target:
            return
        check_eagle_target(self.eagle, target)
        self._target = target
        self._embedding = target.hf.get_input_embeddings()
        self._ids = self.eagle.vocab_ids.to(target.device)
        self._weight = head_rows(target, self._ids).to(target.dtype)
        self._layer = self.eagle.layer_for(target.device, target.dtype)
        self.vocab_size = target.vocab_size
        self.device, self.dtype = target.device, target.dtype

    def reset(self) -> None:
        self._features, self._count, self._root, self._nodes = None, 0, None, {}

    @property
    def known_features(self) -> int:
        return self._count

    def add_features(self, hidden: torch.Tensor) -> None:
        """hidden [n, H]: the target's features at the next n positions."""
        n = len(hidden)
        if self._features is None or self._count + n > len(self._features):
            grown = torch.empty(max(256, 2 * (self._count + n)), hidden.shape[-1], dtype=self.dtype, device=self.device)
            if self._features is not None:
                grown[:self._count] = self._features[:self._count]
            self._features = grown
        self._features[self._count:self._count + n] = hidden.to(self.dtype)
        self._count += n

    @staticmethod
    def new_cache():
        from transformers import DynamicCache

        return DynamicCache()

    @torch.inference_mode()
    def forward(self, input_ids: Sequence[int], cache, num_logits: int = 1, parents: Sequence[int] | None = None,
                tree_start: int | None = None) -> torch.Tensor:
        """New tokens after what `cache` holds -> logits [num_logits, V] fp32 of the last ones.

        A chain (parents None) at positions L.. reads the target's features at L-1..; tree nodes
        (`parents` over the region from `tree_start`, as `Backend.forward`) read their
        parents' predicted features (the root's: the last chain input's prediction)."""
        ids = torch.as_tensor(list(input_ids), dtype=torch.long, device=self.device)
        new, cached = len(ids), cache_length(cache)
        if parents is None:
            if cached + new - 1 > self._count:
                raise RuntimeError(f"EAGLE needs the target's features up to position {cached + new - 2}, "
                                   f"has {self._count}")
            features = self._features[max(0, cached - 1):cached + new - 1]
            if cached == 0:  # nothing precedes the first token
                features = torch.cat([features.new_zeros(1, features.shape[-1]), features])
            mask, positions = tree_attention(list(range(-1, new - 1)), cached, self.dtype, self.device)  # a chain
        else:
            region = list(parents)
            first = len(region) - new
            features = torch.stack([self._root if region[r] < 0 else self._nodes[region[r]]
                                    for r in range(first, len(region))])
            mask, positions = tree_attention(region, tree_start, self.dtype, self.device, new=new)
        out = self._layer(self._embedding(ids).view(1, new, -1).to(self.dtype), features.view(1, new, -1),
                          positions, mask, cache)[0]  # [new, H]
        if parents is None:
            self._root, self._nodes = out[-1], {}
        else:
            for i in range(new):
                self._nodes[first + i] = out[i]
        scored = (out[-num_logits:] @ self._weight.T).float()
        logits = scored.new_full((num_logits, self.vocab_size), float("-inf"))
        logits[:, self._ids] = scored
        return logits


class EagleDrafter(Eagle2Drafter):
    """EAGLE-2 dynamic trees drafted by an EAGLE layer (a checkpoint folder or a loaded `Eagle`)."""

    capabilities = Capabilities(trees=True, batched_passes=True, model=True, catches_up=True,
                                reads_target_hidden=True)

    def __init__(self, eagle: Eagle | str | Path, width: int = 4, max_nodes: int = 64,
                 policy: TreeCost | None = None):
        eagle = eagle if isinstance(eagle, Eagle) else load_eagle(eagle)
        super().__init__(EagleModel(eagle), width, max_nodes, policy)
        self.name = f"eagle+eagle2x{width}"

    def check_target(self, target) -> None:
        self.model.bind(target)
        self.vocab_size = target.vocab_size

    def start(self, prompt: Sequence[int]) -> None:
        super().start(prompt)
        self.model.reset()

    def observe(self, hidden: torch.Tensor) -> None:
        """hidden [n, H]: the target's final hidden states at the positions its last pass committed."""
        self.model.add_features(hidden)

    def proposal(self, context: Sequence[int], max_depth: int, sampler: Sampler,
                  generator: torch.Generator, keep_going: KeepGoing | None = None) -> Proposal:
        if self.model.known_features != len(context) - 1:  # no target pass has read the context yet
            self._parent = {}
            return self._finish(Node(-1, 1.0, "deterministic"), None, [], len(context))
        return (yield from super().proposal(context, max_depth, sampler, generator))

    def keep_path(self, start: int, path: list[int]) -> None:
        drafted = self._take_last_tree(start)
        crop_cache(self.cache, start)  # the path is read again with the target's features
        self._learn(drafted, path)
