"""Next-set decoding of raster models: ZipAR, ZipAR with speculative Jacobi row fronts, and the exact wavefront.

Papers and the code the schedule was checked against:
- ZipAR: He et al., "ZipAR: Parallel Auto-regressive Image Generation through Spatial Locality",
  ICML 2025 (arXiv 2412.04062); ThisisBillhe/ZipAR, `LlamaGen-ZipAR/autoregressive/models/generate_zipar.py`
  (the schedule) and `Lumina-mGPT-ZipAR/lumina_mgpt/model/chameleon/modeling_chameleon.py` (the
  visibility rule kept here).
- Wavefront (staggered) decoding: HEVC wavefront parallel processing; ParallelNeLLoC (arXiv 2201.05213).

Token (r, c) of the H x W grid may be predicted once row r - 1 has min(c + s, W) tokens, and every
started, unfinished row (a front) advances in the same forward pass. The schedule, the visibility
rule, row starts, what is approximated, Jacobi and tree fronts, cross-row drafts, the wavefront's
condition and the randomness are written out in docs/RASTER.md (ZipAR section).

Modules: `plan` (one pass: its inputs, what each sees, each slot's output, which commits hold),
`tree_fronts` (zipar-tree's draft tree at the head of each front), `engine` (`decode_fronts`:
the passes of every front of every image), `carried` (the drafts Jacobi fronts carry over), `record`
(each pass's counts, from which the statistics follow at the end), `methods` (the registered methods).
"""

from .methods import pjd, wavefront, zipar, zipar_gsd, zipar_mc_sjd, zipar_sjd, zipar_tree

__all__ = ["pjd", "wavefront", "zipar", "zipar_gsd", "zipar_mc_sjd", "zipar_sjd", "zipar_tree"]
