"""Example models and offline data sets used by ``scripts/train.py`` and the benchmarks.

``omgs_hook.examples.models``: ``resnet20``, ``vgg16`` and a char-level ``lstm``
(``build_model(name, ...)``). ``omgs_hook.examples.data``: scikit-learn's bundled
digits, a character corpus read from the Python standard library's own source files,
and deterministic synthetic stand-ins - nothing is downloaded.
"""

from omgs_hook.examples.models import MODEL_NAMES, build_model, count_parameters

__all__ = ["MODEL_NAMES", "build_model", "count_parameters"]
