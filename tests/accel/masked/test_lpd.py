"""LPD's locality-aware order (visar/accel/masked/lpd.py) on a grid: a step picks cells near the decoded ones
that keep the repulsion distance, then the farthest points; the groups partition the grid; the order
is fixed by the seed; proximity weights are LPD's. The lpd methods' reveal counts and bad options:
tests/accel/masked/test_maskgit.py, with the other masked schedules.
"""

import torch

from visar.accel.masked.loop import reveal_counts
from visar.accel.masked.lpd import Grid, lpd_order


def test_lpd_step_picks_near_cells_apart_then_farthest_points():
    grid = Grid(8, 8)  # cells 0, 1, 2, 3 on the top row; 27 = (3, 3); 63 = (7, 7)
    ranked, rest = [0, 1, 2, 3, 27], [63]
    # greedy: 0; 1 and 2 within Chebyshev distance 2 of it are skipped; 3 and 27 are 3 away
    assert grid.pick_group(3, list(ranked), list(rest), 2, None) == [0, 3, 27]
    # one more: farthest-point sampling over the rest and the skipped, measured to this step's cells
    assert grid.pick_group(4, list(ranked), list(rest), 2, None) == [0, 3, 27, 63]
    # nothing near decoded cells: the fallback starts from first(pool), here the pool's last cell
    assert grid.pick_group(2, [], [0, 9, 63], 2, lambda pool: pool[-1]) == [63, 0]


def test_lpd_groups_are_a_partition_that_starts_near_the_decoded():
    grid, counts = Grid(8, 8), reveal_counts(10, 64, "cosine")
    order = lpd_order(grid, counts, torch.Generator().manual_seed(0), proximity=1.0, repulsion=2)
    assert sorted(order) == list(range(64))
    decoded, start = torch.zeros(64, dtype=torch.bool), 0
    for size in counts:
        group = order[start : start + size]
        proximity = grid.proximity(decoded)
        if bool((proximity[~decoded] >= 1.0).any()):  # a candidate next to decoded cells leads the group
            assert proximity[group[0]] >= 1.0
        decoded[group] = True
        start += size


def test_lpd_order_is_fixed_by_the_seed():
    grid, counts = Grid(6, 6), reveal_counts(8, 36, "cosine")

    def order(seed):
        return lpd_order(grid, counts, torch.Generator().manual_seed(seed), proximity=1.0, repulsion=2)

    assert order(0) == order(0) and order(0) != order(1)


def test_proximity_weights_are_lpds():
    grid = Grid(3, 3)
    decoded = torch.zeros(9, dtype=torch.bool)
    decoded[4] = True  # the centre: edge neighbours score 1, diagonal ones 1/sqrt(2)
    assert torch.allclose(grid.proximity(decoded).reshape(3, 3)[0], torch.tensor([2**-0.5, 1.0, 2**-0.5]))
