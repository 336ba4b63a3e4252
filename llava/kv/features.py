"""Image features in pool blocks, held once per image for every session on it
(docs/engine/memory.md §Shared prefixes).

An image's features go into whole pool blocks published under keys made from its content key
(llava.kv.prefix.feature_keys), so a second session on the same image references the same
blocks and nothing is computed or copied; blocks nobody references stay findable until their
room is needed. The memory manager (llava.kv.memory) calls this under its lock and keeps each
holding's references; this module keeps which images are findable and how many pool blocks
hold features.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from llava.kv.budget import blocks_for
from llava.kv.holding import HeldImage, NewImage
from llava.kv.pool import KVPool
from llava.kv.prefix import feature_keys

Shared = tuple[list[int], tuple[int, int]]  # an image's feature blocks and shape


class FeatureStore:
    def __init__(self, pool: KVPool):
        self.pool = pool
        self.blocks = 0  # distinct pool blocks holding features
        self._shapes: OrderedDict[bytes, tuple[int, int]] = OrderedDict()  # by image key

    def blocks_for(self, features: torch.Tensor) -> int:
        return blocks_for(features.numel(), self.pool.block_numel)

    def find(self, image_key: bytes) -> list[int] | None:
        """The blocks of an image's features, if all are still in the pool."""
        shape = self._shapes.get(image_key)
        if shape is None:
            return None
        count = blocks_for(shape[0] * shape[1], self.pool.block_numel)
        blocks = self.pool.match(feature_keys(image_key, count))
        if len(blocks) < count:  # some were reclaimed: the rest go the same way
            del self._shapes[image_key]
            return None
        return blocks

    def shape(self, image_key: bytes) -> tuple[int, int] | None:
        """The shape of an image's features, if all their blocks are still in the pool."""
        return None if self.find(image_key) is None else self._shapes[image_key]

    def share(self, image_key: bytes) -> Shared | None:
        """A new reference to an image's features, if the pool holds them (referenced or
        reclaimable): their blocks and shape."""
        blocks = self.find(image_key)
        if blocks is None:
            return None
        self.blocks += sum(self.pool.refs(b) == 0 for b in blocks)
        self.pool.share(blocks)
        self._shapes.move_to_end(image_key)
        return blocks, self._shapes[image_key]

    def store(self, image_key: bytes | None, features: torch.Tensor) -> Shared:
        """Features in new pool blocks, published under ``image_key`` (None: not shared)."""
        pool = self.pool
        count = self.blocks_for(features)
        blocks = pool.allocate(count)
        data = torch.zeros(pool.blocks_shape(count), dtype=pool.kv.dtype, device=pool.kv.device)
        data.view(-1)[: features.numel()] = features.reshape(-1).to(data.dtype)
        pool.write_blocks(blocks, data)
        shape = (features.shape[0], features.shape[1])
        self.blocks += count
        if image_key is not None:
            for block, block_key in zip(blocks, feature_keys(image_key, count), strict=True):
                pool.publish(block, block_key)
            self._shapes[image_key] = shape
            self._shapes.move_to_end(image_key)
            while len(self._shapes) > pool.total_blocks:  # more than could be held
                self._shapes.popitem(last=False)
        return blocks, shape

    def share_new(self, image: NewImage | None) -> Shared | None:
        """A new reference to a new image's features, where the pool holds them: taken before
        any room is made for the rest, so that making it cannot reclaim them."""
        if image is None or image.key is None:
            return None
        shared = self.share(image.key)
        if shared is None and image.features is None:
            raise ValueError("a new image's features must be given when the pool lacks them")
        return shared

    def to_store(self, image: NewImage | None) -> int:
        """The blocks a new image's features take when they are not shared."""
        return 0 if image is None or image.features is None else self.blocks_for(image.features)

    def held(self, image: NewImage, shared: Shared | None) -> HeldImage:
        """The new image as a holding holds it: on its shared blocks, or stored now."""
        blocks, shape = shared if shared is not None else self.store(image.key, image.features)
        return HeldImage(image.key, shape, blocks)

    def let_go(self, blocks: list[int]) -> None:
        """One holding's references go (a block no one references is free, and stays findable
        under its image's key until its room is needed)."""
        self.blocks -= sum(self.pool.refs(b) == 1 for b in blocks)
        self.pool.give_back(blocks)

    def read(self, blocks: list[int], shape: tuple[int, int]) -> torch.Tensor:
        """The features out of their blocks (a temporary tensor)."""
        rows, hidden = shape
        return self.pool.read_blocks(blocks).view(-1)[: rows * hidden].view(rows, hidden)
