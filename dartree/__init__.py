"""dartree: lossless speculative decoding with block-diffusion drafters and draft trees.

    import dartree
    drafter = dartree.load_drafter(folder, target)
    dec = dartree.SpeculativeDecoder(target, drafter, method="dartree", budget=63)
    res = dec.generate(input_ids, max_new_tokens=256)
"""

__version__ = "0.1.0"

from . import ops
from .decoding import METHODS, GenerationResult, SpeculativeDecoder
from .defaults import default_models
from .drafter import Drafter, load_drafter, save_drafter
from .exact_mode import exact
from .gguf import load_gguf
from .sampling import PositionKeyedSampler
from .tree import DraftTree

__all__ = ["METHODS", "Drafter", "DraftTree", "GenerationResult", "PositionKeyedSampler",
           "SpeculativeDecoder", "default_models", "exact", "load_drafter", "load_gguf", "ops", "save_drafter",
           "__version__"]
