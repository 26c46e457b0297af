"""benchmarks/bench_network.py and its modules: the rate-limited namespace, its clean-up, one real launch inside it,
argument checks and the reduction of launches to speed-ups (the full benchmark is `make bench`)."""

import json
import os
import random
import statistics
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from benchmarks import bench_network as bn, configs, launcher, netlink, report, stats, two_nodes as tn

needs_root = pytest.mark.skipif(netlink.check_privileges() is not None,
                                reason=f"bench_network: {netlink.check_privileges()}")

# a TCP transfer between two addresses in one process, printing "seconds bytes" (benchmarks/two_nodes.py)
SENDER = tn.TRANSFER


def _namespaces() -> str:
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout


def _transfer(ns: netlink.Namespace, nbytes: int) -> tuple[float, int, int]:
    """(seconds, bytes received, loopback tx bytes) of one TCP transfer on 127.0.0.1 inside ``ns``."""
    counter = ns.prefix() + ["cat", "/sys/class/net/lo/statistics/tx_bytes"]
    before = int(subprocess.run(counter, capture_output=True, text=True, check=True).stdout)
    out = subprocess.run(ns.prefix() + [sys.executable, "-c", SENDER, "127.0.0.1", "127.0.0.1", str(nbytes)], capture_output=True, text=True,
                         check=True, timeout=60).stdout.split()
    after = int(subprocess.run(counter, capture_output=True, text=True, check=True).stdout)
    return float(out[0]), int(out[1]), after - before


@needs_root
def test_namespace_limits_the_loopback_and_is_deleted():
    name = f"dgctest{uuid.uuid4().hex[:8]}"
    nbytes = 3_000_000
    with netlink.Namespace(name) as ns:
        assert name in _namespaces()
        ns.set_rate("20mbit")
        limited_s, received, tx = _transfer(ns, nbytes)
        ns.set_rate(None)
        free_s, _, _ = _transfer(ns, nbytes)
    assert name not in _namespaces()
    assert received == nbytes
    assert tx >= nbytes  # every byte crossed the namespace's loopback (plus TCP/IP headers)
    floor_s = nbytes * 8 / 20e6
    assert limited_s > 0.8 * floor_s, f"{nbytes} B at 20 Mbit/s took {limited_s:.2f} s (floor {floor_s:.2f} s)"
    assert free_s < limited_s / 3


@needs_root
def test_namespace_is_deleted_after_a_failure():
    name = f"dgctest{uuid.uuid4().hex[:8]}"
    with pytest.raises(RuntimeError, match="boom"):
        with netlink.Namespace(name) as ns:
            ns.set_rate("1gbit")
            raise RuntimeError("boom")
    assert name not in _namespaces()


@needs_root
def test_one_launch_inside_the_namespace_records_steps_and_bytes(tmp_path):
    args = bn.parse_args(["--rates", "1gbit", "--out-dir", str(tmp_path), "--n-layer", "1", "--n-embd", "32",
                          "--n-head", "2", "--block-size", "32"])
    with netlink.Namespace(f"dgctest{uuid.uuid4().hex[:8]}") as ns:
        ns.set_rate("1gbit")
        summary = launcher.launch(ns, configs.BY_NAME["int4_ef_wint4"], args, 3, 3, 1, "smoke")
    assert len(summary["step_times_s"]) == 3 and min(summary["step_times_s"]) > 0
    assert len(summary["step_net_tx_bytes"]) == 3
    # the namespace counter sees at least what rank 0 sent through the extension (gradients and weights)
    grads_and_params = (summary["grad_wire_bytes_total"] + summary["param_wire_bytes_total"]) / 3
    assert statistics.median(summary["step_net_tx_bytes"]) >= grads_and_params
    assert summary["dgc_stats"]["steps"] == 3
    assert json.loads((tmp_path / "configs" / "int4_ef_wint4.json").read_text())["dgc"]["weights"]["quantization"] == "int4"


@needs_root
def test_two_node_launches_count_only_what_crosses_between_the_nodes(tmp_path):
    """--nodes 2x2: 4 ranks as 2 nodes of 2 on two_nodes' link (1 Gbit/s between the nodes). Each step's bytes are
    the shaping classes': at least what rank 0 sent to the other node through the extension, and the hierarchical
    run (dense inside the node, compressed and hpZ between) sends far less across than stock fp32; the configs hold
    the hierarchical topology and hpZ over the node."""
    args = bn.parse_args(["--nodes", "2x2", "--rates", "1gbit", "--out-dir", str(tmp_path), "--n-layer", "1",
                          "--n-embd", "64", "--n-head", "2", "--block-size", "32"])
    assert args.ranks_per_node == 2 and args.configs == [c.name for c in configs.NODE_CONFIGS]
    with tn.TwoNodeLink("1gbit") as link:
        hier = launcher.launch(link, configs.BY_NAME["dgc_adam_hier"], args, 3, 3, 1, "hier")
        stock = launcher.launch(link, configs.BY_NAME["stock_fp32"], args, 3, 3, 1, "stock")
    assert hier["world_size"] == 4 and len(hier["step_net_tx_bytes"]) == 3
    crossed = hier["dgc_stats"]["grad_inter_node_wire_bytes_total"] + hier["dgc_stats"]["param_inter_node_wire_bytes_total"]
    assert crossed > 0 and statistics.median(hier["step_net_tx_bytes"]) >= crossed / 3
    assert statistics.median(stock["step_net_tx_bytes"]) > 5 * statistics.median(hier["step_net_tx_bytes"])
    cfg = json.loads((tmp_path / "configs" / "dgc_adam_hier.json").read_text())
    assert cfg["dgc"]["topology"] == "hierarchical" and cfg["dgc"]["ranks_per_node"] == 2
    assert cfg["zero_optimization"]["zero_hpz_partition_size"] == 2


def test_without_root_it_says_so_and_exits_2(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert bn.main(["--out-dir", str(tmp_path)]) == 2
    assert "needs root" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())  # nothing measured, nothing written


@pytest.mark.parametrize("argv, message", [
    (["--rates", "fast"], "not a tc rate"),
    (["--rates", "0mbit"], "not a tc rate"),
    (["--configs", "dgc_autox"], "unknown"),
    (["--configs", "nope"], "unknown"),
    (["--warmup-steps", "1"], "--warmup-steps must be >= 2"),
    (["--repeats", "0"], "--repeats must be >= 1"),
    (["--nodes", "3x2"], "is not 2xL"),
    (["--nodes", "2x"], "is not 2xL"),
    (["--nodes", "2x2", "--configs", "dgc_d001"], "unknown ['dgc_d001'] with --nodes"),
    (["--rates", "infgbit"], "not a tc rate"),
    (["--converge-steps", "5", "--eval-interval", "10"], "shorter than --eval-interval"),
    (["--reuse-convergence", "/nonexistent/dir"], "no such directory"),
])
def test_bad_arguments_are_named(argv, message, capsys):
    with pytest.raises(SystemExit):
        bn.parse_args(argv)
    assert message in capsys.readouterr().err


def test_stock_baselines_are_always_run():
    assert bn.parse_args(["--configs", "dgc_d001"]).configs == ["stock_fp32", "stock_bf16", "dgc_d001"]
    assert configs.BY_NAME["dgc_auto"].dgc["density"] == "auto"
    assert netlink.parse_rate_bits("100mbit") == 1e8 and netlink.parse_rate_bits("1gbit") == 1e9


def _summary(val_losses, steps=20):
    return {"final_val_loss": val_losses[-1][1], "val_losses": val_losses, "steps": steps, "dgc_stats": None,
            "grad_wire_bytes_total": None, "param_wire_bytes_total": None, "compression_ratio": 1.0}


def test_analysis_takes_medians_of_same_round_ratios_and_the_time_to_the_stock_loss():
    args = bn.parse_args(["--configs", "int4_ef_wint4", "--rates", "100mbit", "--converge-steps", "20",
                          "--target-step", "20"])
    convergence = {
        "stock_fp32": _summary([[10, 2.6], [20, 2.4]]),
        "stock_bf16": _summary([[10, 2.6], [20, 2.41]]),
        "int4_ef_wint4": _summary([[10, 2.39], [20, 2.35]]),
    }
    # rounds drift: round 2 is twice as slow for everyone; ratios within a round stay put
    rounds = [{"stock_fp32": (10.0, 1e8), "stock_bf16": (7.0, 7e7), "int4_ef_wint4": (2.0, 1e7)},
              {"stock_fp32": (20.0, 1e8), "stock_bf16": (14.0, 7e7), "int4_ef_wint4": (4.0, 1e7)},
              {"stock_fp32": (12.0, 1e8), "stock_bf16": (8.4, 7e7), "int4_ef_wint4": (2.4, 1e7)}]
    results = stats.analyse(args, convergence, {"100mbit": rounds})
    r = results["rates"]["100mbit"]
    assert r["int4_ef_wint4"]["speedup_vs_fp32"] == pytest.approx(5.0)
    assert r["int4_ef_wint4"]["speedup_vs_bf16"] == pytest.approx(3.5)
    assert r["int4_ef_wint4"]["step_s"] == pytest.approx(2.4)
    assert r["int4_ef_wint4"]["wire_vs_stock_fp32"] == pytest.approx(10.0)
    assert r["int4_ef_wint4"]["time_to_target_s"] == pytest.approx(10 * 2.4)  # reached at step 10
    assert r["stock_bf16"]["time_to_target_s"] is None  # 2.41 > 2.4: not reached
    assert r["int4_ef_wint4"]["time_to_target_vs_fp32"] == pytest.approx(10 * 2.4 / (20 * 12.0))
    # 1e7 bytes per step in 2.4 s of a 100 Mbit/s link: 1e7 / (1.25e7 x 2.4)
    assert r["int4_ef_wint4"]["link_utilisation"] == pytest.approx(1e7 / (1.25e7 * 2.4))
    assert results["configs"]["int4_ef_wint4"]["val_gap_pct"] == pytest.approx(100 * (2.35 - 2.4) / 2.4)
    table = report.markdown(args, results, {"date": "today", "machine": "here", "n_params": 1000})
    assert "| 5.00x | 3.50x |" in table and "not reached" in table


def test_the_loss_compared_is_the_whole_validation_splits_where_every_run_has_it():
    """analyse compares holdout_val_loss (the whole validation split, --holdout-eval) where every loss run, a
    per-rate one's included, has one, and the last periodic evaluation's otherwise: never one kind against the
    other."""
    rng = random.Random()
    args = bn.parse_args(["--configs", "policy_auto", "--rates", "100mbit", "--converge-steps", "20",
                          "--target-step", "10"])
    sampled = {n: [[10, 2.6 + rng.random()], [20, 2.3 + rng.random()]] for n in args.configs}
    holdout = {n: 2.0 + rng.random() for n in args.configs}
    convergence = {n: dict(_summary(sampled[n]), holdout_val_loss=holdout[n], holdout_tokens=1024)
                   for n in args.configs}
    own = 2.0 + rng.random()
    per_rate = {"100mbit": {"policy_auto": dict(_summary([[10, 3.0], [20, 2.9]]), holdout_val_loss=own)}}
    rounds = {"100mbit": [{n: (1.0, 1e6) for n in args.configs}]}
    results = stats.analyse(args, convergence, rounds, per_rate)
    assert results["loss_key"] == "holdout_val_loss" and results["holdout_tokens"] == 1024
    gap = results["configs"]["policy_auto"]["val_gap_pct"]
    assert gap == pytest.approx(100 * (holdout["policy_auto"] - holdout["stock_fp32"]) / holdout["stock_fp32"])
    assert results["configs"]["policy_auto"]["val_loss_last_evaluation"] == sampled["policy_auto"][-1][1]
    assert results["rates"]["100mbit"]["policy_auto"]["val_loss"] == own
    assert "whole validation split (1,024 tokens)" in report.markdown(args, results, {"date": "d", "machine": "m",
                                                                               "n_params": 1})
    # one run without it (a reused run of before --holdout-eval): the last periodic evaluation for all
    del per_rate["100mbit"]["policy_auto"]["holdout_val_loss"]
    results = stats.analyse(args, convergence, rounds, per_rate)
    assert results["loss_key"] == "final_val_loss"
    assert results["configs"]["stock_bf16"]["val_loss"] == sampled["stock_bf16"][-1][1]
    assert results["rates"]["100mbit"]["policy_auto"]["val_loss"] == 2.9


def test_reuse_convergence_takes_matching_runs_and_trains_the_missing(tmp_path):
    args = bn.parse_args(["--reuse-convergence", str(tmp_path), "--converge-steps", "80"])
    (tmp_path / "converge_stock_fp32.json").write_text(json.dumps({"steps": 80, "seed": 1234, "final_val_loss": 2.5}))
    (tmp_path / "converge_stock_bf16.json").write_text(json.dumps({"steps": 40, "seed": 1234}))
    assert bn.reused(args, configs.BY_NAME["stock_fp32"])["final_val_loss"] == 2.5
    assert bn.reused(args, configs.BY_NAME["dgc_auto"]) is None  # not in that run: trained
    with pytest.raises(SystemExit, match="steps 40"):
        bn.reused(args, configs.BY_NAME["stock_bf16"])


def test_time_to_target_takes_stock_fp32s_loss_at_the_target_step_and_a_per_rate_configurations_own_run(tmp_path):
    args = bn.parse_args(["--configs", "int4_ef_wint4", "policy_auto", "--rates", "100mbit", "--converge-steps", "40",
                          "--eval-interval", "10"])
    assert args.target_step == 20  # half of the run, an evaluation step
    stock = [[10, 3.0], [20, 2.5], [30, 2.3], [40, 2.2]]
    convergence = {"stock_fp32": _summary(stock, 40), "stock_bf16": _summary(stock, 40),
                   "int4_ef_wint4": _summary([[10, 2.9], [20, 2.6], [30, 2.45], [40, 2.3]], 40),
                   # policy_auto on the unlimited link chose stock: stock's curve
                   "policy_auto": _summary(stock, 40)}
    # at 100mbit it chose compressed: its own run there, reaching the target only at step 40
    per_rate = {"100mbit": {"policy_auto": dict(_summary([[10, 3.1], [20, 2.7], [30, 2.6], [40, 2.5]], 40),
                                                dgc_stats={"stock_buckets_total": 0})}}
    rounds = [{"stock_fp32": (10.0, 1e8), "stock_bf16": (7.0, 7e7), "int4_ef_wint4": (2.0, 1e7),
               "policy_auto": (2.5, 1e7)}]
    unlimited = [{"stock_fp32": (1.0, 1e8), "stock_bf16": (1.0, 7e7), "int4_ef_wint4": (1.1, 1e7),
                  "policy_auto": (1.0, 1e8)}]
    results = stats.analyse(args, convergence, {"100mbit": rounds, netlink.UNLIMITED: unlimited}, per_rate)
    assert results["target"] == {"step": 20, "loss": 2.5, "of": "stock_fp32"}
    slow, fast = results["rates"]["100mbit"], results["rates"][netlink.UNLIMITED]
    assert slow["stock_fp32"]["steps_to_target"] == 20 and slow["stock_fp32"]["time_to_target_s"] == 200.0
    assert slow["int4_ef_wint4"]["steps_to_target"] == 30 and slow["int4_ef_wint4"]["time_to_target_s"] == 60.0
    assert slow["int4_ef_wint4"]["time_to_target_vs_fp32"] == pytest.approx(0.3)
    assert slow["policy_auto"]["loss_run"] == "this rate" and slow["policy_auto"]["steps_to_target"] == 40
    assert slow["policy_auto"]["val_loss"] == 2.5 and slow["policy_auto"]["stock_buckets_total"] == 0
    assert fast["policy_auto"]["loss_run"] == netlink.UNLIMITED and fast["policy_auto"]["steps_to_target"] == 20
    assert fast["policy_auto"]["link_utilisation"] is None
    table = report.markdown(args, results, {"date": "today", "machine": "here", "n_params": 1000})
    assert "| 30 | 60.0 | 0.30x |" in table and "| 2.5000* |" in table
    report.plot(args, results, tmp_path / "plot.png")
    assert (tmp_path / "plot.png").stat().st_size > 10000


@pytest.mark.parametrize("argv", [["--target-step", "15"], ["--target-step", "90"], ["--target-step", "0"]])
def test_a_target_step_that_is_not_an_evaluation_step_is_refused(argv, capsys):
    with pytest.raises(SystemExit):
        bn.parse_args(["--converge-steps", "80", "--eval-interval", "10"] + argv)
    assert "not an evaluation step" in capsys.readouterr().err


def test_several_targets_and_the_tables_made_again_from_an_earlier_runs_launches(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    args = bn.parse_args(["--configs", "int4_ef_wint4", "--rates", "100mbit", "--converge-steps", "40",
                          "--eval-interval", "10"])
    meta_args = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    stock = [[10, 3.0], [20, 2.5], [30, 2.3], [40, 2.2]]
    for name, losses in [("stock_fp32", stock), ("stock_bf16", stock),
                         ("int4_ef_wint4", [[10, 2.9], [20, 2.6], [30, 2.45], [40, 2.3]])]:
        (run / f"converge_{name}.json").write_text(json.dumps(_summary(losses, 40)))
    timing = {"100mbit": [{"stock_fp32": [10.0, 1e8], "stock_bf16": [7.0, 7e7], "int4_ef_wint4": [2.0, 1e7]}],
              netlink.UNLIMITED: [{"stock_fp32": [1.0, 1e8], "stock_bf16": [1.0, 7e7], "int4_ef_wint4": [1.1, 1e7]}]}
    (run / "results.json").write_text(json.dumps({"meta": {"args": meta_args, "date": "d", "machine": "m",
                                                           "n_params": 10, "command": "python bench"},
                                                  "timing_rounds": timing}))
    out = tmp_path / "out"
    # the run's steps and configurations come from it, whatever this command says
    assert bn.main(["--reanalyse", str(run), "--target-steps", "30", "10", "--converge-steps", "80",
                    "--out-dir", str(out)]) == 0
    results = json.loads((out / "results.json").read_text())["results"]
    assert [t["step"] for t in results["targets"]] == [30, 10] and results["target"]["loss"] == 2.3
    slow = results["rates"]["100mbit"]["int4_ef_wint4"]
    # 2.3 first reached at step 40, 3.0 at step 10; 2 s per step
    assert [t["time_to_target_s"] for t in slow["targets"]] == [80.0, 20.0]
    assert slow["targets"][0]["time_to_target_vs_fp32"] == pytest.approx(80.0 / 300.0)
    table = (out / "results.md").read_text()
    assert "Tables made again" in table and "| int4_ef_wint4 | 80.0 (step 40, 0.27x) |" in table
    assert (out / "bench_network.png").is_file()
    with pytest.raises(SystemExit, match="no results.json"):
        bn.parse_args(["--reanalyse", str(tmp_path)])


def test_several_seeds_compare_the_means_of_their_losses_and_reach_the_target_on_the_mean_curves(tmp_path):
    """--seeds 3: each configuration's loss runs at seeds 1234-1236 (the later ones tagged _seed<S>), policy_auto's
    own run at a rate too; the tables take the mean of the whole-split losses, time to target on the mean curve, and
    list every seed's loss. Made through --reanalyse of written launches (no training here)."""
    rng = random.Random()
    run = tmp_path / "run"
    run.mkdir()
    args = bn.parse_args(["--configs", "int4_ef_wint4", "policy_auto", "--rates", "100mbit", "--converge-steps", "20",
                          "--target-steps", "10", "--seeds", "3"])
    assert bn.loss_seeds(args) == [(1234, None), (1235, 1235), (1236, 1236)]
    holdout, curves = {}, {}
    for name, rate in [(n, None) for n in args.configs] + [("policy_auto", "100mbit")]:
        for seed, extra in bn.loss_seeds(args):
            curve = [[10, 2.5 + rng.random()], [20, 2.0 + rng.random()]]
            summary = dict(_summary(curve), seed=seed, holdout_val_loss=2.0 + rng.random(), holdout_tokens=4096)
            holdout[name, rate, seed], curves[name, rate, seed] = summary["holdout_val_loss"], curve
            (run / f"{bn.converge_tag(configs.BY_NAME[name], rate, extra)}.json").write_text(json.dumps(summary))
    timing = {"100mbit": [{n: [1.0 + i, 1e6] for i, n in enumerate(args.configs)}]}
    meta_args = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    (run / "results.json").write_text(json.dumps({"meta": {"args": meta_args, "date": "d", "machine": "m",
                                                           "n_params": 10}, "timing_rounds": timing}))
    out = tmp_path / "out"
    assert bn.main(["--reanalyse", str(run), "--out-dir", str(out)]) == 0
    results = json.loads((out / "results.json").read_text())["results"]
    mean = {k: statistics.fmean(holdout[k + (s, )] for s in (1234, 1235, 1236))
            for k in [(n, None) for n in args.configs] + [("policy_auto", "100mbit")]}
    stock = mean["stock_fp32", None]
    assert results["configs"]["stock_fp32"]["val_loss"] == pytest.approx(stock)
    assert results["configs"]["int4_ef_wint4"]["val_gap_pct"] == pytest.approx(
        100 * (mean["int4_ef_wint4", None] - stock) / stock)
    slow = results["rates"]["100mbit"]
    assert slow["policy_auto"]["val_loss"] == pytest.approx(mean["policy_auto", "100mbit"])
    # the target is stock's mean loss at step 10; a configuration reaches it where its mean curve is at or below
    target = statistics.fmean(curves["stock_fp32", None, s][0][1] for s in (1234, 1235, 1236))
    assert results["target"]["loss"] == pytest.approx(target)
    int4_mean = [statistics.fmean(curves["int4_ef_wint4", None, s][i][1] for s in (1234, 1235, 1236)) for i in (0, 1)]
    reached = next((st for st, v in zip((10, 20), int4_mean) if v <= target), None)
    assert slow["int4_ef_wint4"]["steps_to_target"] == reached
    table = (out / "results.md").read_text()
    assert "the mean of each configuration's runs at seeds 1234-1236" in table
    row = next(line for line in table.splitlines() if line.startswith("| int4_ef_wint4 | 2."))
    assert row.startswith("| int4_ef_wint4 | " + " | ".join(f"{holdout['int4_ef_wint4', None, s]:.4f}"
                                                            for s in (1234, 1235, 1236)))
    assert any(line.startswith("| policy_auto (100mbit, its own run) |") for line in table.splitlines())
    # a reanalysed DIR without some seeds' runs of a configuration: the mean of those there, "—" for the others
    (run / "converge_int4_ef_wint4_seed1236.json").unlink()
    assert bn.main(["--reanalyse", str(run), "--out-dir", str(out)]) == 0
    results = json.loads((out / "results.json").read_text())["results"]
    assert results["configs"]["int4_ef_wint4"]["val_loss"] == pytest.approx(
        statistics.fmean(holdout["int4_ef_wint4", None, s] for s in (1234, 1235)))
    assert any(line.startswith("| int4_ef_wint4 | 2.") and "| — |" in line
               for line in (out / "results.md").read_text().splitlines())
    # a configuration with one run there has no spread
    for seed in (1235, 1236):
        (run / f"converge_int4_ef_wint4_seed{seed}.json").unlink(missing_ok=True)
    assert bn.main(["--reanalyse", str(run), "--out-dir", str(out)]) == 0
    assert any(line.startswith("| int4_ef_wint4 | 2.") and line.endswith("| — (one run) |")
               for line in (out / "results.md").read_text().splitlines())
    # a run made with --reuse-convergence: its loss runs are in the reused DIR, which --reanalyse also reads
    timed_only = tmp_path / "timed_only"
    timed_only.mkdir()
    (timed_only / "results.json").write_text(json.dumps({"meta": {"args": dict(meta_args, reuse_convergence=str(run)),
                                                                  "date": "d", "machine": "m", "n_params": 10},
                                                         "timing_rounds": timing}))
    assert bn.main(["--reanalyse", str(timed_only), "--out-dir", str(tmp_path / "out2")]) == 0
    assert json.loads((tmp_path / "out2" / "results.json").read_text())["results"]["configs"]["stock_fp32"][
        "val_loss"] == pytest.approx(stock)
    (timed_only / "results.json").write_text(json.dumps({"meta": {"args": meta_args, "date": "d", "machine": "m",
                                                                  "n_params": 10}, "timing_rounds": timing}))
    with pytest.raises(SystemExit, match="no loss run converge_stock_fp32.json"):
        bn.main(["--reanalyse", str(timed_only), "--out-dir", str(tmp_path / "out2")])
    # a seed's run that evaluated at other steps is refused, not averaged
    with pytest.raises(SystemExit, match="same steps"):
        stats.mean_over_seeds([_summary([[10, 2.5], [20, 2.0]]), _summary([[10, 2.5]])])
    # --reuse-convergence checks each run's own seed
    reuse = bn.parse_args(["--reuse-convergence", str(run), "--converge-steps", "20", "--seeds", "2"])
    assert bn.reused(reuse, configs.BY_NAME["stock_fp32"], None, 1235)["seed"] == 1235
    (run / "converge_stock_fp32_seed1235.json").write_text(json.dumps(dict(_summary([[20, 2.0]]), seed=1234)))
    with pytest.raises(SystemExit, match="seed 1234"):
        bn.reused(reuse, configs.BY_NAME["stock_fp32"], None, 1235)


def test_machine_names_the_cpu_model_clock_and_vector_width():
    """Two hosts that both call themselves "AMD EPYC" are told apart (family, model, clock, widest vector extension),
    and the measured matmul rate is a positive number."""
    zen1 = ("processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 23\nmodel\t\t: 1\nmodel name\t: AMD EPYC\n"
            "cpu MHz\t\t: 1996.249\nflags\t\t: fpu sse4_2 avx avx2 fma\n\nprocessor\t: 1\nmodel name\t: other\n")
    assert report.cpu_description(zen1) == "AMD EPYC (family 23 model 1, 1996 MHz, AVX2)"
    zen4 = zen1.replace(": 1\nmodel name", ": 17\nmodel name").replace("cpu family\t: 23", "cpu family\t: 25") \
        .replace("fma", "fma avx512f").replace("1996.249", "2600.0")
    assert report.cpu_description(zen4) == "AMD EPYC (family 25 model 17, 2600 MHz, AVX-512)"
    assert report.cpu_description("flags: sse2\n") == "unknown CPU"
    assert report.cpu_description("model name\t: Some CPU\nflags\t: sse2 sse4_2\n") == "Some CPU (SSE4.2)"
    assert 0 < report.matmul_gflops(n=128, repeats=3) < 10_000
