"""The arithmetic of `wmrl bench grpo` (time to reach a real-sim success, ratio)."""

from wmrl.run.bench_grpo import compare, time_to_success


def _run(wall, succ):
    hist = [{"iteration": i + 1, "wall_s": wall} for i in range(len(succ) - 1)]
    evals = [{"iteration": i, "success": s} for i, s in enumerate(succ)]
    return {"history": hist, "evals": evals}


def test_time_to_success_counts_training_time_until_first_hit():
    r = _run(2.0, [0.2, 0.3, 0.5, 0.4])
    assert time_to_success(r["history"], r["evals"], 0.5) == (4.0, 2)
    assert time_to_success(r["history"], r["evals"], 0.2) == (0.0, 0)
    assert time_to_success(r["history"], r["evals"], 0.9) == (None, None)


def test_compare_uses_common_best_and_ratio():
    res = compare({"imagination": _run(1.0, [0.2, 0.4, 0.6]), "sim": _run(10.0, [0.2, 0.3, 0.5])})
    assert res["target_success"] == 0.5
    assert res["imagination"]["time_s"] == 2.0 and res["sim"]["time_s"] == 20.0
    assert res["ratio_sim_over_imagination"] == 10.0 and res["iteration_time_ratio"] == 10.0
    flat = compare({"imagination": _run(1.0, [0.2, 0.2]), "sim": _run(3.0, [0.2, 0.1])})
    assert flat["target_success"] is None and flat["ratio_sim_over_imagination"] is None
