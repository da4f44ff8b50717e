"""The registry of transforms, in the order they are composed onto a file."""

from .ddtree import GDN as DDTREE_GDN
from .ddtree import PROPOSER as DDTREE_PROPOSER
from .ddtree import SAMPLER as DDTREE_SAMPLER
from .dflash_cpu_knorm import TRANSFORM as DFLASH_CPU_KNORM
from .dflash_layer_offset import TRANSFORM as DFLASH_LAYER_OFFSET
from .dflash_swa import TRANSFORM as DFLASH_SWA

TRANSFORMS = (DFLASH_LAYER_OFFSET, DFLASH_SWA, DFLASH_CPU_KNORM, DDTREE_PROPOSER,
              DDTREE_SAMPLER, DDTREE_GDN)
BY_NAME = {t.name: t for t in TRANSFORMS}
