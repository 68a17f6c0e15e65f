"""A model's vocabulary (``Vocabulary``: token bytes, specials, stops) and where it comes
from: BPE files, a model directory or a ``transformers`` tokenizer (``load_vocabulary``)."""

from .vocabulary import Vocabulary, load_vocabulary

__all__ = ["Vocabulary", "load_vocabulary"]
