"""Drop-in replacements for other projects' device helpers, answered by `hal.current()`.

`hal.compat.verl` mirrors `verl.utils.device`. Nothing here is imported by `import hal`.
"""
