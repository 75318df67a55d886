"""Suite-wide settings: quiet TensorFlow logs, no third-party plugins leaking in from the environment."""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")
