"""stalepipe: asynchronous pipeline-parallel LLM pretraining and a gradient-delay emulator."""

__version__ = "0.1.0"
