"""``python -m onnx_training_ops.bench``: the bench CLI (the worker processes run this)."""

import sys

from . import main

sys.exit(main())
