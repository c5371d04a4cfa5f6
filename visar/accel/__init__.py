"""Decoding methods: one file per method family, registered here by name.

A method is a function `fn(model, cond, params, generators, *, cond_mask=None, progress=False,
**options) -> (tokens, stats)`: `model` implements the interface of the kind the method decodes
(`visar.models.base`, e.g. `RasterModel`), tokens are [B, N] for raster models and a list of
[B, pn, pn] token maps (one per scale) for next-scale models, and stats hold
`stats.COMMON_STATS`. Its keyword options are what `Pipeline.generate` and the CLI accept for it.
Anything the method must not resolve itself (a draft given by name, the tokenizer) is resolved by
the pipeline before the call.

Lossless is a property of the options: a method registered lossy may name the settings at which
it is exact (`exact_when`, e.g. gsd with group_size=1 is sjd); `Method.is_lossless(options, model)`
says which, and tests/test_conformance.py checks each such claim against the exact law.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field

from ..errors import VisarError
from ..models.base import model_kind
from . import ar, cspd, drafts, halton, jacobi, lpd, mar, mar_cache, maskgit, next_scale, relaxed, tree_jacobi, zipar

# Arguments every method takes from the caller, not from the user; `tokenizer` is handed over by
# Pipeline.generate to methods that compare tokens by their code vectors.
CALLER_ARGUMENTS = {"model", "cond", "params", "generators", "cond_mask", "progress", "tokenizer"}


@dataclass(frozen=True)
class Method:
    name: str
    fn: Callable
    lossless: bool  # exact at every setting of its options
    description: str
    model_kind: str = "raster"  # the model interface it decodes (visar.models.base)
    # (options with defaults filled in, model) -> exact at these settings; with `exact_when_text`
    # saying which, and `exact_example`, options that make it exact on any model (for the tests).
    exact_when: Callable[[dict, object], bool] | None = None
    exact_when_text: str = ""
    exact_example: dict = field(default_factory=dict)
    needs_draft: bool = False  # drafts with a second model of the same family (option `draft`)
    requires: tuple[str, ...] = ()  # model attributes it needs beyond its kind's interface

    @property
    def options(self) -> list[str]:
        return [p for p in inspect.signature(self.fn).parameters if p not in CALLER_ARGUMENTS]

    @property
    def defaults(self) -> dict:
        parameters = inspect.signature(self.fn).parameters
        return {name: parameters[name].default for name in self.options}

    @property
    def takes_tokenizer(self) -> bool:
        return "tokenizer" in inspect.signature(self.fn).parameters

    @property
    def lossless_label(self) -> str:
        """ "lossless", "lossy", or "lossy (exact when ...)" for listings."""
        if self.lossless:
            return "lossless"
        return f"lossy (exact when {self.exact_when_text})" if self.exact_when else "lossy"

    def is_lossless(self, options: dict, model) -> bool:
        """Whether the method samples the model's exact law with these options on this model."""
        if self.lossless:
            return True
        return self.exact_when is not None and bool(self.exact_when({**self.defaults, **options}, model))

    def check_options(self, options: dict):
        unknown = sorted(set(options) - set(self.options))
        if unknown:
            known = ", ".join(self.options) or "none"
            raise VisarError(f"unknown option(s) {unknown} for method {self.name!r}; its options: {known}")

    def check_model(self, model):
        """One clear error when the model is not of the kind this method decodes."""
        kind = model_kind(model)
        if kind != self.model_kind:
            what = f"a {kind} model" if kind else "a model of no declared kind (no model_kind)"
            raise VisarError(
                f"method {self.name!r} decodes {self.model_kind} models; {type(model).__name__} is {what}: "
                f"see `visar methods` for the methods of each kind"
            )
        missing = [name for name in self.requires if getattr(model, name, None) is None]
        if missing:
            raise VisarError(
                f"method {self.name!r} needs a model that declares {', '.join(missing)}; "
                f"{type(model).__name__} does not (see `visar methods`)"
            )


METHODS: dict[str, Method] = {}


def register_method(name: str, fn: Callable, *, lossless: bool, description: str, **properties):
    METHODS[name] = Method(name, fn, lossless, description, **properties)


def get_method(name: str) -> Method:
    if not isinstance(name, str) or name not in METHODS:
        raise VisarError(f"unknown method {name!r}; available: {', '.join(sorted(METHODS))}")
    return METHODS[name]


def list_methods() -> list[str]:
    return sorted(METHODS)


# The method each kind's accelerated methods are compared with, and what a command runs without --method.
REFERENCE_METHODS = {"raster": "ar", "next-scale": "var", "masked": "maskgit", "continuous": "mar"}


def reference_method(model) -> str:
    """The reference decoding of the model's kind: plain AR, plain next-scale (VAR), MaskGIT's loop, plain MAR."""
    return REFERENCE_METHODS.get(model_kind(model), "ar")


register_method("ar", ar.generate, lossless=True, description="plain next-token sampling (the reference)")
register_method(
    "sjd",
    jacobi.sjd,
    lossless=True,
    description="speculative Jacobi decoding (Teng et al. 2024), per-image commits, exact at any batch size",
)
register_method(
    "mc-sjd",
    jacobi.mc_sjd,
    lossless=True,
    description="coupled speculative Jacobi decoding (So et al. 2025): maximal or Gumbel coupling of drafts",
)
register_method(
    "spec",
    jacobi.spec,
    lossless=True,
    description="speculative sampling with a draft model of the same family (draft=name, folder or model)",
    needs_draft=True,
)
register_method(
    "sjd-pac",
    tree_jacobi.sjd_pac,
    lossless=True,
    description="SJD-PAC (Kang et al. 2026): a K-ary draft tree after each commit, a chain to the window, every "
    "slot verified; candidates drawn from the law they are verified under, exact at any batch size",
)
register_method(
    "tree-mc-sjd",
    tree_jacobi.tree_mc_sjd,
    lossless=True,
    description="coupled draft trees: SJD-PAC's tree verified by recursive rejection, MC-SJD's coupled "
    "carry-over and 2-D drafts for new slots, exact at any batch size",
)
register_method(
    "gsd",
    relaxed.gsd,
    lossless=False,
    description="grouped speculative Jacobi decoding (So et al. 2025): accepts a draft by its group of "
    "visually equivalent tokens",
    exact_when=relaxed.gsd_is_exact,
    exact_when_text="group_size=1",
    exact_example={"group_size": 1},
)
register_method(
    "lantern",
    relaxed.lantern,
    lossless=False,
    description="LANTERN relaxed speculative decoding (Jang et al. 2025): mass of the draft's codebook "
    "neighbours moved onto it, output within TV delta of the target per position",
    exact_when=relaxed.lantern_is_exact,
    exact_when_text="delta=0",
    exact_example={"delta": 0.0},
)
register_method(
    "lantern++",
    relaxed.lantern_pp,
    lossless=False,
    description="LANTERN++ (Jang et al. 2025): a static draft tree from a draft model (draft=), verified in one "
    "pass with tree attention, LANTERN's relaxed test with a multiplicative cap",
    exact_when=relaxed.lantern_pp_is_exact,
    exact_when_text="lambda_cap=1 or delta=0",
    exact_example={"lambda_cap": 1.0},
    needs_draft=True,
)

# 2-D draft initialisers (token above / to the left) for every Jacobi-style method's `init` option.
jacobi.INITIALISERS.update(drafts.SPATIAL_INITIALISERS)

register_method(
    "zipar",
    zipar.zipar,
    lossless=False,
    description="ZipAR next-set decoding (He et al. 2025): row r+1 starts once row r has s tokens, every row "
    "front advances in one pass, W + (H-1)s passes (unfinished rows above are not seen)",
    exact_when=zipar.covers_rows,
    exact_when_text="s >= the grid width",
    exact_example={"s": 1024},
)
register_method(
    "zipar-sjd",
    zipar.zipar_sjd,
    lossless=False,
    description="zipar whose row fronts each run a speculative Jacobi window",
    exact_when=zipar.covers_rows,
    exact_when_text="s >= the grid width",
    exact_example={"s": 1024},
)
register_method(
    "zipar-mc-sjd",
    zipar.zipar_mc_sjd,
    lossless=False,
    description="zipar whose row fronts each run a coupled speculative Jacobi window",
    exact_when=zipar.covers_rows,
    exact_when_text="s >= the grid width",
    exact_example={"s": 1024},
)
register_method(
    "zipar-gsd",
    zipar.zipar_gsd,
    lossless=False,
    description="zipar whose row fronts each run a GSD window (grouped acceptance)",
    exact_when=zipar.covers_rows_in_groups_of_one,
    exact_when_text="s >= the grid width and group_size=1",
    exact_example={"s": 1024, "group_size": 1},
)
register_method(
    "wavefront",
    zipar.wavefront,
    lossless=True,
    description="exact wavefront decoding for models that declare local dependence (model.dependency_reach)",
    requires=("dependency_reach",),
)

# -- continuous-token models (MAR) ---------------------------------------------------------------
register_method(
    "mar",
    mar.mar,
    lossless=True,
    description="plain MAR sampling (Li et al. 2024): random order, cosine mask schedule, diffusion head",
    model_kind="continuous",
)

register_method(
    "cspd",
    cspd.cspd,
    lossless=False,
    description="continuous speculative decoding (Wang et al. 2024): a draft MAR (draft=) drafts num_draft steps, "
    "the target verifies them in one pass; mode 'exact' keeps the target's law (max_tries=K bounds the residual "
    "sampler at up to 1/(e K) in TV), 'relaxed' is upstream's lossy inner temperature",
    model_kind="continuous",
    needs_draft=True,
    exact_when=cspd.is_exact,
    exact_when_text="mode='exact' and max_tries=None (the default: an unbounded residual sampler)",
    exact_example={"mode": "exact"},
)
register_method(
    "mar-cache",
    mar_cache.mar_cache,
    lossless=False,
    description="MAR with LazyMAR-style reuse across steps: decoder-block features of tokens whose inputs barely "
    "change (token_threshold) and the null condition of guidance (null_interval)",
    model_kind="continuous",
    exact_when=mar_cache.is_exact,
    exact_when_text="token_threshold=0 and null_interval=1",
    exact_example={"token_threshold": 0.0, "null_interval": 1},
)

# -- next-scale models (VAR) ---------------------------------------------------------------------------
register_method(
    "var",
    next_scale.var,
    lossless=True,
    description="plain next-scale sampling (the reference for VAR models): one pass per scale, KV cache",
    model_kind="next-scale",
)
register_method(
    "code",
    next_scale.code,
    lossless=False,
    description="collaborative decoding (CoDe, Chen et al. 2025): this model drafts the first draft_scales "
    "scales, a smaller refiner (draft=) prefills them in one pass and decodes the rest; keep_fraction < 1 adds "
    "var-prune's token pruning at the prune_scales",
    model_kind="next-scale",
    exact_when=next_scale.code_is_exact,
    exact_when_text="draft_scales = the number of scales and keep_fraction=1",
    needs_draft=True,
)
register_method(
    "var-prune",
    next_scale.var_prune,
    lossless=False,
    description="FastVAR cached token pruning (Guo et al. 2025): at the largest scales only keep_fraction of "
    "the tokens go through the transformer, the rest reuse the previous scale's outputs",
    model_kind="next-scale",
    exact_when=next_scale.prune_is_exact,
    exact_when_text="keep_fraction=1",
    exact_example={"keep_fraction": 1.0},
)

# -- masked models (visar.models.base.MaskedModel): a full bidirectional pass per step -----------------
register_method(
    "maskgit",
    maskgit.maskgit,
    lossless=False,
    description="MaskGIT confidence unmasking (Chang et al. 2022) as aMUSEd runs it: cosine mask schedule, "
    "annealed Gumbel noise on the drawn tokens' log-probabilities, `steps` passes",
    model_kind="masked",
)
register_method(
    "halton",
    halton.halton,
    lossless=False,
    description="Halton-order unmasking (Besnier et al. 2025): a low-discrepancy order fixed in advance spreads "
    "each step's tokens over the image, arccos schedule, `steps` passes",
    model_kind="masked",
)
register_method(
    "lpd-order",
    lpd.lpd_order_method,
    lossless=False,
    description="LPD's locality-aware order (Zhang et al. 2025) drawn per image: each step's tokens near decoded "
    "ones and apart from each other, farthest-point fallback, `steps` passes",
    model_kind="masked",
)
register_method(
    "lpd-confidence",
    lpd.lpd_confidence,
    lossless=False,
    description="MaskGIT confidence ranked inside LPD's locality rule (near decoded tokens, repulsion within the "
    "step, farthest-point fallback), `steps` passes",
    model_kind="masked",
)
