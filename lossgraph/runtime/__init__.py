"""Running training programs in onnxruntime: sessions, bound state buffers, the Trainer."""

from .session import create_session, training_build_available
from .trainer import Trainer

__all__ = ["Trainer", "create_session", "training_build_available"]
