"""stalepipe: asynchronous pipeline-parallel LLM pretraining and a gradient-delay emulator.

The package root registers the components (config/registry.py): importing the torch-free
modules that define the delay policies, the pipeline schedules, the optimizers and the LR
schedules fills the registries before any config is validated, whichever `stalepipe.*` module
is imported first.
"""

__version__ = "0.1.0"

# The root exports only the version; the public API is each package's `__all__`
# (docs/api.md: what is stable). Importing the root loads no torch.
__all__ = ["__version__"]

from stalepipe.training.delay import policies as _policies  # noqa: E402, F401
from stalepipe.training.optim import lr_schedule as _lr_schedules  # noqa: E402, F401
from stalepipe.training.optim import specs as _optimizers  # noqa: E402, F401
from stalepipe.training.schedules import generators as _schedules  # noqa: E402, F401
