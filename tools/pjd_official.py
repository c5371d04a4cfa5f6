"""PJD's official decoding rules beside visar's `pjd` preset (issue 70, item 1; docs/RASTER.md, "PJD").

PJD (Liao et al., CVPR 2026; boyaliao/PJD, `scheduler/jacobi_iteration_lumina_mgpt.py`) runs Jacobi
windows on row fronts. visar's `pjd` takes its schedule and mask onto zipar-mc-sjd's exact fronts. This
re-implements the official loop's rules on visar's raster model interface, so that the two run on the
same models, conditions and seeds and only the rules differ:

- rows (`JacobiSampler._sample`): row r + 1 starts once row r has `start_lag` tokens (`long_size` 9 counts
  the row's anchor); the topmost running row feeds min(W - count, window) slots, a lower row
  min(count above - count, window): its last committed token (a row start: the stand-in visar's fronts
  feed, row r - 1's newest token at (r - 1, W - 1), where Lumina-mGPT has its end-of-line token), the
  drafts carried from the last pass (`keep_unmatched_num`) and fresh uniformly random ones with a one-hot
  law (`jacobi_init_num`);
- the mask (`_update_causal_mask_JACOBI`): a slot sees the condition, every committed token before it and
  its own row's drafts before it, never the drafts of the rows above (visar's `cross_row=False` visibility);
- acceptance (`SpeculativeSampler.__call__`): slot i's draft d, recorded with law q, passes if
  u < min(1, p(d) / q(d)), p being slot i - 1's output. The topmost row commits its accepted drafts and
  then a draw from norm((p - q)+) at the first rejection, or the bonus draw when every draft passed; a
  lower row commits its accepted drafts only. After a row's first rejection each later slot's next draft is
  the old draft, with its old law, if min(1, p / q) > 0.5, else a draw from p recorded with p; the
  rejected slot of a lower row carries a draw from p.

Left out: the batch rule (the official code commits the fewest accepted tokens of any image in a
batch; this decodes one image at a time, as its scripts do), the logits processor applied again to the
residual's log (the residual's support lies inside the filtered p's), and the KV bookkeeping (insert at
local indices, delete rejected entries), which visar's cache does by slot. The loop feeds image tokens
only: on Lumina-mGPT (`official_decode` takes any raster model, tests/tools/test_pjd_official.py runs it
on the tiny one) visar's adapter adds the end-of-line tokens and the header, as for every method.
Randomness comes from each image's generator: one uniform per slot where the official code indexes a
[L, V] table by the draft (the same law).

    python3 tools/pjd_official.py --model visar-tiny-c2i --n 200 [--seed 0] [--start-lag 8] [--window 8]
    python3 tools/pjd_official.py --law [--samples 20000]

The first prints passes per image, seconds per image and the detector's accuracy for AR, visar's pjd and
the official rules on the same images (image i: class i mod the classes, seed SEED + i). The second
measures each rule set's distance from AR's law on an enumerated tiny model (3 x 3 tokens, 3 codes,
window 3): the mean TV of the sampled next-token laws against the exact ones over every (position,
prefix) drawn at least 300 times, at a start lag of 3, the whole row (no ZipAR approximation: the keep
rule alone), and of 2 (rows overlap: the approximation, and the lower rows' accepted-only commits).
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch
from torch import Tensor

import visar
from visar.accel import Request, get_method
from visar.accel.core.sampling import SamplingParams, make_generators
from visar.accel.core.scoring import GuidedScorer
from visar.accel.raster.zipar.methods import scaled_lag
from visar.models.llamagen import LlamaGen, LlamaGenConfig

KEEP_ABOVE = 0.5  # the keep rule: after a rejection, a later draft stays if min(1, p / q) is above this


def draw(probs: Tensor, generator: torch.Generator) -> int:
    return int(torch.multinomial(probs, 1, generator=generator))


def residual_law(p: Tensor, q: Tensor) -> Tensor:
    """What a rejected top-row slot draws from: (p - q)+ (unnormalised; p itself where that is empty)."""
    residual = (p - q).clamp(min=0)
    return residual if float(residual.sum()) > 0 else p


class OfficialRows:
    """One image's rows under the official rules: committed tokens, carried drafts, each row's slot count."""

    def __init__(self, grid: tuple[int, int], vocab: int, start_lag: int, window: int):
        self.height, self.width = grid
        self.vocab, self.window = vocab, window
        self.start_lag = min(start_lag, self.width)  # the official loop never starts a row on a grid narrower
        num_tokens = self.height * self.width
        self.tokens = torch.zeros(num_tokens, dtype=torch.long)
        self.committed = torch.zeros(num_tokens, dtype=torch.bool)
        self.fed = torch.zeros(num_tokens, dtype=torch.bool)  # its keys and values are in the cache
        self.count = [0] * self.height
        self.carried: list[list[tuple[int, Tensor]]] = [[] for _ in range(self.height)]  # (draft, its law q)
        self.slots = [0] * self.height  # the official verify_num
        self.running: list[int] = []

    def start(self, token: int):
        """Token (0, 0), the prefill's draw: row 0 runs with its first window."""
        self.tokens[0], self.committed[0], self.count[0] = token, True, 1
        self.running, self.slots[0] = [0], min(self.width - 1, self.window)

    def index(self, row: int, column: int) -> int:
        return row * self.width + column

    def pass_inputs(self, generator: torch.Generator) -> tuple[list, Tensor, Tensor]:
        """-> (each running row's (row, drafts [(token, q)]) , fed positions [L], fed tokens [L]); the rows'
        inputs first (slot 0, then the drafts), then the complete rows' last tokens not yet fed."""
        rows, positions, fed_tokens = [], [], []
        for row in self.running:
            count, slots = self.count[row], self.slots[row]
            if count > 0:
                first, token = self.index(row, count - 1), int(self.tokens[self.index(row, count - 1)])
            else:  # a row start: row r - 1's newest token at (r - 1, W - 1), as visar's fronts feed it
                first, token = self.index(row, 0) - 1, int(self.tokens[self.index(row - 1, self.count[row - 1] - 1)])
            fresh = torch.randint(self.vocab, (slots - 1 - len(self.carried[row]),), generator=generator).tolist()
            drafts = self.carried[row] + [
                (d, torch.zeros(self.vocab).index_fill_(0, torch.tensor(d), 1)) for d in fresh
            ]
            rows.append((row, drafts))
            positions += range(first, first + slots)
            fed_tokens += [token] + [d for d, _ in drafts]
        for row in range(self.height):  # a complete row's last token, drawn in its last pass, is fed once
            last = self.index(row, self.width - 1)
            if self.count[row] == self.width and not self.fed[last]:
                positions.append(last)
                fed_tokens.append(int(self.tokens[last]))
        return rows, torch.tensor(positions), torch.tensor(fed_tokens)

    def visibility(self, rows: list, positions: Tensor) -> Tensor:
        """[L, N] bool: committed tokens at or before each input, its own row's drafts up to it, itself."""
        slots = torch.arange(self.height * self.width)
        visible = self.committed[None, :] & (slots[None, :] <= positions[:, None])
        visible[torch.arange(len(positions)), positions] = True
        start = 0
        for _, drafts in rows:
            for slot in range(1, len(drafts) + 1):  # a draft sees the drafts before it (not a row start's stand-in)
                visible[start + slot, positions[start + 1] : positions[start + slot] + 1] = True
            start += len(drafts) + 1
        return visible

    def verify(self, rows: list, probs: Tensor, generator: torch.Generator):
        """The official acceptance, commits, carried drafts and row bookkeeping after one pass (probs [L, V])."""
        start = 0
        for place, (row, drafts) in enumerate(rows):
            top = place == 0
            outputs = probs[start : start + len(drafts) + 1]  # output i predicts the column of draft i + 1
            start += len(drafts) + 1
            committed, carried, rejected = [], [], None
            for i, (draft, q) in enumerate(drafts):
                ratio = min(1.0, float(outputs[i, draft] / q[draft]))
                if rejected is None:
                    if float(torch.rand((), generator=generator)) < ratio:
                        committed.append((draft, True))
                        continue
                    rejected = i
                    if top:
                        committed.append((draw(residual_law(outputs[i], q), generator), False))
                    else:
                        carried.append((draw(outputs[i], generator), outputs[i]))
                elif ratio > KEEP_ABOVE:  # the keep rule: the old draft with its old law
                    carried.append((draft, q))
                else:
                    carried.append((draw(outputs[i], generator), outputs[i]))
            last = outputs[len(drafts)]
            if rejected is None and top:
                committed.append((draw(last, generator), False))  # every draft passed: the bonus draw
            else:
                carried.append((draw(last, generator), last))
            self.commit(row, committed)
            above = self.width if top else self.count[row - 1]
            self.slots[row] = min(above - self.count[row], self.window)
            self.carried[row] = carried[: max(self.slots[row] - 1, 0)]
        for row in list(self.running):
            if self.count[row] >= self.start_lag and row + 1 < self.height and self.count[row + 1] == 0:
                if row + 1 not in self.running:
                    self.running.append(row + 1)
                    self.slots[row + 1] = min(self.count[row], self.window)
        self.running = [row for row in self.running if self.count[row] < self.width]

    def commit(self, row: int, tokens: list[tuple[int, bool]]):
        for token, was_fed in tokens:
            k = self.index(row, self.count[row])
            self.tokens[k], self.committed[k], self.fed[k] = token, True, was_fed
            self.count[row] += 1


@torch.no_grad()
def official_decode(
    model,
    cond: Tensor,
    params: SamplingParams,
    generator: torch.Generator,
    start_lag: int = 8,
    window: int = 8,
    cond_mask: Tensor | None = None,
) -> tuple[Tensor, int]:
    """One image under PJD's official rules -> (tokens [N], forward passes, the prefill included); a text
    model's cond_mask [T]: its prompt's valid positions (None: all)."""
    grid, num_cond = model.grid_size, model.num_condition_tokens
    num_tokens = grid[0] * grid[1]
    state = OfficialRows(grid, model.vocab_size, start_lag, window)
    scorer = GuidedScorer(model, cond[None], None if cond_mask is None else cond_mask[None], params)
    with scorer.cache(num_cond + num_tokens):
        state.start(draw(scorer.prefill()[0], generator))
        while state.running:
            rows, positions, fed_tokens = state.pass_inputs(generator)
            image_mask = state.visibility(rows, positions)
            mask = torch.cat([torch.ones(len(positions), num_cond, dtype=torch.bool), image_mask], 1)
            logits = scorer.logits(fed_tokens[None], (positions + num_cond)[None], mask=mask[None])
            state.fed[positions] = True  # a draft's keys and values stay only where it is committed (rows are masked)
            state.fed &= state.committed
            state.verify(rows, scorer.target_probs(logits)[0], generator)
    return state.tokens, scorer.forward_passes


def side_by_side(args) -> list[dict]:
    """AR, visar's pjd and the official rules on the same images of a shapes-world model."""
    from visar.eval.detector import detect, score_class

    pipe = visar.load(args.model)
    labels = [i % pipe.num_classes for i in range(args.n)]
    params = pipe.sampling_params()
    scaled = scaled_lag(pipe.model.grid_size[1])  # pjd's default for either option left out
    options = dict(start_lag=args.start_lag or scaled, window=args.window or scaled)
    rows = []
    for name in ("ar", "pjd", "official"):
        tokens, passes, start = [], [], time.perf_counter()
        for i, label in enumerate(labels):
            cond = pipe.class_condition([label])
            generators = make_generators(1, args.seed + i)
            if name == "official":
                image_tokens, image_passes = official_decode(pipe.model, cond[0], params, generators[0], **options)
            else:
                kwargs = options if name == "pjd" else {}
                out, stats = get_method(name).fn(Request(pipe.model, cond, params, generators), **kwargs)
                image_tokens, image_passes = out[0], stats["forward_passes"]
            tokens.append(image_tokens)
            passes.append(image_passes)
        seconds = (time.perf_counter() - start) / args.n
        images = pipe.to_output(pipe.decode(torch.stack(tokens).view(-1, *pipe.model.grid_size)), "np")
        accuracy = float(
            np.mean([score_class(detect(image), label) for image, label in zip(images, labels, strict=True)])
        )
        rows.append(dict(method=name, passes=float(np.mean(passes)), seconds=seconds, accuracy=accuracy))
    return rows


def law_model() -> LlamaGen:
    """3 x 3 tokens, 3 codes: 19,683 sequences, enumerable (the tests' tiny LlamaGen recipe, N(0, 0.5) weights)."""
    torch.manual_seed(0)
    config = LlamaGenConfig(dim=16, n_layer=2, n_head=2, multiple_of=16, vocab_size=3, num_classes=3, block_size=9)
    model = LlamaGen(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.5)
    return model


@torch.no_grad()
def next_token_laws(model, label: int, params: SamplingParams) -> np.ndarray:
    """p(x_j | x_<j) of every sequence [V^N, N, V], by teacher forcing."""
    vocab, length = model.vocab_size, model.num_image_tokens
    grids = torch.meshgrid(*[torch.arange(vocab)] * length, indexing="ij")
    seqs = torch.stack([g.reshape(-1) for g in grids], 1)  # row m: the base-V digits of m
    scorer = GuidedScorer(model, torch.full((len(seqs),), label), None, params)
    logits = scorer.logits(seqs[:, :-1], torch.arange(model.num_condition_tokens + length - 1), with_condition=True)
    return scorer.target_probs(logits[:, model.num_condition_tokens - 1 :]).double().numpy()


def conditional_tv(tokens: Tensor, laws: np.ndarray, min_count: int, seed: int = 0) -> tuple[float, float, int]:
    """Over every (position j, prefix) drawn at least min_count times: the mean TV between the sampled law
    of x_j given the prefix and p(x_j | prefix), the mean TV an exact sampler of the same counts shows (the
    noise floor), and the number of such cells."""
    length, vocab = tokens.shape[1], laws.shape[-1]
    index = (tokens * vocab ** torch.arange(length - 1, -1, -1)).sum(1).numpy()
    counts = np.bincount(index, minlength=vocab**length).reshape([vocab] * length)
    rng, tvs, floors = np.random.default_rng(seed), [], []
    for j in range(length):
        sampled = counts.sum(axis=tuple(range(j + 1, length))).reshape(-1, vocab).astype(float)  # [V^j, V]
        for prefix in np.flatnonzero(sampled.sum(1) >= min_count):
            count = int(sampled[prefix].sum())
            target = laws[prefix * vocab ** (length - j), j]
            tvs.append(0.5 * np.abs(sampled[prefix] / count - target).sum())
            null = rng.multinomial(count, target / target.sum(), size=100) / count
            floors.append(0.5 * np.abs(null - target).sum(1).mean())
    return float(np.mean(tvs)), float(np.mean(floors)), len(tvs)


def law_distance(args) -> list[dict]:
    """AR, visar's pjd and the official rules on the enumerated model, at a start lag past the row (3) and
    at 2, window 3: the mean conditional TV against AR's next-token laws (`conditional_tv`)."""
    model, label, params = law_model(), 1, SamplingParams()
    laws, n, rows = next_token_laws(model, label, params), args.samples, []
    for start_lag in (3, 2):
        for name in ("ar", "pjd", "official"):
            begin = time.perf_counter()
            if name == "official":
                generators = make_generators(n, args.seed)
                cond = torch.tensor([label])
                tokens = torch.stack(
                    [official_decode(model, cond[0], params, g, start_lag, window=3)[0] for g in generators]
                )
            else:
                options = dict(start_lag=start_lag, window=3) if name == "pjd" else {}
                request = Request(model, torch.full((n,), label), params, make_generators(n, args.seed))
                tokens = get_method(name).fn(request, **options)[0]
            tv, floor, cells = conditional_tv(tokens, laws, min_count=300)
            seconds = time.perf_counter() - begin
            rows.append(dict(start_lag=start_lag, method=name, samples=n, cells=cells, mean_tv=tv, noise_floor=floor,
                             seconds=seconds))  # fmt: skip
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="visar-tiny-c2i")
    parser.add_argument("--n", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--start-lag", type=int, help="default: pjd's, ceil(W / 6)")
    parser.add_argument("--window", type=int, help="default: pjd's, ceil(W / 6)")
    parser.add_argument("--law", action="store_true", help="TV against AR's law on an enumerated tiny model instead")
    parser.add_argument("--samples", type=int, default=20000)
    parser.add_argument("--json")
    args = parser.parse_args()
    rows = law_distance(args) if args.law else side_by_side(args)
    for row in rows:
        print(json.dumps(row))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
