"""Behaviours that follow the reference trainer and the reference heal tool (docs/reference-tools.md)."""

from __future__ import annotations

import numpy as np
import pytest

from ddl_wgpu import accept


def test_on_policy_acceptance_is_measured_on_one_anchor_set():
    # depth 2, anchors p = 0, 1, 2. The data follows the trunk's greedy path for both steps at p = 0 only
    # (p = 1: ids[3] = 9 != greedy[2] = 3; p = 2: ids[3] != greedy[2]). The draft is right at p = 0 for both
    # steps and wrong at p = 1. Per-depth anchor sets ({0, 1} at depth 1, {0} at depth 2) would report
    # A = [0.5, 1.0], rising with depth, and a conditional of 2.0.
    ids = np.array([0, 1, 2, 9, 9])
    greedy = np.array([1, 2, 3, 4, 5])
    preds = np.array([[2, 0, 0, 0, 0], [3, 0, 0, 0, 0]])
    t = accept.Tally(2)
    t.add(preds, greedy, ids, 5)
    op = t.result()["on_policy"]
    assert op["anchors"] == 1
    assert op["prefix_acceptance"] == pytest.approx([1.0, 1.0])
    assert op["conditional_acceptance"] == pytest.approx([1.0, 1.0])


def test_on_policy_prefix_never_rises_on_random_data():
    rng = np.random.default_rng(0)
    t = accept.Tally(4)
    for _ in range(50):
        greedy = rng.integers(0, 3, 40)
        ids = np.where(rng.random(40) < 0.8, np.roll(greedy, 1), rng.integers(0, 3, 40))
        preds = np.stack([np.where(rng.random(40) < 0.7, np.roll(greedy, -j), 0) for j in range(1, 5)])
        t.add(preds, greedy, ids, 40)
    op = t.result()["on_policy"]
    assert op["anchors"] > 0
    A = op["prefix_acceptance"]
    assert all(b <= a for a, b in zip(A, A[1:], strict=False))
    assert all(0.0 <= c <= 1.0 for c in op["conditional_acceptance"])
