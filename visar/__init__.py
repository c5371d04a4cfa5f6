"""visar: faster sampling for image autoregressive models, behind one interface.

import visar
pipe = visar.load("default")
out = pipe.generate(class_labels=[0, 1], method="ar", seed=0)
out.images[0].save("0.png"); print(out.stats)
"""

from .accel import list_methods
from .errors import VisarError
from .loading import load
from .pipeline import GenerationOutput, Pipeline
from .registry import list_models

__all__ = ["GenerationOutput", "Pipeline", "VisarError", "list_methods", "list_models", "load"]
__version__ = "0.1.0"
