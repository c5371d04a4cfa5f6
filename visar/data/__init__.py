"""Offline data for visar.

`visar.data.shapes` is a seeded 64x64 world of flat-coloured shapes on photographic
backgrounds, with class labels and GenEval-style captions; `visar.eval.detector` scores images
of it. Nothing is imported here so that `import visar.data` stays cheap.
"""
