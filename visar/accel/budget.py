"""Draft budgets matched to the running device: how many rows a pass scores, chosen per pass.

A pass that scores more draft slots commits more tokens, but on a CPU (or at a large batch) its
rows are not free. `budget="auto"` weighs the two with what this decode can see:

- `PassCosts`: seconds per pass of the method's own engine at each size (window slots, or tree
  nodes), measured once per (model, device, dtype, batch size, guidance, engine) at first use, a
  few probe passes per size on the caller's conditions with throwaway generators, and cached for
  the process and on disk for the next one on this machine (`measured_costs`, `cost_store`;
  `pin_costs` gives them instead);
- `SurvivalCounts`: how often a reached draft passed its test, by the draft's age (the passes it
  has been carried over), on the device, read back once every few passes (`age_rates`);
- `WindowBudget`: each pass's size, the one with the most expected committed tokens per second for
  the batch's slowest image.

The choice depends only on the measured costs and on what earlier passes committed, never on the
randomness of the passes to come, so every lossless method keeps its exact law under it
(tests/test_budget.py). The costs are measured once and then fixed, so a process draws the same
tokens for the same seed; another process, device or batch size may choose other sizes (the same
law, other random numbers). A fixed budget keeps tokens independent of all three. The constants
below were set on held-out seeds (docs/DEFAULTS.md).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import Tensor

from ..errors import VisarError
from . import cost_store
from .registry import Request
from .timing import synchronized_clock

AUTO = "auto"
# Window sizes a budget chooses from: powers of two, the shapes the engines pad a pass to anyway.
CHAIN_SIZES = (1, 2, 4, 8, 16, 32)
TREE_SIZES = (8, 16, 32, 64)
# Probe passes timed per size (after the first pass of a probe, which also feeds the condition).
PROBE_PASSES = 3
PROBE_ROUNDS = 3
# Before a decode has counts: the chance that a draft passes its test (rank 0, and a tree's extra
# candidate), and how many passes' worth of weight this prior keeps.
PRIOR_ACCEPT = 0.5
PRIOR_EXTRA_ACCEPT = 0.15
PRIOR_STRENGTH = 8.0
# A batch ends with its slowest image: before any counts, the drafts a batch of B accepts per pass
# are taken as B ** -LAGGARD_EXPONENT of one image's (held-out seeds: 0.77-0.86 at B = 8).
LAGGARD_EXPONENT = 0.1
# How much more tokens per second (at the prior) a draft tree must promise than a chain before a
# decode commits to it (`auto` asks more of drafting over AR: auto.AUTO_MARGIN).
DRAFT_MARGIN = 0.1
MAX_AGE = 8  # ages counted apart (older drafts share the last)
# A draft carried one pass longer fails this much less often, where an age has no counts yet.
AGE_DECAY = 0.8
CHOOSE_EVERY = 4  # passes between two choices: one read-back of the counts each time
# Each choice keeps this share of the counts before it: acceptance changes over an image (its first
# row has no row above to draft from), and a decode that chose one slot (plain AR steps) tests no
# drafts, so its estimate relaxes back to the prior and it tries drafting again.
COUNT_DECAY = 0.85
OBSERVED_DECAY = 0.95
KEEPING_UP_DECAY = 0.95  # the slowest image against the mean: a longer memory, each interval's is noisy


def check_budget(budget, method: str, number: str = "rows per pass") -> str | int | None:
    """None (the method's fixed shape), "auto", or a whole number of `number` >= 1; else one VisarError."""
    if budget is None or budget == AUTO:
        return budget
    if isinstance(budget, int) and not isinstance(budget, bool) and budget >= 1:
        return budget
    raise VisarError(f"budget for {method} must be 'auto', a whole number of {number} >= 1, or None; got {budget!r}")


@dataclass(frozen=True)
class PassCosts:
    """Seconds per pass of one engine at each size it was measured at (sorted, ascending)."""

    sizes: tuple[int, ...]
    seconds: tuple[float, ...]
    kept_on_disk: bool = False  # read back from `cost_store` (an earlier process measured them)

    def __call__(self, size: int) -> float:
        """The cost of a pass of `size` rows: the measured size at or above it (passes pad up); past the
        largest, the largest's (a lower bound: a pass of more rows costs no less)."""
        for measured, seconds in zip(self.sizes, self.seconds, strict=True):
            if measured >= size:
                return seconds
        return self.seconds[-1]

    def in_proportion(self, size: int) -> float:
        """As calling it, but past the largest size measured in proportion to the rows (row fronts can
        feed more rows than any size a probe ran: a CPU's cost grows with them)."""
        return self(size) if size <= self.sizes[-1] else self.seconds[-1] * size / self.sizes[-1]

    def as_ms(self) -> dict[int, float]:
        return {size: round(1000 * s, 3) for size, s in zip(self.sizes, self.seconds, strict=True)}


# model -> {key: PassCosts}: measured once per model, device, dtype, batch, guidance and engine.
_COSTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# model -> seconds(engine, size): costs given instead of measured (`pin_costs`)
_PINNED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def pin_costs(model, seconds: Callable[[str, int], float] | None) -> None:
    """Use seconds(engine, size) as `model`'s pass costs instead of measuring them (engine "chain",
    whose size 0 is an AR step, or "tree"; None: measure again). For choices that must not depend
    on this machine's timing: a benchmark that replays costs measured elsewhere, or a test that
    drives the budget."""
    _COSTS.pop(model, None)
    if seconds is None:
        _PINNED.pop(model, None)
    else:
        _PINNED[model] = seconds


class ProbeBudget:
    """A budget for timing: a fixed size for `passes` passes, then stop; records each pass's seconds."""

    def __init__(self, size: int, passes: int, device):
        self.fixed, self.passes, self.device = size, passes, device
        self.times: list[float] = []
        self.clock: float | None = None

    def size(self, *state) -> int | None:
        """The fixed size, or None once `passes` passes are timed; state (row fronts' counts) is ignored."""
        now = synchronized_clock(self.device)
        if self.clock is not None:
            self.times.append(now - self.clock)
        self.clock = now
        return self.fixed if len(self.times) < self.passes else None

    def count(self, accepted: Tensor, available: Tensor, active: Tensor, age: Tensor, committed: Tensor) -> None:
        pass  # a probe only times

    def progress(self, image_tokens: Tensor) -> None:
        pass

    def stats(self) -> dict:
        return {}


def measured_costs(
    model,
    key: tuple,
    sizes: Sequence[int],
    probe: Callable[[ProbeBudget], None],
    device,
    most_tokens: Callable[[int], int] = lambda size: size,
    warm_up: Sequence[int] | None = None,
) -> PassCosts | None:
    """The engine's seconds per pass at each size, measured at first use and cached for `model`, in
    the process and on disk (`cost_store`: a later process on this machine reads them back).

    probe(budget) runs the engine on scratch generators under a ProbeBudget until it stops: once
    untimed at each `warm_up` size (default the smallest; a process's first passes of an engine run
    slow), then the sizes take turns, PROBE_ROUNDS times, so that a slow moment of the machine does
    not land on one size. The first pass of each probe (it also feeds the condition) is not counted;
    the fastest of the others is kept, as ratios between sizes are what count and a machine's speed
    can drift by half within a second. A pass of fewer rows costs no more than a larger one (the
    smaller cost is kept). Sizes past one whose pass costs more than most_tokens(largest size) passes
    of the smallest are not measured (a larger pass costs no less, and not even accepting every draft
    could pay for it), so on a CPU at a large batch the probe stays short. None when the measurement
    fails (the caller falls back to its fixed shape and says so).
    """
    if model in _PINNED:
        return PassCosts(tuple(sizes), tuple(_PINNED[model](key[0], size) for size in sizes))
    cached = _COSTS.setdefault(model, {})
    if key in cached:
        return cached[key]
    stored = cost_store.entry_name(model, (*key, tuple(sizes)))  # the model's fingerprint read once
    kept = cost_store.load_costs(stored)
    if kept is not None:  # measured by an earlier process on this machine
        cached[key] = PassCosts(tuple(kept[0]), tuple(kept[1]), kept_on_disk=True)
        return cached[key]
    sizes = sorted(sizes)
    best = dict.fromkeys(sizes, float("inf"))
    try:
        for size in warm_up or sizes[:1]:  # untimed: a process's first passes of an engine run slow
            probe(ProbeBudget(size, PROBE_PASSES + 1, device))
        for _ in range(PROBE_ROUNDS):
            for size in sizes:
                budget = ProbeBudget(size, PROBE_PASSES + 1, device)
                probe(budget)
                timed = budget.times[1:] or budget.times  # a tiny image may end after one pass
                best[size] = min([best[size], *timed])
                if best[size] > most_tokens(sizes[-1]) * best[sizes[0]]:
                    sizes = sizes[: sizes.index(size) + 1]
                    break
    except (RuntimeError, VisarError):  # torch.OutOfMemoryError is a RuntimeError
        return None
    seconds = [min(best[s] for s in sizes if s >= size) for size in sizes]
    if not all(0 < s < float("inf") for s in seconds):
        return None
    costs = PassCosts(tuple(sizes), tuple(seconds))
    cached[key] = costs
    cost_store.save_costs(stored, costs.sizes, costs.seconds)
    return costs


def scratch_request(request: Request) -> Request:
    """The caller's model and conditions with throwaway generators: a probe draws none of the caller's
    randomness, so what it measures cannot bias the decode."""
    # a running batch's probe keeps the queue (the null conditions of a negative prompt held for the
    # call are made for all of it) and times its first slots' images; it stops long before any is done
    generators = [torch.Generator().manual_seed(i) for i in range(len(request.generators))]
    return replace(request, generators=generators, progress=False, on_image=None)


def cost_key(engine: str, model, batch: int, guided: bool, extra: tuple = ()) -> tuple:
    return (engine, str(model.device), str(getattr(model, "dtype", "")), batch, guided, *extra)


class SurvivalCounts:
    """How often a draft that was reached (every draft before it accepted) passed its test, by the
    draft's age: the passes it has been carried through (0: a new slot's draft). A coupled draft
    carried over more passes was drawn from a law closer to the final one, so it is accepted more
    often; a longer window holds older drafts at every slot (`expected_tokens`). Counted over the
    batch on the device, without a read-back."""

    def __init__(self, ages: int, device, decay: float = COUNT_DECAY):
        self.reached = torch.zeros(ages, device=device)
        self.passed = torch.zeros_like(self.reached)
        self.decay = decay

    def count(self, accepted: Tensor, available: Tensor, active: Tensor, age: Tensor) -> None:
        """accepted [B]: leading drafts accepted this pass; available [B]: drafts it tested; active [B];
        age [B, G]: each draft slot's age."""
        slots = torch.arange(age.shape[1], device=accepted.device)
        reached = (slots < available[:, None]) & (slots <= accepted[:, None]) & active[:, None]
        passed = reached & (slots < accepted[:, None])
        bucket = age.clamp(max=len(self.reached) - 1).flatten()
        self.reached.scatter_add_(0, bucket, reached.flatten().to(self.reached.dtype))
        self.passed.scatter_add_(0, bucket, passed.flatten().to(self.passed.dtype))

    def forget(self) -> None:
        """Decay the counts (after each read, `WindowBudget.choose`)."""
        self.reached *= self.decay
        self.passed *= self.decay


def age_rates(reached: list[float], passed: list[float], first_prior: float, strength: float) -> list[float]:
    """Each age's rate: its counts shrunk towards a prior drawn from the age before it, whose chance of
    failing shrinks by AGE_DECAY per pass carried (age 0 towards `first_prior`), so ages a short
    window never holds are extrapolated, not copied."""
    rates, prior = [], first_prior
    for seen, went_past in zip(reached, passed, strict=True):
        rate = (went_past + strength * prior) / (seen + strength)
        rates.append(rate)
        prior = 1 - (1 - rate) * AGE_DECAY
    return rates


def expected_tokens(rates: Sequence[float], drafts: int) -> float:
    """Expected tokens a pass with `drafts` draft slots commits in the steady state of a carried window.

    With c tokens committed a pass, the draft at slot j entered the window at its end about
    (drafts - 1 - j) / c passes ago, so it has that age; a pass commits 1 + sum_j P(drafts 0 .. j
    accepted). c is the fixed point of the two (damped iterations from 1).
    """
    commits = 1.0
    if not rates or drafts == 0:
        return commits
    for _ in range(12):
        total, survive = 1.0, 1.0
        for slot in range(drafts):
            survive *= rates[min(int((drafts - 1 - slot) / commits), len(rates) - 1)]
            total += survive
        commits = (commits + total) / 2  # damped: the plain iteration can swing between two states
    return commits


class WindowBudget:
    """Each pass's size: the one with the most expected committed tokens per second, re-chosen every
    CHOOSE_EVERY passes.

    An image's expected tokens per pass at a size is what the survival counts predict for it (the
    prediction carries what one window saw to the others: longer windows hold older drafts,
    `expected_tokens`), times how passes at that size have committed against what was predicted
    for them (the batch's mean; a prior of 1 worth PRIOR_STRENGTH passes): a long window's drafts
    far past the commit were drafted after tokens that were still drafts, which the ages alone do
    not see. The batch ends with its slowest image, so the drafts it accepts are scaled by how far
    the slowest image's progress has kept up with the mean's (over a longer memory: one interval's
    slowest image is a noisy sample).

    sizes: what the engine can run; drafts_of(size): the main-path draft slots of a pass of that
    size (a chain window: size - 1; a tree: its main path less the root).
    """

    def __init__(
        self,
        costs: PassCosts,
        sizes: tuple[int, ...],
        drafts_of: Callable[[int], int],
        counts: SurvivalCounts,
        grid_size: tuple[int, int],
        first_prior: float = PRIOR_ACCEPT,
    ):
        self.costs, self.sizes, self.drafts_of, self.counts = costs, sizes, drafts_of, counts
        self.first_prior, self.every = first_prior, CHOOSE_EVERY
        self.width, self.num_tokens = grid_size[1], grid_size[0] * grid_size[1]
        self.batch = 1  # set by the first count
        device = counts.reached.device
        # the passes since the last choice, as `count` got them: counted at the next choice, in one
        # go (a dozen ops a choice instead of three dozen a pass; the counts' sums come out the same)
        self.pending: list[tuple[Tensor, Tensor, Tensor, Tensor, Tensor]] = []
        self.no_outcome = torch.zeros(4, device=device)
        self.interval_passes = 0
        self.correction = SizeCorrection(sizes)
        self.keeping_up = [0.0, 0.0]  # decayed drafts accepted a pass: [the slowest image's, the mean's]
        self.current, self.passes = 0, 0

    def size(self) -> int:
        if self.passes % self.every == 0:
            self.current = self.choose()
        self.passes += 1
        self.interval_passes += 1
        return self.current

    def choose(self) -> int:
        # one read-back: the age counts, this interval's tokens and image-passes, the slowest image's counts
        ages = len(self.counts.reached)
        outcome = self.settle()
        host = torch.cat([self.counts.reached, self.counts.passed, outcome]).tolist()
        reached, passed, (tokens, image_passes, start, slowest) = host[:ages], host[ages : 2 * ages], host[2 * ages :]
        self.counts.forget()
        moved, passes = slowest - start, self.interval_passes
        self.interval_passes = 0
        mean = tokens / image_passes * passes if image_passes else 0.0  # an image's tokens over the interval
        self.correction.observe(self.current, mean, passes if image_passes else 0)
        if image_passes:  # drafts beyond the one token a pass always commits
            self.keeping_up = [
                self.keeping_up[0] * KEEPING_UP_DECAY + max(moved - passes, 0.0),
                self.keeping_up[1] * KEEPING_UP_DECAY + max(mean - passes, 0.0),
            ]
        prior = batch_keeping_up(self.batch) * PRIOR_STRENGTH
        keeping_up = min(1.0, (self.keeping_up[0] + prior) / (self.keeping_up[1] + PRIOR_STRENGTH))
        rates = age_rates(reached, passed, self.first_prior, PRIOR_STRENGTH)
        predictions = {size: expected_tokens(rates, self.drafts_of(size)) for size in self.sizes}

        def expected(size: int) -> float:
            return 1 + (self.correction.corrected(size, predictions[size]) - 1) * keeping_up

        choice = best_size(self.sizes, self.costs, expected)
        self.correction.predicted = predictions[choice]
        return choice

    def count(self, accepted: Tensor, available: Tensor, active: Tensor, age: Tensor, committed: Tensor) -> None:
        """This pass's outcome: accepted, available, active and age as SurvivalCounts.count; committed [B]:
        each image's committed tokens before it. Kept as given until the next choice (`settle`): the
        engines hand over tensors they no longer write to (an engine's next commit makes a new
        `committed`)."""
        self.batch = len(committed)
        self.pending.append((accepted, available, active, age, committed))

    def settle(self) -> Tensor:
        """Count the passes since the last choice -> [4]: their committed tokens and image-passes over
        the batch, the slowest image's count before the first and after the last (zeros if none).
        Passes in an image's first row, whose drafts have no row above to copy or condition on, move
        the slowest image but teach nothing about the rest."""
        if not self.pending:
            return self.no_outcome
        first_committed, last = self.pending[0][4], self.pending[-1]
        accepted, available, active, age, committed = joined_passes(self.pending)
        self.pending.clear()
        learn = active & (committed >= self.width)
        self.counts.count(accepted, available, learn, age)
        after = torch.where(last[2], last[4] + last[0] + 1, last[4]).clamp(max=self.num_tokens)
        tokens = ((accepted + 1) * learn).sum()
        return torch.stack([tokens, learn.sum(), first_committed.min(), after.min()]).to(self.no_outcome.dtype)

    def stats(self) -> dict:
        return {"budget": AUTO, "pass_ms": self.costs.as_ms()}


def joined_passes(passes: list[tuple[Tensor, ...]]) -> list[Tensor]:
    """Passes' outcomes, each a tuple of [N] tensors with a [N, G] age among them (4th), joined pass
    after pass (ages padded with age 0 to the widest G: slots past `available`, never counted), so
    that one `SurvivalCounts.count` adds in the order that one count a pass would."""
    parts = list(zip(*passes, strict=True))
    width = max(age.shape[1] for age in parts[3])
    parts[3] = [age if age.shape[1] == width else F.pad(age, (0, width - age.shape[1])) for age in parts[3]]
    return [torch.cat(part) for part in parts]


class SizeCorrection:
    """How passes at each size have committed against what was predicted for them: the age model sees
    neither that a long window's drafts far past the commit were drafted after tokens that were still
    drafts, nor (for row fronts) how the fronts' drafts differ; each size's prediction is scaled by its
    decayed record (a prior of 1, worth PRIOR_STRENGTH passes)."""

    def __init__(self, sizes: Sequence[int]):
        # size -> decayed [an image's tokens in passes at that size, what was predicted for them]
        self.observed = {size: [0.0, 0.0] for size in sizes}
        self.predicted = 1.0  # an image's tokens a pass at the current size was predicted to commit

    def observe(self, size: int, tokens: float, passes: int) -> None:
        """An interval of `passes` passes at `size` in which an image committed `tokens` on average."""
        for at, seen in self.observed.items():
            seen[0], seen[1] = seen[0] * OBSERVED_DECAY, seen[1] * OBSERVED_DECAY
            if at == size and passes:
                seen[0], seen[1] = seen[0] + tokens, seen[1] + self.predicted * passes

    def corrected(self, size: int, predicted: float) -> float:
        seen_tokens, seen_predicted = self.observed[size]
        return predicted * (seen_tokens + PRIOR_STRENGTH * predicted) / (seen_predicted + PRIOR_STRENGTH * predicted)


class FrontBudget:
    """Row fronts (zipar's Jacobi fronts): each pass's window per front, re-chosen every CHOOSE_EVERY
    passes, for the most expected committed tokens per second of the batch.

    A window w gives every front min(w, what its lag allows) slots, so a pass's rows and tokens are
    sums over the fronts: `shapes(sizes)` says, from the committed counts alone (on the device, read
    back with the counts in one read), the most rows an image feeds at each size and how many
    fronts of an image, on average, would test d drafts. A front with d drafts commits what the
    survival counts predict for a carried window of d drafts (`expected_tokens`), and the pass costs
    what `costs` says for as many rows (past the largest size measured: in proportion; zipar's
    `front_costs`: the chain engine's, plus the fronts' own fixed cost a pass).
    Each size's prediction is corrected by its own record (`SizeCorrection`).
    """

    def __init__(self, costs: PassCosts, sizes: tuple[int, ...], counts: SurvivalCounts, shapes: Callable):
        self.costs, self.sizes, self.counts, self.shapes = costs, sizes, counts, shapes
        self.correction = SizeCorrection(sizes)
        # the passes since the last choice, counted at the next (as WindowBudget's): their drafts'
        # outcomes, and each image's tokens a pass
        self.pending: list[tuple[Tensor, Tensor, Tensor, Tensor]] = []
        self.image_tokens: list[Tensor] = []
        self.no_progress = torch.zeros(2, device=counts.reached.device)
        self.current, self.passes, self.interval_passes = 0, 0, 0

    def size(self, count: Tensor) -> int:
        """The window per front for the next pass; count [B, H]: each row's committed tokens."""
        if self.passes % CHOOSE_EVERY == 0:
            self.current = self.choose(count)
        self.passes += 1
        self.interval_passes += 1
        return self.current

    def choose(self, count: Tensor) -> int:
        ages = len(self.counts.reached)
        shape = self.shapes(count, self.sizes)  # [C, 1 + D]: the most rows, then the mean fronts by drafts
        progress = self.settle()
        host = torch.cat([self.counts.reached, self.counts.passed, progress, shape.flatten().float()]).tolist()
        reached, passed, (tokens, image_passes) = host[:ages], host[ages : 2 * ages], host[2 * ages : 2 * ages + 2]
        shapes = [host[2 * ages + 2 :][i * shape.shape[1] : (i + 1) * shape.shape[1]] for i in range(len(self.sizes))]
        self.counts.forget()
        passes, self.interval_passes = self.interval_passes, 0
        self.correction.observe(self.current, tokens / image_passes * passes if image_passes else 0.0, passes)
        rates = age_rates(reached, passed, PRIOR_ACCEPT, PRIOR_STRENGTH)
        per_front = [expected_tokens(rates, drafts) for drafts in range(shape.shape[1] - 1)]
        rows = {size: max(row[0], 1.0) for size, row in zip(self.sizes, shapes, strict=True)}
        predictions = {
            size: sum(fronts * tokens for fronts, tokens in zip(row[1:], per_front, strict=True))
            for size, row in zip(self.sizes, shapes, strict=True)
        }

        def tokens_per_second(size: int) -> tuple[float, int]:
            seconds = self.costs.in_proportion(rows[size])
            return self.correction.corrected(size, max(predictions[size], 1e-9)) / seconds, -size

        choice = max(self.sizes, key=tokens_per_second)
        self.correction.predicted = max(predictions[choice], 1e-9)
        return choice

    def count(self, accepted: Tensor, available: Tensor, learn: Tensor, age: Tensor, image_tokens: Tensor) -> None:
        """This pass's outcome: accepted, available, learn and age per front as SurvivalCounts.count (fronts
        in the first row, whose drafts have no row above, not learnt); image_tokens [B]: each image's
        tokens this pass (0 for a finished image). Kept until the next choice, as WindowBudget.count."""
        self.pending.append((accepted, available, learn, age))
        self.progress(image_tokens)

    def progress(self, image_tokens: Tensor) -> None:
        """image_tokens [B]: each image's tokens this pass (0 for a finished image)."""
        self.image_tokens.append(image_tokens)

    def settle(self) -> Tensor:
        """Count the passes since the last choice -> [2]: their tokens and image-passes (images that
        moved) over the batch."""
        if self.pending:
            self.counts.count(*joined_passes(self.pending))
            self.pending.clear()
        if not self.image_tokens:
            return self.no_progress
        tokens = torch.cat(self.image_tokens)
        self.image_tokens.clear()
        return torch.stack([tokens.sum(), (tokens > 0).sum()]).to(self.no_progress.dtype)

    def stats(self) -> dict:
        return {"budget": AUTO, "pass_ms": self.costs.as_ms()}


def batch_keeping_up(batch: int) -> float:
    """Before any counts, the share of one image's accepted drafts a batch's slowest image accepts."""
    return batch**-LAGGARD_EXPONENT


def prior_rates() -> list[float]:
    """Before any counts: the chance that a reached draft of each age passes (PRIOR_ACCEPT at age 0,
    its failures shrinking by AGE_DECAY per pass carried)."""
    return [1 - (1 - PRIOR_ACCEPT) * AGE_DECAY**age for age in range(MAX_AGE)]


def prior_tokens(drafts: int, batch: int, branch: int = 1) -> float:
    """Tokens a pass with `drafts` main-path draft slots commits before any counts, in a batch of
    `batch`: the carried window's steady state at `prior_rates`, its accepted drafts scaled by
    `batch_keeping_up`; a tree with `branch` candidates at its first draft position adds the
    chance that an extra candidate passes where the first draft failed (PRIOR_EXTRA_ACCEPT each)."""
    rates = prior_rates()
    accepted = expected_tokens(rates, drafts) - 1
    if branch > 1 and drafts > 0:
        accepted += (1 - rates[0]) * (1 - (1 - PRIOR_EXTRA_ACCEPT) ** (branch - 1))
    return 1 + accepted * batch_keeping_up(batch)


def best_size(sizes: Sequence[int], costs: PassCosts, tokens: Callable[[int], float]) -> int:
    """The size with the most expected tokens per second (the smaller one on a tie)."""
    return max(sizes, key=lambda s: (tokens(s) / costs(s), -s))
