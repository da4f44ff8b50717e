"""The registry of transforms, in the order they are composed onto a file."""

from .dflash_layer_offset import TRANSFORM as DFLASH_LAYER_OFFSET

TRANSFORMS = (DFLASH_LAYER_OFFSET,)
BY_NAME = {t.name: t for t in TRANSFORMS}
