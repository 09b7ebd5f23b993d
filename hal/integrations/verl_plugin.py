"""The former path of hal.integrations.verl.plugin, kept for the code, configs and entry
points written against it: importing it gives that very module (one module object, so a
patch or an `isinstance` through either path is the same)."""

import sys

from hal.integrations.verl import plugin as _moved

sys.modules[__name__] = _moved
