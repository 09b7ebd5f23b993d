"""The former path of hal.integrations.vllm.engines, kept for the code, configs and entry
points written against it: importing it gives that very module (one module object, so a
patch or an `isinstance` through either path is the same)."""

import sys

from hal.integrations.vllm import engines as _moved

sys.modules[__name__] = _moved
