"""`make bench`'s history guard and its phase table: the logic that compares runs (no timing here)."""

import json

from bench.ppo import compare_with_history, phase_table, round_spread


def entry(seconds: float, spread: float, machine: str = "cpu, 2 cores, 2 threads") -> dict:
    return {"date": "2026-11-26T10:00:00+00:00", "commit": "abc", "machine": machine, "config": "configs/bench.yaml",
            "overrides": [], "seconds_per_iteration": {"ours": seconds, "trl": 2.2}, "round_spread": {"ours": spread},
            "speedup_vs_trl": 2.2 / seconds}


def history(tmp_path, *entries) -> object:
    path = tmp_path / "history.jsonl"
    path.write_text("".join(json.dumps(e) + "\n" for e in entries))
    return path


def test_a_slowdown_beyond_ten_percent_and_the_spread_is_flagged(tmp_path):
    path = history(tmp_path, entry(1.0, 0.03), entry(1.9, 0.02, machine="another cpu, 8 cores, 2 threads"))
    report = compare_with_history(path, entry(1.2, 0.05))  # +20% against 10% + the larger spread, 5%
    assert "+20.0%" in report and "since abc" in report and "SLOWDOWN" in report and "15.0% allowed" in report


def test_a_change_within_ten_percent_and_the_spread_is_not_flagged(tmp_path):
    path = history(tmp_path, entry(1.0, 0.08))
    assert "SLOWDOWN" not in compare_with_history(path, entry(1.15, 0.02))  # 15% < 10% + 8%
    assert "SLOWDOWN" not in compare_with_history(path, entry(0.7, 0.02))


def test_runs_compare_only_with_the_same_machine_type_and_work(tmp_path):
    path = history(tmp_path, entry(1.0, 0.01))
    assert "first run on this machine type" in compare_with_history(path, entry(3.0, 0.01, machine="other"))
    other_work = entry(3.0, 0.01) | {"overrides": ["ppo.rollout_batch_size=32"]}
    assert "first run" in compare_with_history(path, other_work)
    assert "first run" in compare_with_history(tmp_path / "absent.jsonl", entry(1.0, 0.01))


def test_round_spread_is_over_the_rounds_medians():
    rows = [{"seconds": s} for s in (1.0, 1.0, 9.0, 1.2, 1.2, 1.2, 0.9, 0.9, 0.1)]  # medians 1.0, 1.2, 0.9
    assert abs(round_spread(rows, 3) - (1.2 - 0.9) / 1.0) < 1e-12


def test_the_phase_table_puts_each_side_in_its_column():
    results = {"ours": {"split": {"generate": 0.2, "values": 0.05, "train": 1.5, "other": 0.01},
                        "seconds_per_iteration": 1.8},
               "trl": {"split": {"generate": 0.25, "values": 0.05, "update": 1.6, "gc": 0.4},
                       "seconds_per_iteration": 2.3}}
    lines = {line[:38].strip(): line[38:].split() for line in phase_table(results).splitlines()[1:]}
    assert lines["generate"] == ["0.200", "0.250"] and lines["update"] == ["1.500", "1.600"]
    assert lines["garbage collection"] == ["-", "0.400"] and lines["other (figures, logging)"] == ["0.010", "-"]
    assert lines["whole iteration (median)"] == ["1.800", "2.300"] and "forward: reference" not in lines


def test_phase_flops_go_to_the_innermost_phase_open_and_the_rest_outside():
    """`bench.flops.PhaseFlops`: an 8x8 by 8x8 product is 2 * 8^3 = 1024 FLOPs, counted where it ran."""
    import torch

    from bench.flops import PhaseFlops

    a = torch.ones(8, 8)
    flops = PhaseFlops(outside="update")
    a @ a  # before start: not counted
    flops.start()
    a @ a
    with flops.phase("forward"):
        a @ a
        with flops.phase("reference"):
            a @ a
            a @ a
    flops.stop()
    a @ a  # after stop: not counted
    assert dict(flops.by_phase) == {"update": 1024, "forward": 1024, "reference": 2048}
